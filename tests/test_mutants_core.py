"""Behaviours of the cache, direct-call and core layers that a mutation audit found unpinned:
each test fails on a small change of the code it names (a dropped key part, a bound off by one,
a skipped check) and passes on the code as written."""
from __future__ import annotations

import numpy as np
import pytest

import l0ops
import opgraph
from backends.numpy_backend import NumpyBackend
from opgraph.aclnn import direct, twophase
from opgraph.aclnn.batch_norm_reduce import aclnnBatchNormReduceGetWorkspaceSize
from opgraph.aclnn.batch_norm_stats import _batch_norm_stats, aclnnBatchNormStatsGetWorkspaceSize
from opgraph.aclnn.cache import EXECUTOR_CACHE, ExecutorCache
from opgraph.aclnn.structure import Template
from opgraph.aclnn.twophase import op_api
from opgraph.core.opapi import Param
from opgraph.core.dtypes import DataType
from opgraph.core.executor import Executor
from opgraph.core.foreign import array_address, array_span
from opgraph.core.status import AclnnError, Status
from opgraph.core.tensor import Tensor, row_major_strides
from opgraph.ops import batch_norm_gather_stats_with_counts as gather

GATHER = "opgraph.aclnn.batch_norm_gather_stats_with_counts"
native = pytest.importorskip("backends.native")
BACKENDS = ["numpy", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason="no C compiler for the native backend"))]


# --- the executor cache -------------------------------------------------------------------------
def test_a_program_cached_on_one_platform_is_not_reused_on_another():
    """The platform is part of phase 1's key: BatchNormReduce, compiled on the 910B, is still
    refused on the 910, which has no kernel for it (561003), with the very same tensors."""
    x = opgraph.tensor(np.ones((2, 3, 4, 5), np.float32), "NCHW")
    s, sq = opgraph.tensor(np.zeros(3, np.float32)), opgraph.tensor(np.zeros(3, np.float32))
    with opgraph.platform("Ascend910B"):
        assert aclnnBatchNormReduceGetWorkspaceSize(x, s, sq)[0] == Status.ACLNN_SUCCESS
    with opgraph.platform("Ascend910"):
        status, _, ex = aclnnBatchNormReduceGetWorkspaceSize(x, s, sq)
    assert status == Status.ACLNN_ERR_INNER_FIND_KERNEL_ERROR and ex is None


def test_clearing_a_cache_empties_it_and_restarts_its_counts():
    """clear() forgets the entries and the hit/miss counts alike (what clear_all_caches
    promises a re-registration)."""
    c = ExecutorCache(capacity=4)
    c.put(("a",), 1)
    c.get(("a",)), c.get(("b",))
    assert (c.hits, c.misses) == (1, 1)
    c.clear()
    assert (len(c), c.hits, c.misses, c.values()) == (0, 0, 0, [])
    assert c.get(("a",)) is None and (c.hits, c.misses) == (0, 1)


# --- direct calls ---------------------------------------------------------------------------------
def _owner(a: np.ndarray) -> np.ndarray:
    """The array that owns ``a``'s memory (through as_strided's intermediate objects)."""
    while not (isinstance(a, np.ndarray) and a.flags.owndata):
        a = a.base
    return a


@pytest.mark.parametrize("shape, strides", [((3, 2), (1, 3)), ((2, 3), (1, 4)), ((2, 2, 2), (1, 5, 2))])
def test_a_strided_output_lies_inside_the_memory_made_for_it(shape, strides):
    """A direct call's non-contiguous output is a view over a buffer of its own that holds its
    last element: the buffer spans at least up to the element at sum((n - 1) * stride)."""
    out = direct.NUMPY.maker(shape, strides, DataType.FLOAT)()
    assert out.strides == tuple(4 * s for s in strides)
    owner = _owner(out)
    last = sum((n - 1) * s for n, s in zip(shape, strides))
    lo, hi = array_span(out)
    assert lo >= array_address(owner) and hi == lo + 4 * (last + 1)
    assert hi <= array_address(owner) + owner.nbytes


@pytest.fixture
def calls():
    """A fresh direct-call cache, the executor cache's counts as they stand."""
    return direct.DirectCalls(direct.NUMPY)


def _stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 per-channel (dim 1) mean and 1/sqrt(biased var + 1e-5)."""
    x = x.astype(np.float64)
    axes = (0,) + tuple(range(2, x.ndim))
    return x.mean(axes), 1 / np.sqrt(x.var(axes) + 1e-5)


X = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7


def test_a_usual_call_over_another_array_than_the_callers_is_never_run_direct(calls):
    """A call whose usual path binds another array than the caller's (here twice it) is learnt
    as not direct: a later call gives what its usual path gives, not the caller's array's."""
    for k in range(3):
        x = X + k
        mean, _ = calls.call("aclnnBatchNormStats", (x, 1e-5), lambda: _batch_norm_stats(x * 2, 1e-5))
        np.testing.assert_allclose(mean, _stats(x * 2)[0], rtol=1e-6)
    assert calls.runs_direct() == [False]


def test_a_usual_path_of_two_phase_1_calls_is_not_learnt(calls):
    """Direct calls learn from exactly one phase-1 call: a usual path that makes two (the second
    on another array) keeps giving that path's outputs."""
    def slow():
        _batch_norm_stats(x, 1e-5)
        return _batch_norm_stats(x * 3, 1e-5)
    for k in range(3):
        x = X - k
        mean, invstd = calls.call("aclnnBatchNormStats", (x, 1e-5), slow)
        want = _stats(x * 3)
        np.testing.assert_allclose(mean, want[0], rtol=1e-6)
        np.testing.assert_allclose(invstd, want[1], rtol=1e-5)
    assert calls.runs_direct() == [False]


def test_an_output_the_arrays_cannot_make_keeps_the_usual_call(calls, monkeypatch):
    """When the kind of array cannot make an output (its maker gives None), the call is learnt
    as not direct and every later call runs the usual path."""
    monkeypatch.setattr(direct.Arrays, "maker", lambda self, shape, strides, dtype: None)
    for _ in range(3):
        mean, invstd = calls.call("aclnnBatchNormStats", (X, 1e-5), lambda: _batch_norm_stats(X, 1e-5))
        np.testing.assert_allclose(mean, _stats(X)[0], rtol=1e-6)
    assert calls.runs_direct() == [False]


def test_running_stats_side_by_side_with_the_counts_in_one_buffer_run_direct(calls, monkeypatch):
    """Running statistics and counts that touch (thirds of one buffer) share no byte: the second
    call runs direct (no phase 1: the executor cache is not asked) and updates both statistics
    by running = (1 - momentum) * running + momentum * batch statistic."""
    monkeypatch.setattr(f"{GATHER}.NUMPY_CALLS", calls)
    mean, invstd = np.float32([[0, 1], [2, 3]]), np.ones((2, 2), np.float32)
    for k in range(2):
        buf = np.float32([0, 0, 1, 1, 1, 3])  # running mean, running var, counts
        asked = EXECUTOR_CACHE.hits + EXECUTOR_CACHE.misses
        m, _ = gather(np.zeros((4, 2), np.float32), mean, invstd, buf[:2], buf[2:4], 0.5, 1e-5, buf[4:])
        assert (EXECUTOR_CACHE.hits + EXECUTOR_CACHE.misses > asked) == (k == 0)
        # mean = (1 * [0, 1] + 3 * [2, 3]) / 4; the unbiased variance: the sum over ranks of
        # count * (var + (rank mean - mean)^2), var = 1 / invstd^2 - eps, over 4 - 1
        np.testing.assert_allclose(m, [1.5, 2.5])
        var = ((1 - 1e-5) * 4 + 1 * 1.5 ** 2 + 3 * 0.5 ** 2) / 3
        np.testing.assert_allclose(buf, [0.75, 1.25, 0.5 + 0.5 * var, 0.5 + 0.5 * var, 1, 3], rtol=1e-6)
    assert calls.runs_direct() == [True]


class CountingBackend(NumpyBackend):
    """numpy, counting the programs it compiles."""

    name = "numpy-counting"

    def __init__(self):
        super().__init__()
        self.compiled = 0

    def compile(self, graph, memory_plan, platform):
        self.compiled += 1
        return super().compile(graph, memory_plan, platform)


def test_a_call_learnt_on_one_backend_is_learnt_again_on_another(calls):
    """The backend is part of a direct call's key: a call learnt on numpy, made again on another
    backend, runs there (that backend compiles the program), not on numpy's executable."""
    other = CountingBackend()
    slow = lambda: _batch_norm_stats(X, 1e-5)  # noqa: E731
    with opgraph.use_backend("numpy"):
        calls.call("aclnnBatchNormStats", (X, 1e-5), slow)
        calls.call("aclnnBatchNormStats", (X, 1e-5), slow)
    with opgraph.use_backend(other):
        mean, _ = calls.call("aclnnBatchNormStats", (X, 1e-5), slow)
    assert other.compiled >= 1 and len(calls) == 2
    np.testing.assert_allclose(mean, _stats(X)[0], rtol=1e-6)


# --- phase 1's caches -----------------------------------------------------------------------------
@pytest.fixture
def fresh_caches(monkeypatch):
    """Phase 1 with empty executor and structure caches of its own."""
    monkeypatch.setattr(twophase, "EXECUTOR_CACHE", ExecutorCache())
    monkeypatch.setattr(twophase, "STRUCTURE_CACHE", ExecutorCache(capacity=128))
    return twophase.EXECUTOR_CACHE, twophase.STRUCTURE_CACHE


def _stats_phase1(shape):
    x = opgraph.tensor(np.ones(shape, np.float32))
    mean, invstd = (opgraph.tensor(np.zeros(shape[1], np.float32)) for _ in range(2))
    status, _, ex = aclnnBatchNormStatsGetWorkspaceSize(x, 1e-5, mean, invstd)
    assert status == Status.ACLNN_SUCCESS
    return ex


def test_a_new_shape_of_a_known_structure_is_then_an_executor_cache_hit(fresh_caches):
    """The first call of a structure leaves a template (its probe reproduces it: the probe dims
    are primes dividing none of its dims), and a shape made from it is kept in the executor
    cache: the next call with that shape reuses the very program (neither resized nor
    recorded again)."""
    cache, structures = fresh_caches
    _stats_phase1((2, 11, 4))  # 11: the first probe prime, so the probe takes others
    assert [type(t) for t in structures.values()] == [Template]  # the structure's template
    second = _stats_phase1((5, 11, 4))
    assert structures.hits == 1
    third = _stats_phase1((5, 11, 4))
    assert third.program is second.program and cache.hits == 1


def test_a_failing_probe_leaves_no_error_for_the_caller(fresh_caches, monkeypatch):
    """The structure's probe recording is not the caller's call: a probe that fails (here one
    made with a NULL input) leaves aclGetRecentErrMsg empty after phase 1 succeeded."""
    probed = []

    def failing_probe(record, args, ex, dims):
        probed.append(record((None,) + tuple(args[1:])))
        return None
    monkeypatch.setattr(twophase, "build_template", failing_probe)
    _stats_phase1((2, 3, 4))
    assert probed == [None] and twophase.aclGetRecentErrMsg() == ""


def test_a_call_one_argument_short_is_refused_not_raised():
    """Phase 1 never raises for a short call: missing only the last output gives 161002 naming
    the count, as missing more does."""
    x, mean = opgraph.tensor(np.ones((2, 3), np.float32)), opgraph.tensor(np.zeros(3, np.float32))
    status, _, ex = aclnnBatchNormStatsGetWorkspaceSize(x, 1e-5, mean)
    assert status == Status.ACLNN_ERR_PARAM_INVALID and ex is None
    assert "expected 4 arguments" in twophase.aclGetRecentErrMsg()


def _stats_over(buf, x_at, x_shape, mean_at, C=3):
    """BatchNormStats' phase 1 with input, mean and invstd as views of one float32 buffer
    (invstd over memory of its own)."""
    x = Tensor(buf, x_shape, row_major_strides(x_shape), offset=x_at)
    mean = Tensor(buf, (C,), (1,), offset=mean_at)
    invstd = opgraph.tensor(np.zeros(C, np.float32))
    with opgraph.opt_level(2):
        status, _, ex = aclnnBatchNormStatsGetWorkspaceSize(x, 1e-5, mean, invstd)
    assert status == Status.ACLNN_SUCCESS
    return ex


@pytest.mark.parametrize("x_at, x_shape, mean_at", [(0, (2, 3), 6), (3, (2, 3), 0), (1, (0, 3), 0)],
                         ids=["input-then-mean", "mean-then-input", "empty-input-inside-mean"])
def test_an_output_touching_or_around_an_empty_input_keeps_the_optimised_program(x_at, x_shape, mean_at):
    """Only shared bytes make a call compile as recorded: an output right before or after its
    input (touching, no byte in common), or around an empty input, keeps the level's program."""
    ex = _stats_over(np.zeros(16, np.float32), x_at, x_shape, mean_at)
    assert ex.program.opt_level == 2


def test_an_output_one_element_into_its_input_is_compiled_as_recorded():
    """The counterpart: a mean whose first element is the input's last is shared memory."""
    assert _stats_over(np.zeros(16, np.float32), 0, (2, 3), 5).program.opt_level == 0


@op_api("aclnnTestMutantsCopyTwo", params=(
        Param("x", "tensor", "input"), Param("y", "tensor", "input"), Param("k", "int", "input"),
        Param("out1", "tensor", "output"), Param("out2", "tensor", "output")))
def _copy_two(ex, x, y, k, out1, out2):
    """out1 = x, out2 = y (k only checked: an int64 scalar)."""
    ex.output(l0ops.ViewCopy(ex, l0ops.Contiguous(ex, ex.input("x", x)), ex.input("out1", out1)),
              l0ops.ViewCopy(ex, l0ops.Contiguous(ex, ex.input("y", y)), ex.input("out2", out2)))


def _copy_two_call(out2_at=None, k=0, shape2=(0,)):
    buf = np.zeros(8, np.float32)
    out1 = Tensor(buf, (3,), (1,))
    out2 = (opgraph.tensor(np.zeros(shape2, np.float32)) if out2_at is None
            else Tensor(buf, shape2, row_major_strides(shape2), offset=out2_at))
    x, y = opgraph.tensor(np.ones(3, np.float32)), opgraph.tensor(np.ones(shape2, np.float32))
    with opgraph.opt_level(2):
        return _copy_two(x, y, k, out1, out2)


@pytest.mark.parametrize("k, ok", [((1 << 63) - 1, True), (1 << 63, False), (-(1 << 63), True),
                                   (-(1 << 63) - 1, False)])
def test_an_int_scalar_takes_exactly_the_int64_range(k, ok):
    """An ``int`` parameter takes what an int64_t holds, [-2**63, 2**63 - 1], and refuses an
    integer one past either end with 161002."""
    status, _, ex = _copy_two_call(k=k)
    assert (status == Status.ACLNN_SUCCESS) == ok and (ex is not None) == ok
    if not ok:
        assert "k: an integer of 64 bits does not fit in a int64_t" in twophase.aclGetRecentErrMsg()


@pytest.mark.parametrize("shape2", [(0,), (3, 0), (0, 2)])
def test_an_empty_output_inside_another_shares_no_memory(shape2):
    """An empty output shares no byte, even placed inside another output's bytes (whatever its
    strides: a [3, 0] tensor's are (1, 1)): the call keeps the level's program (two outputs that
    do share bytes are compiled as recorded)."""
    status, _, ex = _copy_two_call(out2_at=1, shape2=shape2)
    assert status == Status.ACLNN_SUCCESS and ex.program.opt_level == 2
    status, _, ex = _copy_two_call(out2_at=2, shape2=(2,))
    assert status == Status.ACLNN_SUCCESS and ex.program.opt_level == 0


def test_an_empty_output_may_be_read_only():
    """Nothing is written to an empty output, so one over read-only memory is taken (a
    non-empty one is refused naming it)."""
    storage = np.zeros(4, np.float32)
    storage.flags.writeable = False
    for n, ok in ((0, True), (2, False)):
        status, _, ex = _copy_two(opgraph.tensor(np.ones(3, np.float32)), opgraph.tensor(np.ones(n, np.float32)),
                                  0, opgraph.tensor(np.zeros(3, np.float32)), Tensor(storage, (n,), (1,)))
        assert (status == Status.ACLNN_SUCCESS) == ok
        assert ok or "out2: storage is read-only" in twophase.aclGetRecentErrMsg()


@pytest.mark.parametrize("eps", [True, np.bool_(False)])
def test_a_bool_is_not_a_number(eps):
    """A scalar parameter takes a real number, not a bool (Python's or numpy's): 161002."""
    x, mean, invstd = (opgraph.tensor(np.ones(s, np.float32)) for s in ((2, 3), 3, 3))
    status, _, ex = aclnnBatchNormStatsGetWorkspaceSize(x, eps, mean, invstd)
    assert status == Status.ACLNN_ERR_PARAM_INVALID and ex is None
    assert "eps: expected a number, got" in twophase.aclGetRecentErrMsg()


# --- phase 2's workspace check ----------------------------------------------------------------
@op_api("aclnnTestMutantsRoundTrip", params=(
        Param("x", "tensor", "input"), Param("empty", "tensor", "input"), Param("out", "tensor", "output")))
def _round_trip(ex, x, empty, out):
    """out = x through float16 (intermediates: a workspace at level 0); ``empty`` only bound."""
    ex.input("empty", empty)
    y = l0ops.Cast(ex, l0ops.Cast(ex, ex.input("x", x), to=DataType.FLOAT16), to=DataType.FLOAT)
    ex.output(l0ops.ViewCopy(ex, y, ex.input("out", out)))


W = 2048  # where the workspace starts in the shared buffer


@pytest.mark.parametrize("ws_at, out_at, empty_at, ok", [
    (W, lambda need: W - 12, 0, True),      # out ends where the scratch starts
    (W, lambda need: W + need, 0, True),    # out starts where the scratch ends (the buffer goes on)
    (W + 1, lambda need: W + need, 0, False),  # out's first byte is the scratch's last
    (W, lambda need: 0, W + 16, True),      # an empty tensor inside the scratch
], ids=["before", "after-within-the-buffer", "last-byte", "empty-inside"])
def test_the_workspace_check_refuses_exactly_the_scratch_bytes(ws_at, out_at, empty_at, ok):
    """Phase 2 refuses a workspace whose first ``need`` bytes (the run's scratch) share a byte
    with a tensor of the call, and only then: a tensor touching the scratch, past it in a
    larger buffer, or empty inside it is fine (and the run writes out = x)."""
    big = np.zeros(8192, np.uint8)
    floats = big.view(np.float32)
    x = opgraph.tensor(np.float32([1, 2, 3]))
    with opgraph.opt_level(0):
        need = _round_trip(x, opgraph.tensor(np.zeros(0, np.float32)), opgraph.tensor(np.zeros(3, np.float32)))[1]
        assert need > 0
        out = Tensor(floats, (3,), (1,), offset=out_at(need) // 4)
        status, ws, ex = _round_trip(x, Tensor(floats, (0,), (1,), offset=empty_at // 4), out)
    assert status == Status.ACLNN_SUCCESS and ws == need
    status = twophase.run_executor(big[ws_at:ws_at + need + 512], need, ex)
    assert (status == Status.ACLNN_SUCCESS) == ok
    if ok:
        assert out.numpy().tolist() == [1, 2, 3]
    else:
        assert "workspace: shares memory with out" in twophase.aclGetRecentErrMsg()
        assert (big[W:] == 0).all()  # nothing written


def test_a_workspace_of_plain_bytes_in_fields_named_with_an_o_is_taken():
    """Only Python object references are refused in a workspace: a structured array of plain
    bytes whose field names hold an "O" (the object code in a buffer format) is taken."""
    x, out = opgraph.tensor(np.float32([1, 2, 3])), np.zeros(3, np.float32)
    with opgraph.opt_level(0):
        status, need, ex = _round_trip(x, opgraph.tensor(np.zeros(0, np.float32)), opgraph.tensor(out))
    assert status == Status.ACLNN_SUCCESS and need > 0
    workspace = np.zeros(need, dtype=[("Offset", np.uint8)])
    assert twophase.run_executor(workspace, need, ex) == Status.ACLNN_SUCCESS
    assert out.tolist() == [1, 2, 3]


def test_an_executor_phase_1_never_compiled_is_refused_by_phase_2():
    """Phase 2 takes only an executor phase 1 compiled: one made but never compiled is 161002
    (not an exception)."""
    status = twophase.run_executor(None, 0, Executor("aclnnTestMutantsCopyTwo"))
    assert status == Status.ACLNN_ERR_PARAM_INVALID
    assert "executor: expected an Executor from phase 1" in twophase.aclGetRecentErrMsg()


@op_api("aclnnTestMutantsAccumulate", params=(Param("x", "tensor", "input"), Param("acc", "tensor", "inout")))
def _accumulate(ex, x, acc):
    """acc += x."""
    a = ex.input("acc", acc)
    total = l0ops.Add(ex, l0ops.Contiguous(ex, a), l0ops.Contiguous(ex, ex.input("x", x)))
    ex.output(l0ops.ViewCopy(ex, total, a))


def _accumulate_usual(x, acc):
    status, ws, ex = _accumulate(opgraph.tensor(x), opgraph.tensor(acc))
    if status:
        raise AclnnError(status, twophase.aclGetRecentErrMsg())
    assert twophase.run_executor(bytearray(ws) if ws else None, ws, ex) == Status.ACLNN_SUCCESS
    return []


def test_a_written_argument_in_the_last_place_is_checked_before_a_direct_run(calls):
    """A learnt call's written arguments are checked on every direct call, the caller's last
    argument too: a read-only accumulator takes the usual call, which refuses it naming it."""
    for k in range(3):
        x, acc = np.ones(3, np.float32), np.full(3, 2, np.float32)
        acc.flags.writeable = k < 2
        run = lambda: calls.call("aclnnTestMutantsAccumulate", (x, acc), lambda: _accumulate_usual(x, acc))  # noqa: E731
        if k < 2:
            run()
            assert acc.tolist() == [3, 3, 3] and calls.runs_direct() == [True]
        else:
            with pytest.raises(AclnnError, match="acc: storage is read-only"):
                run()
            assert acc.tolist() == [2, 2, 2]


def test_an_output_opgraph_had_to_copy_is_refused_on_a_cache_hit_too():
    """An output view opgraph can only copy (negative strides) has the metadata of its copy,
    so phase 1's cache key matches an earlier good call: the hit still refuses it (161002
    naming it), the result would be lost in the copy."""
    x = opgraph.tensor(np.ones((2, 3), np.float32))
    good = [opgraph.tensor(np.zeros(3, np.float32)) for _ in range(2)]
    assert aclnnBatchNormStatsGetWorkspaceSize(x, 1e-5, *good)[0] == Status.ACLNN_SUCCESS
    reversed_mean = opgraph.tensor(np.zeros(3, np.float32)[::-1])
    assert reversed_mean.copied and reversed_mean.signature == good[0].signature
    status, _, ex = aclnnBatchNormStatsGetWorkspaceSize(x, 1e-5, reversed_mean, good[1])
    assert status == Status.ACLNN_ERR_PARAM_INVALID and ex is None
    assert "mean: the array could not be wrapped without a copy" in twophase.aclGetRecentErrMsg()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_strided_input_of_known_metadata_but_its_strides_is_not_a_cache_hit(backend):
    """The strides are part of a tensor's cache key: BatchNormStats on a transposed view, after a
    call on a contiguous array of the same shape and dtype, reads the view's own elements."""
    mean, invstd = (opgraph.tensor(np.zeros(3, np.float32)) for _ in range(2))
    data = np.arange(6, dtype=np.float32)
    for x in (data.reshape(2, 3), data.reshape(3, 2).T):  # [[0 1 2] [3 4 5]], [[0 2 4] [1 3 5]]
        with opgraph.use_backend(backend):
            status, ws, ex = aclnnBatchNormStatsGetWorkspaceSize(opgraph.tensor(x), 1e-5, mean, invstd)
            assert status == 0 and twophase.run_executor(bytearray(ws) if ws else None, ws, ex) == 0
        np.testing.assert_allclose(mean.numpy(), x.mean(0, dtype=np.float64))
