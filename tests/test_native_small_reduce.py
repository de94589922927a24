"""The native backend's direct run of a FusedReduce program (BatchNormStats, BatchNormReduceBackward
and BatchNormGatherStatsWithCounts at level 2: below the size threshold one serial C call on the
bound tensors, above it the reduction passes on their views, each result copied into the caller's
output, no interpreter): bit-identical to the numpy backend over a cached program with new tensors,
on both sides of the threshold, for float16 results (aliased outputs compile as recorded and run
node by node); a threshold moved across the size after preparing, or a profiled run, goes node by
node."""
from __future__ import annotations

import numpy as np
import pytest

import opgraph
from backends import native
from native_limits import reduce_limits_at
from backends.native.direct_reduce import DirectReduce
from opgraph import aclnn as A
from opgraph.aclnn.cache import EXECUTOR_CACHE
from opgraph.core import backend as backend_registry

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])
C = 5


def stats(x, outs):
    return A.aclnnBatchNormStatsGetWorkspaceSize, A.aclnnBatchNormStats, [x, 1e-5, *outs]


def reduce_backward(x, outs):
    rng = np.random.default_rng(int(x.view().sum() * 8) % 1000)
    dy = opgraph.tensor(rng.standard_normal(x.shape).astype(x.dtype.np))
    m, i, w = (opgraph.tensor(rng.standard_normal(C).astype(np.float32)) for _ in range(3))
    return (A.aclnnBatchNormReduceBackwardGetWorkspaceSize, A.aclnnBatchNormReduceBackward,
            [dy, x, m, i, w, True, True, True, *outs])


def gather(x, outs):
    rng = np.random.default_rng(7)
    m, i = (opgraph.tensor(rng.random((3, C), np.float32) + 0.5) for _ in range(2))
    rm, rv = opgraph.tensor(np.zeros(C, np.float32)), opgraph.tensor(np.ones(C, np.float32))
    counts = opgraph.tensor(np.float32([4, 2, 6]))
    return (A.aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize,
            A.aclnnBatchNormGatherStatsWithCounts, [x, m, i, rm, rv, 0.1, 1e-5, counts, *outs])


OPS = {"stats": (stats, 2), "reduce_backward": (reduce_backward, 4), "gather": (gather, 2)}


def run(backend: str, op: str, x: np.ndarray, out_dtype=np.float32, alias: bool = False):
    """The op's outputs (and its executor) on ``backend`` at level 2."""
    make, n = OPS[op]
    outs = [np.full(C, np.nan, out_dtype) for _ in range(n)]
    if alias:
        outs = [outs[0]] * n
    with opgraph.use_backend(backend), opgraph.opt_level(2):
        p1, p2, args = make(opgraph.tensor(x), [opgraph.tensor(o) for o in outs])
        status, ws, ex = p1(*args)
        assert status == 0
        assert p2(bytearray(ws) if ws else None, ws, ex) == 0
    return outs, ex


SMALL, LARGE = (2, C, 3), (64, C, 16)  # 30 and 5120 elements: under and over the 4096 threshold
SIZES = pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["small", "large"])


def data(seed: int, shape=SMALL, dtype=np.float32) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 3 + 1).astype(dtype)


def direct_of(ex):
    return ex.program.built_executable(backend_registry.get("native")).direct_reduce


@SIZES
@pytest.mark.parametrize("op", OPS)
def test_cached_program_with_new_tensors_matches_numpy_bit_for_bit(op, shape, monkeypatch):
    runs = []
    real = DirectReduce.run
    monkeypatch.setattr(DirectReduce, "run", lambda self, *a: runs.append(self.small) or real(self, *a))
    EXECUTOR_CACHE.clear()
    for seed in range(3):  # the later calls reuse the cached program, on new tensors
        x = data(seed, shape)
        got, ex = run("native", op, x)
        want, _ = run("numpy", op, x)
        assert all(np.array_equal(g.view(np.uint32), w.view(np.uint32)) for g, w in zip(got, want))
    small = shape == SMALL or op == "gather"  # the gather's body reads [ranks, C] values only
    assert direct_of(ex) is not None and runs == [small] * 3


@SIZES
def test_float16_results_are_cast_as_the_node_casts_them(shape):
    """float16 input and mean: the reduce-backward sums are float16 registers, overflowing to
    inf here, read back without a warning (the caller's errstate raises)."""
    EXECUTOR_CACHE.clear()
    x = (data(4, shape, dtype=np.float32) * 3000).astype(np.float16)
    make, n = OPS["reduce_backward"]
    results = {}
    for backend in ("native", "numpy"):
        outs = [np.zeros(C, np.float16) for _ in range(n)]
        rng = np.random.default_rng(1)
        dy = opgraph.tensor((rng.random(x.shape) * 5000 + 20000).astype(np.float16))  # Σ > 65504
        m = opgraph.tensor(rng.standard_normal(C).astype(np.float16))
        i, w = (opgraph.tensor(rng.standard_normal(C).astype(np.float32)) for _ in range(2))
        with opgraph.use_backend(backend), opgraph.opt_level(2), np.errstate(all="raise"):
            args = [dy, opgraph.tensor(x), m, i, w, True, True, True,
                    *[opgraph.tensor(o) for o in outs]]
            status, ws, ex = A.aclnnBatchNormReduceBackwardGetWorkspaceSize(*args)
            assert status == 0
            assert A.aclnnBatchNormReduceBackward(bytearray(ws) if ws else None, ws, ex) == 0
        results[backend] = outs
        if backend == "native":
            assert direct_of(ex) is not None
    assert any(np.isinf(o).any() for o in results["numpy"])  # the overflow case is exercised
    assert all(np.array_equal(g.view(np.uint16), w.view(np.uint16))
               for g, w in zip(results["native"], results["numpy"]))


@SIZES
def test_aliased_outputs_end_as_the_node_by_node_run_leaves_them(shape):
    """Outputs sharing memory compile as recorded (tests/test_shared_outputs.py): no direct run,
    the native backend's node-by-node run leaves what numpy's does."""
    x = data(5, shape)
    got, ex = run("native", "stats", x, alias=True)
    want, _ = run("numpy", "stats", x, alias=True)
    assert np.array_equal(got[0].view(np.uint32), want[0].view(np.uint32))
    assert ex.program.opt_level == 0 and direct_of(ex) is None


@pytest.mark.parametrize("shape, moved", [(SMALL, 8), (LARGE, 1 << 20)], ids=["lowered", "raised"])
def test_a_threshold_moved_across_the_size_runs_node_by_node(shape, moved, monkeypatch):
    done = []
    real = DirectReduce.run
    monkeypatch.setattr(DirectReduce, "run", lambda self, *a: done.append(real(self, *a)) or done[-1])
    EXECUTOR_CACHE.clear()
    x = data(6, shape)
    got, ex = run("native", "stats", x)
    assert direct_of(ex).small == (shape == SMALL) and done[-1] is True
    reduce_limits_at(monkeypatch, moved)  # SMALL's sums are short
    got, _ = run("native", "stats", x)  # the prepared direct run does not apply any more
    assert len(done) == 2 and done[-1] is False
    want, _ = run("numpy", "stats", x)
    assert all(np.array_equal(g.view(np.uint32), w.view(np.uint32)) for g, w in zip(got, want))


@SIZES
def test_a_profiled_run_sees_every_node(shape):
    x = data(8, shape)
    run("native", "stats", x)
    _, ex = run("native", "stats", x)
    exe = ex.program.built_executable(backend_registry.get("native"))
    seen = []
    exe.profile = lambda node, start, stop: seen.append(node.op)
    try:
        got, _ = run("native", "stats", x)
    finally:
        del exe.profile
    assert seen == ["FusedReduce", "ViewCopy", "ViewCopy"]
    want, _ = run("numpy", "stats", x)
    assert all(np.array_equal(g.view(np.uint32), w.view(np.uint32)) for g, w in zip(got, want))


def _broadcast_results(kind: str) -> opgraph.Graph:
    """A FusedReduce one of whose results is a broadcast: of the input itself, or of its sum."""
    g = opgraph.Graph(kind)
    ch = g.add_input("ch", opgraph.TensorType((3,), opgraph.DataType.FLOAT))
    total = g.add_node("ReduceSum", [ch], axes=(0,), keepdims=kind == "sum").outputs[0]
    spread = ch if kind == "input" else total
    row = g.add_node("UnsqueezeNd", [spread], dims=(0,)).outputs[0] if kind == "input" else spread
    g.outputs = [total, g.add_node("BroadcastTo", [row], shape=(2, 3)).outputs[0]]
    return opgraph.passes.optimize(g, 2)


@pytest.mark.parametrize("kind", ["input", "sum"])
def test_a_broadcast_result_of_the_serial_call_is_read_after_it_runs(kind):
    """The reader of a broadcast result copied the scratch when it was made, before the call:
    the first run gave garbage, later ones the previous run's values."""
    opt = _broadcast_results(kind)
    assert [n.op for n in opt.nodes] == ["FusedReduce"]
    for values in ([1, 2, 3], [10, 20, 30], [-1, 0.5, 7]):
        got = {name: backend_registry.get(name).run(opt, {"ch": opgraph.tensor(np.float32(values))})
               for name in ("numpy", "native")}
        total = float(np.float32(values).sum())
        spread = [values, values] if kind == "input" else [[total] * 3] * 2
        for name, out in got.items():
            assert np.ravel(out[opt.outputs[0].name]).tolist() == [total], (name, values)
            assert out[opt.outputs[1].name].tolist() == spread, (name, values)
