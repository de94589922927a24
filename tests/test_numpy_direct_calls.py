"""Direct calls of the Pythonic API (opgraph.ops, through opgraph.aclnn.direct.NUMPY_CALLS): an
op_api called again on numpy arrays with the metadata of a call seen before runs its compiled
program straight from the arrays' memory. Checked against the op_api's usual two-phase call
(direct calls off) bit for bit, with every output pre-filled with NaN (so an output the direct
run skipped shows), for all seven op_apis on numpy and native, at both sizes of the native
reductions, fp32/fp16/bf16 and a 2-d input; that the direct run skips phase 1; and every case
that must take the usual call: an opgraph Tensor argument, a caller's ``out``, an active
capture, read-only or overlapping running statistics, bad input, an ndarray subclass."""
from __future__ import annotations

import numpy as np
import pytest

import opgraph
from opgraph import ops
from opgraph.aclnn import direct
from opgraph.aclnn.cache import EXECUTOR_CACHE
from opgraph.core.dtypes import DataType
from opgraph.core.status import AclnnError
from threads import hammer

EPS = 1e-5
SMALL, LARGE = (4, 3, 5, 3), (4, 3, 40, 40)  # below and above the native min_elements (4096)
F32, F16, BF16 = np.float32, np.float16, DataType.BF16.np


def bits(a):
    return None if a is None else np.ascontiguousarray(a).view(np.uint8)


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or np.array_equal(bits(x), bits(y)) for x, y in zip(a, b))


def inputs(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    C = shape[1]
    x, dy = [(rng.standard_normal(shape) * 2 + 1).astype(dtype) for _ in range(2)]
    return (x, dy, np.linspace(0.5, 2.0, C, dtype=F32), np.linspace(-1.0, 1.0, C, dtype=F32),
            np.zeros(C, F32), np.ones(C, F32))


def family(x, dy, w, b, rm, rv):
    """The seven op_apis' Pythonic functions, chained as SyncBatchNorm chains five of them on one
    rank, plus BatchNormReduce (4-d only) and SyncBatchNormGatherStats: every output."""
    mean, invstd = ops.batch_norm_stats(x, EPS)
    counts = np.full(1, x.size // x.shape[1], F32)
    gm, gs = ops.batch_norm_gather_stats_with_counts(x, mean[None], invstd[None], rm, rv, 0.1, EPS,
                                                     counts)
    y = ops.batch_norm_elemt(x, w, b, gm, gs, EPS)
    sdy, sdx, gw, gb = ops.batch_norm_backward_reduce(dy, x, gm, gs, w, True, True, True)
    dx = ops.batch_norm_elemt_backward(dy, x, gm, gs, w, sdy, sdx, counts.astype(np.int32))
    sums = list(ops.batch_norm_reduce(x)) if x.ndim == 4 else []
    total = np.stack([sdy, sdy * 0.5]).astype(F32)
    bm, bi = ops.sync_batch_norm_gather_stats(total, total * total + 1, np.int32([7, 9]),
                                              rm, rv, 0.1, EPS)
    return [mean, invstd, gm, gs, y, sdy, sdx, gw, gb, dx, *sums, bm, bi, rm, rv]


FUNCTIONS = (ops.batch_norm_stats, ops.batch_norm_gather_stats_with_counts, ops.batch_norm_elemt,
             ops.batch_norm_backward_reduce, ops.batch_norm_elemt_backward, ops.batch_norm_reduce,
             ops.sync_batch_norm_gather_stats)


_MAKER = direct.Arrays.maker


def nan_maker(self, shape, strides, dtype):
    make = _MAKER(self, shape, strides, dtype)

    def filled():
        out = make()
        out[...] = np.nan
        return out
    return None if make is None else filled


@pytest.fixture
def calls(monkeypatch):
    """A fresh direct-call cache for the Pythonic API whose outputs start as NaN."""
    fresh = direct.DirectCalls(direct.NUMPY)
    for f in FUNCTIONS:
        monkeypatch.setattr(f"{f.__module__}.NUMPY_CALLS", fresh)
    monkeypatch.setattr(direct.Arrays, "maker", nan_maker)
    return fresh


def run(calls, enabled, args, backend="native", platform="Ascend910B"):
    calls.enabled = enabled
    with opgraph.use_backend(backend), opgraph.platform(platform):
        return family(*[a.copy() for a in args])


CASES = [(SMALL, F32, "Ascend910B"), (LARGE, F32, "Ascend910B"), (SMALL, F16, "Ascend910B"),
         (LARGE, BF16, "Ascend950"), ((6, 3), F32, "Ascend910B")]
IDS = ["small", "large", "fp16", "bf16-950", "2d"]
native = pytest.importorskip("backends.native")
BACKENDS = ["numpy", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason="no C compiler for the native backend"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, dtype, platform", CASES, ids=IDS)
def test_direct_calls_give_the_bits_of_the_two_phase_calls(calls, shape, dtype, platform, backend):
    args = inputs(shape, dtype)
    want = run(calls, False, args, backend, platform)
    assert len(calls) == 0
    learnt = run(calls, True, args, backend, platform)  # learns every call
    n = 7 if len(shape) == 4 else 6
    assert len(calls) == n and all(calls.runs_direct())
    hits = EXECUTOR_CACHE.hits
    again = run(calls, True, args, backend, platform)  # direct: no phase 1 at all
    assert EXECUTOR_CACHE.hits == hits
    assert same(learnt, want) and same(again, want)


def test_a_direct_call_on_new_arrays_reads_and_writes_them(calls):
    first, second = inputs(LARGE, F32), inputs(LARGE, F32, seed=1)
    run(calls, True, first)
    got = run(calls, True, second)
    assert same(got, run(calls, False, second)) and not same(got, run(calls, False, first))
    y = run(calls, True, first)[4]
    assert y is not run(calls, True, first)[4]  # a new output array every call


def test_an_opgraph_tensor_or_a_callers_out_takes_the_usual_call(calls):
    x = inputs(SMALL, F32)[0]
    with opgraph.use_backend("native"):
        for _ in range(2):
            ops.batch_norm_stats(opgraph.tensor(x), EPS)
        assert len(calls) == 0  # an opgraph Tensor is never keyed
        mean, invstd = ops.batch_norm_stats(x, EPS)
        out = np.full(x.shape, 7, F32)
        ops.batch_norm_elemt(x, None, None, mean, invstd, EPS, out=out)
        hits = EXECUTOR_CACHE.hits
        got = ops.batch_norm_elemt(x, None, None, mean, invstd, EPS, out=out)
        assert got is out and EXECUTOR_CACHE.hits == hits + 1  # phase 1 checked the caller's out
        assert len(calls) == 1  # the statistics only
        assert np.array_equal(out, ops.batch_norm_elemt(x, None, None, mean, invstd, EPS))


class Sub(np.ndarray):
    pass


def test_an_ndarray_subclass_is_never_keyed(calls):
    x = inputs(SMALL, F32)[0].view(Sub)
    with opgraph.use_backend("numpy"):
        for _ in range(2):
            ops.batch_norm_stats(x, EPS)
    assert len(calls) == 0


def test_a_capture_sees_every_call(calls):
    x = inputs(SMALL, F32)[0]
    with opgraph.use_backend("native"):
        ops.batch_norm_stats(x, EPS), ops.batch_norm_stats(x, EPS)  # learnt
        with opgraph.capture() as prog:
            ops.batch_norm_stats(x, EPS)
    assert prog.stats().launches >= 1


@pytest.mark.parametrize("aliasing", ["same", "overlapping", "read-only"])
def test_running_stats_that_cannot_be_written_so_take_the_usual_call(calls, aliasing):
    x = inputs(SMALL, F32)[0]
    C = x.shape[1]
    mean, invstd = np.linspace(0, 1, C, dtype=F32)[None], np.linspace(1, 2, C, dtype=F32)[None]
    counts = np.full(1, 20.0, F32)

    def gather(enabled):
        calls.enabled = enabled
        buf = np.linspace(0.5, 1.5, C + 1, dtype=F32)
        rm, rv = {"same": (buf[:C], buf[:C]), "overlapping": (buf[:C], buf[1:]),
                  "read-only": (buf[:C], buf[1:].copy())}[aliasing]
        if aliasing == "read-only":
            rv.flags.writeable = False
        with opgraph.use_backend("native"):
            try:
                out = ops.batch_norm_gather_stats_with_counts(x, mean, invstd, rm, rv, 0.1, EPS, counts)
            except AclnnError as e:
                out = [str(e)]
        return [*out, buf, rv]

    calls.enabled = True
    with opgraph.use_backend("native"):  # learnt on separate, writable running stats
        for _ in range(2):
            ops.batch_norm_gather_stats_with_counts(x, mean, invstd, np.zeros(C, F32),
                                                    np.ones(C, F32), 0.1, EPS, counts)
    assert calls.runs_direct() == [True]
    hits, misses = EXECUTOR_CACHE.hits, EXECUTOR_CACHE.misses
    got = gather(True)
    assert EXECUTOR_CACHE.hits + EXECUTOR_CACHE.misses > hits + misses  # phase 1 ran
    want = gather(False)
    if aliasing == "read-only":  # refused as the usual call refuses it, nothing written
        assert isinstance(got[0], str) and "runningVar" in got[0] and got[0] == want[0]
        assert np.array_equal(got[1], np.linspace(0.5, 1.5, C + 1, dtype=F32))
    else:
        assert same(got, want)


def test_bad_input_is_refused_every_time(calls):
    with opgraph.use_backend("native"):
        for _ in range(2):
            with pytest.raises(AclnnError, match="input"):
                ops.batch_norm_stats(np.zeros(5, F32), EPS)  # rank 1
    assert len(calls) == 0  # nothing learnt from a refused call


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["small", "large"])
def test_threads_share_a_learnt_call(calls, shape):
    xs = [inputs(shape, F32, seed=s)[0] for s in range(6)]
    w = np.linspace(0.5, 2.0, shape[1], dtype=F32)

    def both(x):
        mean, invstd = ops.batch_norm_stats(x, EPS)
        return [mean, invstd, ops.batch_norm_elemt(x, w, None, mean, invstd, EPS)]

    calls.enabled = False
    with opgraph.use_backend("native"):
        want = [both(x) for x in xs]
    calls.enabled = True
    got, errors = hammer(lambda k: both(xs[k]), want, same, rounds=40,
                         context=lambda: opgraph.use_backend("native"))
    assert not errors and len(got) == len(xs) and len(calls) == 2


def test_empty_inputs_give_what_the_usual_call_gives(calls):
    x = np.zeros((0, 3, 4), F32)
    m, s, w = np.zeros(3, F32), np.ones(3, F32), np.ones(3, F32)

    def both(enabled):
        calls.enabled = enabled
        with opgraph.use_backend("native"):
            return [*ops.batch_norm_stats(x, EPS), ops.batch_norm_elemt(x, w, None, m, s, EPS),
                    *ops.batch_norm_backward_reduce(x, x, m, s, w, True, True, True)]

    want = both(False)
    assert same(both(True), want) and same(both(True), want)  # learnt, then again
    assert np.isnan(want[1]).all() and (want[3] == 0).all()  # the op_apis' fills


def test_an_output_maker_makes_phase_1s_layout():
    out = _MAKER(direct.NUMPY, (2, 3), (1, 4), DataType.FLOAT16)()  # columns 4 elements apart
    assert out.shape == (2, 3) and out.strides == (2, 8) and out.flags.writeable
    row = _MAKER(direct.NUMPY, (2, 1, 3), (3, 7, 1), DataType.FLOAT)()  # a size-1 dim's stride
    assert row.flags.c_contiguous and row.dtype == F32 and row.shape == (2, 1, 3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("platform", ["Ascend910B", "Ascend950"])
def test_the_whole_family_on_empty_inputs_gives_what_the_usual_call_gives(calls, backend, platform):
    args = inputs((0, 3, 4, 4), F32)
    want = run(calls, False, args, backend, platform)
    learnt = run(calls, True, args, backend, platform)
    again = run(calls, True, args, backend, platform)
    assert same(learnt, want) and same(again, want)
    assert len(calls) == 7  # learnt (most not direct: an empty array is not bound at its own address)


@pytest.mark.skipif(not native.available(), reason="no C compiler for the native backend")
@pytest.mark.parametrize("shape", [LARGE, (8, 64, 4, 4)], ids=["passes", "blocked"])
def test_reductions_run_from_the_addresses_on_every_new_array(calls, shape):
    """A direct BatchNormStats / BatchNormReduceBackward whose passes read nothing but the big
    inputs runs its C calls from the arrays' addresses alone (reduce_run.run_by_address, no
    views): each call on new data gives the numpy backend's bits for that data."""
    got, want = [], []
    for seed in range(3):
        x, dy, w, *_ = inputs(shape, F32, seed)
        for backend, into in (("native", got), ("numpy", want)):
            calls.enabled = backend == "native"
            with opgraph.use_backend(backend):
                mean, invstd = ops.batch_norm_stats(x, EPS)
                into.append([mean, invstd, *ops.batch_norm_backward_reduce(
                    dy, x, mean, invstd, w, True, True, True)])
    assert all(calls.runs_direct()) and len(calls) == 2
    assert all(same(g, w_) for g, w_ in zip(got, want))
    assert not same(got[0], got[1])
