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
                                         (600, 1, 2), (257, 300, 64)])
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
    real = gather_fused.run_gather_fused
    monkeypatch.setattr(native, "run_gather_fused", lambda *a: calls.append(1) or real(*a))
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
