"""The native backend's C call for the 950's SyncBatchNormGatherStatsFused: the raw bits of its
numpy semantics (l0ops.syncbn) for every dtype, one rank to hundreds (the blocked sums from
256 ranks on, nested when a block is itself that long), NaN, infinities and signed zeros, and
through aclnnBatchNormGatherStatsWithCounts on the Ascend950 with the numpy backend's bits."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import opgraph
from backends import native
from opgraph import aclnn
from opgraph.core import backend as backend_registry
from backends.native import gather_fused
from l0ops.syncbn import SyncBatchNormGatherStatsFused as G
from opgraph.ops import batch_norm_gather_stats_with_counts

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def stats(W: int, C: int, dtype, seed: int, special: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    mean = (rng.standard_normal((W, C)) * 3).astype(dtype)
    invstd = (rng.random((W, C)) + 0.25).astype(dtype)
    counts = rng.integers(1, 50, W).astype(np.float32)
    rm, rv = rng.standard_normal((1, C)).astype(dtype), (rng.random((1, C)) + 0.5).astype(dtype)
    if special:  # a NaN, an infinity, a zero invstd and signed zeros among the ranks
        mean[0, 0], invstd[-1, -1], invstd[W // 2, C // 2] = np.nan, np.inf, 0
        mean[:, C - 1] = -0.0
        rm[0, 0] = -0.0
    return [mean, invstd, counts, rm, rv]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("W, C, cores", [(1, 64, 64), (3, 5, 64), (8, 1, 64), (300, 4, 64),
                                         (600, 1, 2), (257, 300, 64),
                                         (300, 4, 1)])  # one core (it recursed: a segfault)
@pytest.mark.parametrize("special", [False, True], ids=["finite", "special"])
def test_bits_equal_the_numpy_semantics(dt, W, C, cores, special):
    xs = stats(W, C, DTYPES[dt], W * C, special)
    a = G.make_attrs(momentum=0.1, eps=1e-5, cores=cores)
    with np.errstate(all="ignore"):  # inf and NaN are the point here
        got, want = gather_fused.run_gather_fused(a, xs), G.compute(xs, a)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(bits(g), bits(w))


def test_operands_of_mixed_dtypes_and_strided_views():
    """float32 statistics with bf16 running stats (each loaded in its own dtype), and strided
    operands (made contiguous first)."""
    xs = stats(4, 6, np.float32, 1, True)
    xs[3], xs[4] = xs[3].astype(ml_dtypes.bfloat16), xs[4].astype(ml_dtypes.bfloat16)
    xs[0] = np.asfortranarray(xs[0])
    a = G.make_attrs(momentum=0.3, eps=1e-3, cores=64)
    with np.errstate(all="ignore"):
        pairs = list(zip(gather_fused.run_gather_fused(a, xs), G.compute(xs, a)))
    for g, w in pairs:
        assert np.array_equal(bits(g), bits(w))


def test_the_op_api_on_the_950_runs_the_c_call_with_numpys_bits(monkeypatch):
    calls = []
    real = gather_fused._run
    monkeypatch.setattr(gather_fused, "_run", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(5)
    bf = ml_dtypes.bfloat16
    x = opgraph.tensor(rng.standard_normal((2, 8, 3, 3)).astype(bf))
    mean, invstd = rng.standard_normal((3, 8)).astype(bf), (rng.random((3, 8)) + 0.5).astype(bf)
    counts = np.float32([18, 5, 7])
    results = {}
    for backend in ("numpy", "native"):
        rm, rv = np.zeros(8, bf), np.ones(8, bf)
        with opgraph.platform("Ascend950"), opgraph.use_backend(backend):
            m, s = batch_norm_gather_stats_with_counts(x, mean, invstd, rm, rv, 0.1, 1e-5, counts)
        results[backend] = [bits(v) for v in (m, s, rm, rv)]
    assert calls  # the native run took the C call
    assert all(np.array_equal(g, w) for g, w in zip(results["native"], results["numpy"]))


def gather_case(seed: int, W: int, C: int, counts_dtype=np.float32, rm_step: int = 1) -> list:
    """The layer's arguments on the 950: bf16 input, float32 statistics and running stats."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, C, 3, 3)).astype(ml_dtypes.bfloat16)
    mean = (rng.standard_normal((W, C)) * 3).astype(np.float32)
    invstd = (rng.random((W, C)) + 0.25).astype(np.float32)
    rm = rng.standard_normal(C * rm_step).astype(np.float32)[::rm_step]
    rv = (rng.random(C) + 0.5).astype(np.float32)
    return [x, mean, invstd, rm, rv, 0.1, 1e-5, rng.integers(1, 50, W).astype(counts_dtype)]


@pytest.mark.parametrize("counts", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("W, C", [(1, 64), (3, 5), (300, 4)])
def test_the_gather_on_the_950_runs_straight_on_the_callers_tensors(W, C, counts, monkeypatch):
    """Repeated calls (new arrays of one layout) run the C call on the tensors' addresses, not
    node by node, with the numpy backend's bits, the running stats updated in place; counts in
    a half-precision model's dtype (as the layer passes them) through the graph's Cast."""
    direct, lowered = [], []
    monkeypatch.setattr(gather_fused.DirectGather, "run",
                        lambda self, b, real=gather_fused.DirectGather.run: direct.append(1) or real(self, b))
    real = gather_fused.run_gather_fused
    monkeypatch.setattr(native, "run_gather_fused", lambda *a: lowered.append(1) or real(*a))
    for seed in range(3):
        results = {}
        for backend in ("numpy", "native"):
            args = gather_case(seed, W, C, counts_dtype=counts)
            with opgraph.platform("Ascend950"), opgraph.use_backend(backend):
                m, s = batch_norm_gather_stats_with_counts(*args)
            results[backend] = [bits(v) for v in (m, s, args[3], args[4])]
        assert all(np.array_equal(g, w) for g, w in zip(results["native"], results["numpy"]))
    assert len(direct) == 3 and lowered == []  # every native call took the direct run


def test_a_gather_the_direct_run_does_not_cover_runs_node_by_node(monkeypatch):
    """Running stats that are not one run of elements (the graph copies them first) keep the
    node-by-node run (its C call on contiguous copies), with numpy's bits."""
    direct = []
    monkeypatch.setattr(gather_fused.DirectGather, "run", lambda self, b: direct.append(1))
    results = {}
    for backend in ("numpy", "native"):
        for _ in range(2):  # the second call finds the cached program
            args = gather_case(9, 3, 6, rm_step=2)
            with opgraph.platform("Ascend950"), opgraph.use_backend(backend):
                m, s = batch_norm_gather_stats_with_counts(*args)
        results[backend] = [bits(v) for v in (m, s, args[3], args[4])]
    assert all(np.array_equal(g, w) for g, w in zip(results["native"], results["numpy"]))
    assert direct == []


@pytest.mark.parametrize("how", ["strided", "read-only"])
def test_the_direct_gather_refuses_bindings_it_cannot_write_as_one_run(how):
    """What the direct run checks before its first call, for a caller of ``run_direct`` whose
    tensors break the contract: an operand not one run of elements, a read-only result."""
    args = [opgraph.tensor(a) if isinstance(a, np.ndarray) else a for a in gather_case(4, 3, 6)]
    outs = [opgraph.tensor(np.zeros(6, np.float32)) for _ in range(2)]
    with opgraph.platform("Ascend950"), opgraph.use_backend("native"), opgraph.opt_level(2):
        status, ws, ex = aclnn.aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize(*args, *outs)
        assert status == 0
        exe = ex.program.executable(backend_registry.get("native"))
    names = [v.name for v in exe.graph.inputs]
    bindings = dict(zip(names, [*[a for a in args if isinstance(a, opgraph.Tensor)], *outs]))
    assert exe.gather is not None and exe.gather.prepare(bindings)  # as recorded: it can
    if how == "strided":
        bindings["runningVar"] = opgraph.tensor(np.zeros(12, np.float32)[::2])
    else:
        bindings["meanAll"] = opgraph.tensor(np.zeros(6, np.float32))
        bindings["meanAll"].view().flags.writeable = False
    assert not exe.gather.prepare(bindings)
