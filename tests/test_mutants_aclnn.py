"""Argument checks of the op_apis, the Pythonic API and the executor meta API that a mutation
audit found unpinned: each test fails on a small change of the check it names (a dropped
argument, a bound off by one, two checks in the other order, another status) and passes on the
code as written. Expected statuses and orders come from the vendor facts
(../shared/reference/syncbn-family.md, "[F]" below; aclnn-api.md, "[API]") or the README."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import aclnn
from opgraph.core.status import Status

F32, F16, I32 = np.float32, np.float16, np.int32
NULLPTR, INVALID = Status.ACLNN_ERR_PARAM_NULLPTR, Status.ACLNN_ERR_PARAM_INVALID
SUCCESS = Status.ACLNN_SUCCESS
t = opgraph.tensor


def refused(status, name: str, rule: str = "") -> None:
    """The last phase-1 call failed with ``status``, its message naming ``name`` (and ``rule``)."""
    msg = aclnn.aclGetRecentErrMsg()
    assert f"({int(status)}): {name}:" in msg, msg
    assert rule in msg, msg


# --- the executor meta API ([API] §3.3) -----------------------------------------------------------
def _elemt_backward_executor():
    """Phase 1 of the README's ElemtBackward call on a (2, 3) input: inputs gradOut, input,
    mean, invstd, weight, sumDy, sumDyXmu, counter (indices 0..7); output gradInput (index 0)."""
    x = np.arange(6, dtype=F32).reshape(2, 3)
    c = np.ones(3, F32)
    out = np.zeros_like(x)
    st, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
        t(x), t(x), t(0 * c), t(c), t(c), t(0 * c), t(c), t(c), t(out))
    assert st == SUCCESS
    return ws, ex, out


def test_a_negative_tensor_index_is_out_of_range():
    """aclSetInputTensorAddr: an index below 0 is out of range, 161002 ([API] §3.3), not
    Python's count from the end (which would rebind counter, the last input)."""
    _, ex, _ = _elemt_backward_executor()
    assert aclnn.aclSetAclOpExecutorRepeatable(ex) == SUCCESS
    assert aclnn.aclSetInputTensorAddr(ex, -1, t(np.ones(3, F32))) == INVALID
    assert "out of range" in aclnn.aclGetRecentErrMsg()


def test_a_bool_tensor_index_is_refused():
    """The index is an integer: True is a wrong Python type, 161002 (README, "wrong Python
    types ... give 161002"), not input 1."""
    _, ex, _ = _elemt_backward_executor()
    assert aclnn.aclSetInputTensorAddr(ex, True, t(np.ones((2, 3), F32))) == INVALID
    assert "index must be an integer" in aclnn.aclGetRecentErrMsg()


def test_a_rebound_tensor_keeps_its_strides_and_format():
    """Rebinding changes a tensor's address only ([API] §3.3: the new device address), so a
    tensor of the same shape and dtype but other strides, or another format, is 161002."""
    _, ex, _ = _elemt_backward_executor()
    strided = opgraph.Tensor(np.zeros(6, F32), (2, 3), (1, 2))
    assert aclnn.aclSetInputTensorAddr(ex, 0, strided) == INVALID
    assert aclnn.aclSetInputTensorAddr(ex, 0, t(np.zeros((2, 3), F32), format="NC")) == INVALID
    assert aclnn.aclSetInputTensorAddr(ex, 0, t(np.zeros((2, 3), F32))) == SUCCESS


def test_a_read_only_input_may_be_rebound_and_is_read():
    """Only outputs must be writable (README: "a read-only output likewise" is refused; inputs
    are const aclTensor*): a read-only gradOut is rebound and the run reads it."""
    ws, ex, out = _elemt_backward_executor()
    assert aclnn.aclSetAclOpExecutorRepeatable(ex) == SUCCESS
    dy = np.full((2, 3), 2.0, F32)
    dy.flags.writeable = False
    assert aclnn.aclSetInputTensorAddr(ex, 0, t(dy)) == SUCCESS
    assert aclnn.aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex) == SUCCESS
    x = np.arange(6, dtype=np.float64).reshape(2, 3)
    # gradInput = (dy - sumDy/Σcnt) - (x - mean)·invstd²·(sumDyXmu/Σcnt), invstd = weight = 1
    assert np.allclose(out, 2.0 - x / 3.0)
    assert aclnn.aclDestroyAclOpExecutor(ex) == SUCCESS


def test_a_destroyed_executor_cannot_be_made_repeatable():
    """aclSetAclOpExecutorRepeatable belongs right after phase 1 ([API] §3.3); after
    aclDestroyAclOpExecutor it is 161002."""
    _, ex, _ = _elemt_backward_executor()
    assert aclnn.aclDestroyAclOpExecutor(ex) == SUCCESS
    assert aclnn.aclSetAclOpExecutorRepeatable(ex) == INVALID
    assert not ex.repeatable


# --- common.check_channel_vector ---------------------------------------------------------------
def _gather_args(C=3, W=2, **override):
    """Valid GatherStatsWithCounts arguments in prototype order, float32, W ranks of C channels."""
    a = dict(input=t(np.ones((2, C, 2), F32)), mean=t(np.zeros((W, C), F32)),
             invstd=t(np.ones((W, C), F32)), runningMean=t(np.zeros(C, F32)),
             runningVar=t(np.ones(C, F32)), momentum=0.1, eps=1e-5, counts=t(np.ones(W, F32)),
             meanAll=t(np.zeros(C, F32)), invstdAll=t(np.zeros(C, F32)))
    a.update(override)
    return a


@pytest.mark.parametrize("name", ["runningMean", "runningVar", "meanAll", "invstdAll"])
def test_a_channel_vector_must_be_1d_not_just_start_with_c(name):
    """GatherStatsWithCounts: runningMean/Var (if given), meanAll, invstdAll must be [C]
    ([F] §3.3 step 6.5, 6.7); a [C, 1] tensor is 161002 naming it."""
    a = _gather_args(**{name: t(np.zeros((3, 1), F32))})
    st, _, ex = aclnn.aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize(*a.values())
    assert (st, ex) == (INVALID, None)
    refused(st, name, "must be [C]")


# --- aclnnBatchNormStats ----------------------------------------------------------------------
@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_batch_norm_stats_invstd_is_float32_only(soc):
    """BatchNormStats: mean and invstd are FP32 only ([API] §6.4), on every SoC: an FP16
    invstd is 161002 naming invstd, and nothing is written into mean."""
    mean, invstd = np.full(3, 7, F32), np.full(3, 7, F16)
    with opgraph.platform(soc):
        st, _, ex = aclnn.aclnnBatchNormStatsGetWorkspaceSize(
            t(np.ones((2, 3), F32)), 1e-5, t(mean), t(invstd))
    assert (st, ex) == (INVALID, None)
    refused(st, "invstd", "FLOAT16")
    assert (mean == 7).all() and (invstd == 7).all()


# --- aclnnBatchNormReduce ---------------------------------------------------------------------
def test_batch_norm_reduce_an_empty_square_sum_takes_the_empty_path():
    """BatchNormReduce: the empty test comes before every other check and looks at x, sum and
    squareSum ([F] §5.3 step 2): an empty squareSum beside a non-empty x succeeds, filling sum
    with 0."""
    x = t(np.ones((2, 3, 2, 2), F32), format="NCHW")
    s = np.full(3, 7, F32)
    st, ws, ex = aclnn.aclnnBatchNormReduceGetWorkspaceSize(x, t(s), t(np.zeros(0, F32)))
    assert st == SUCCESS, aclnn.aclGetRecentErrMsg()
    assert aclnn.aclnnBatchNormReduce(bytearray(ws) if ws else None, ws, ex) == SUCCESS
    assert (s == 0).all()


def test_batch_norm_reduce_x_rank_is_checked_before_the_output_ranks():
    """BatchNormReduce's shape checks run x rank ≠ 4, then sum and squareSum not 1-D
    ([F] §5.3 step 5): a 3-D x beside a 2-D sum is 161002 naming x."""
    x = t(np.ones((2, 3, 4), F32), format="NCHW")
    st, _, ex = aclnn.aclnnBatchNormReduceGetWorkspaceSize(
        x, t(np.zeros((3, 1), F32)), t(np.zeros(3, F32)))
    assert (st, ex) == (INVALID, None)
    refused(st, "x", "must be 4")


# --- aclnnBatchNormElemt ----------------------------------------------------------------------
def _elemt(x, out, C=3):
    """BatchNormElemt's phase 1 on ``x`` and ``out`` with ones as every [C] parameter."""
    c = np.ones(C, F32)
    return aclnn.aclnnBatchNormElemtGetWorkspaceSize(x, t(c), t(c), t(c), t(c), 1e-5, out)


def test_batch_norm_elemt_input_rank_comes_before_output_rank():
    """BatchNormElemt's shape checks run input rank > 8, input rank < 2, then output's
    ([F] §2.4 step 4): a 1-D input beside a 9-D output is 161002 naming input."""
    st, _, ex = _elemt(t(np.ones(3, F32)), t(np.zeros((1, 3) + (1,) * 7, F32)))
    assert (st, ex) == (INVALID, None)
    refused(st, "input", "less than 2")


def test_batch_norm_elemt_format_equality_comes_before_private():
    """BatchNormElemt's format check: input and output storage formats differ, or input's is
    private, in the order [F] §2.4 step 3 lists them: a private input beside an ND output is
    161002 naming output."""
    x = opgraph.Tensor(np.ones(24, F32), (2, 3, 2, 2), (12, 4, 2, 1), format="NC1HWC0")
    st, _, ex = _elemt(x, t(np.zeros((2, 3, 2, 2), F32)))
    assert (st, ex) == (INVALID, None)
    refused(st, "output", "differs from input's")


def test_batch_norm_elemt_pythonic_out_takes_the_inputs_format():
    """ops.batch_norm_elemt: a numpy ``out`` carries no format; the function tags it like the
    input (the op_api wants equal storage formats, [F] §2.4 step 3), so an NCHW-tagged input
    with a numpy out succeeds and writes out."""
    x = np.arange(24, dtype=F32).reshape(2, 3, 2, 2)
    out = np.zeros_like(x)
    c = np.float32([0.5, 1.0, 2.0])
    y = opgraph.ops.batch_norm_elemt(t(x, format="NCHW"), None, None, 0 * c, c, 0.0, out=out)
    assert y is out
    assert np.allclose(out, x * c.reshape(1, 3, 1, 1))



@pytest.mark.parametrize("data, params", [(F32, F16), (F16, "bfloat16")])
def test_batch_norm_elemt_950_weight_type_other_than_the_input_s_is_float(data, params):
    """950 BatchNormProcRegbase: wbType = PromoteType(weight, bias), FLOAT if it differs from
    input's dtype ([F] §2.7): f16 weight and bias under an f32 input, or bf16 ones under an f16
    input, reach BatchNormV3 as float32."""
    x = np.ones((2, 3, 2, 2), data)
    wb = np.ones(3, F32).astype(ml_dtypes.bfloat16 if params == "bfloat16" else params)
    c = np.ones(3, F32)
    with opgraph.platform("Ascend950"), opgraph.opt_level(0):
        st, _, ex = aclnn.aclnnBatchNormElemtGetWorkspaceSize(
            t(x), t(wb), t(wb), t(c), t(c), 1e-5, t(np.zeros_like(x)))
    assert st == SUCCESS, aclnn.aclGetRecentErrMsg()
    bn = next(n for n in ex.graph.nodes if n.op == "BatchNormV3")
    assert [v.dtype.np for v in bn.inputs[1:3]] == [np.dtype(F32)] * 2


def test_batch_norm_elemt_a_channel_parameter_shorter_than_c_is_refused():
    """BatchNormElemt: weight, bias, mean and invstd of a size other than C are 161002 ([F]
    §2.4 step 4.8), a smaller size as much as a larger one."""
    c, short = t(np.ones(3, F32)), t(np.ones(2, F32))
    st, _, ex = aclnn.aclnnBatchNormElemtGetWorkspaceSize(
        t(np.ones((2, 3), F32)), c, c, short, c, 1e-5, t(np.zeros((2, 3), F32)))
    assert (st, ex) == (INVALID, None)
    refused(st, "mean", "must be [C] = [3]")


# --- aclnnBatchNormReduceBackward ---------------------------------------------------------------
def test_batch_norm_reduce_backward_private_inputs_come_before_private_outputs():
    """ReduceBackward's format checks: any of the 4 inputs private, then any enabled output
    private ([F] §4.4 step 6): a private mean beside a private sumDy is 161002 naming mean."""
    x, c = t(np.ones((2, 3), F32)), t(np.ones(3, F32))
    nc1 = t(np.ones(3, F32), format="NC1HWC0")
    outs = [t(np.zeros(3, F32), format="NC1HWC0")] + [t(np.zeros(3, F32)) for _ in range(3)]
    st, _, ex = aclnn.aclnnBatchNormReduceBackwardGetWorkspaceSize(
        x, x, nc1, c, None, True, True, True, *outs)
    assert (st, ex) == (INVALID, None)
    refused(st, "mean", "private")


def test_batch_norm_elemt_rank_above_5_is_retagged_nd_on_the_way_back():
    """BatchNormElemt, rank > 5: the result is reshaped to the input's shape and re-tagged ND
    ([F] §2.5 step 11), whatever the input's own tag."""
    x = np.ones((2, 3, 1, 2, 1, 2), F32)
    with opgraph.opt_level(0):
        st, _, ex = _elemt(t(x, format="NCHW"), t(np.zeros_like(x), format="NCHW"))
    assert st == SUCCESS, aclnn.aclGetRecentErrMsg()
    *_, reshape, reformat, copy = ex.graph.nodes
    assert [reshape.op, reformat.op, copy.op] == ["Reshape", "ReFormat", "ViewCopy"]
    assert reformat.attrs.format.name == "ND" and reformat.outputs[0].shape == x.shape

# --- aclnnBatchNormElemtBackward --------------------------------------------------------------
def test_batch_norm_elemt_backward_input_rank_2_comes_before_rank_8():
    """ElemtBackward's shape checks start with input rank < 2, then rank > 8 of input, gradOut,
    gradInput and counter ([API] §5.4 step 5): a 1-D input beside a 9-D counter is 161002
    naming input."""
    x, c = t(np.ones(3, F32)), t(np.ones(3, F32))
    st, _, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
        x, x, c, c, c, c, c, t(np.ones((1,) * 9, F32)), t(np.zeros(3, F32)))
    assert (st, ex) == (INVALID, None)
    refused(st, "input", "less than 2")


# --- aclnnBatchNormGatherStatsWithCounts -------------------------------------------------------
def test_gather_stats_with_counts_runs_on_ascend910():
    """GatherStatsWithCounts is supported on the Atlas training series, Ascend910 ([F] §3.2
    Products: 950, A3, A2, 910): two ranks with means 0 and 2, invstd 1, counts 1 and 3 give
    meanAll = (0·1 + 2·3)/4 = 1.5 and var = (1·1 + 1·3 + 1·1.5² + 3·0.5²)/4 = 1.75 (eps 0)."""
    a = _gather_args(C=2, runningMean=None, runningVar=None, eps=0.0,
                     mean=t(np.float32([[0, 0], [2, 2]])), counts=t(np.float32([1, 3])))
    mean_all, invstd_all = np.zeros(2, F32), np.zeros(2, F32)
    a.update(meanAll=t(mean_all), invstdAll=t(invstd_all))
    with opgraph.platform("Ascend910"):
        st, ws, ex = aclnn.aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize(*a.values())
        assert st == SUCCESS, aclnn.aclGetRecentErrMsg()
        assert aclnn.aclnnBatchNormGatherStatsWithCounts(bytearray(ws) if ws else None, ws, ex) == SUCCESS
    assert np.allclose(mean_all, 1.5) and np.allclose(invstd_all, 1 / np.sqrt(1.75))


@pytest.mark.parametrize("data, stats", [(F32, F16), (F16, F32)])
def test_gather_stats_with_counts_950_a_null_running_mean_is_zeros_in_input_dtype(data, stats):
    """950: a NULL running stat is filled with 0 in input's dtype ([F] §3.4), and the fused
    kernel's tiling refuses a running stat whose dtype is not mean's: a NULL runningMean (with
    runningVar given in mean's dtype) and input's dtype other than mean's is 561002 naming
    input (opgraph's answer to the vendor's undetermined run, module docstring)."""
    C, W = 3, 2
    a = _gather_args(C=C, W=W, runningMean=None, runningVar=t(np.ones(C, stats)),
                     input=t(np.ones((2, C, 2), data)), mean=t(np.zeros((W, C), stats)),
                     invstd=t(np.ones((W, C), stats)), meanAll=t(np.zeros(C, stats)),
                     invstdAll=t(np.zeros(C, stats)))
    with opgraph.platform("Ascend950"):
        st, _, ex = aclnn.aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize(*a.values())
    assert (st, ex) == (Status.ACLNN_ERR_INNER_TILING_ERROR, None)
    refused(st, "input", "runningMean is NULL, so it is zeros in input's dtype")



def test_gather_stats_with_counts_an_empty_mean_of_zero_channels_only_fills():
    """GatherStatsWithCounts tests mean->IsEmpty() alone, and an empty mean records only the
    fills of meanAll (0) and invstdAll (NaN): Fill, ReFormat, ViewCopy each ([F] §3.3 step 7),
    for W ranks of C = 0 channels as for W = 0."""
    e = lambda *s: t(np.zeros(s, F32))  # noqa: E731
    a = _gather_args(C=0, runningMean=None, runningVar=None, input=e(2, 0, 5), mean=e(2, 0),
                     invstd=e(2, 0), meanAll=e(0), invstdAll=e(0))
    with opgraph.opt_level(0):
        st, _, ex = aclnn.aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize(*a.values())
    assert st == SUCCESS, aclnn.aclGetRecentErrMsg()
    assert [n.op for n in ex.graph.nodes] == ["Fill", "ReFormat", "ViewCopy"] * 2

# --- aclnnSyncBatchNormGatherStats --------------------------------------------------------------
def test_sync_gather_stats_no_ranks_comes_before_no_channels():
    """SyncBatchNormGatherStats' empty checks: totalSum.shape[0] == 0 is 161002, then
    totalSum.shape[1] == 0 is a success that launches nothing ([F] §6.4 step 5): with N = C = 0
    the call is 161002 naming totalSum."""
    e = lambda *s: t(np.zeros(s, F32))  # noqa: E731
    st, _, ex = aclnn.aclnnSyncBatchNormGatherStatsGetWorkspaceSize(
        e(0, 0), e(0, 0), t(np.zeros(0, I32)), e(0), e(0), 0.1, 1e-5, e(0), e(0))
    assert (st, ex) == (INVALID, None)
    refused(st, "totalSum", "dim 0")


# --- the Pythonic API ---------------------------------------------------------------------------
def test_pythonic_a_ragged_list_is_161002_naming_the_argument():
    """A ragged list cannot be a tensor (numpy raises ValueError for it): the Pythonic API
    raises AclnnError 161002 naming the argument (README: wrong Python types give 161002; the
    Pythonic API raises AclnnError), not a bare ValueError."""
    with pytest.raises(opgraph.AclnnError) as e:
        opgraph.ops.batch_norm_stats([[1.0, 2.0], [3.0]], 1e-5)
    assert e.value.status == INVALID and "input: cannot be used as a tensor" in str(e.value)


_C = np.ones(3, F32)
NULL_CALLS = {  # Pythonic call, the op_api's phase 1 on the same arguments (outputs NULL)
    "batch_norm_backward_elemt": (
        lambda: opgraph.ops.batch_norm_backward_elemt(None, None, *[_C] * 6),
        lambda: aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(None, None, *[t(_C)] * 6, None)),
    "sync_batch_norm_gather_stats": (
        lambda: opgraph.ops.sync_batch_norm_gather_stats(None, None, None, None, None, 0.1, 1e-5),
        lambda: aclnn.aclnnSyncBatchNormGatherStatsGetWorkspaceSize(
            None, None, None, None, None, 0.1, 1e-5, None, None)),
    "batch_norm_elemt": (
        lambda: opgraph.ops.batch_norm_elemt(None, None, None, _C, _C, 1e-5),
        lambda: aclnn.aclnnBatchNormElemtGetWorkspaceSize(None, None, None, t(_C), t(_C), 1e-5, None)),
}


@pytest.mark.parametrize("name", list(NULL_CALLS))
def test_pythonic_null_inputs_fail_with_the_op_api_s_status_and_message(name):
    """README: "The Pythonic API raises AclnnError with the same status and message" as the
    op_api: with several required tensors NULL it names the one the op_api names first (its
    NULL order: gradOut before input, totalSum before mean, [API] §5.4, [F] §6.4), in the
    op_api's own words (BatchNormElemt's note on its 161002 for NULL, [F] §2.4 step 1)."""
    pythonic, phase1 = NULL_CALLS[name]
    st, _, ex = phase1()
    assert ex is None and st in (NULLPTR, INVALID)
    want = aclnn.aclGetRecentErrMsg()
    with pytest.raises(opgraph.AclnnError) as e:
        pythonic()
    assert e.value.status == st and str(e.value) == want


def test_pythonic_an_opgraph_tensor_out_gives_back_a_numpy_array():
    """The Pythonic API is numpy out (opgraph.ops): with an opgraph.Tensor as ``out`` the
    function writes the tensor's memory and returns its values as a numpy array (the README
    example's values, 0.9·x)."""
    x = np.arange(8, dtype=F32).reshape(1, 2, 4)
    c = lambda *v: np.float32(v)  # noqa: E731
    out = np.zeros_like(x)
    y = opgraph.ops.batch_norm_backward_elemt(x, x, c(0, 0), c(1, 1), c(1, 1), c(0, 0), c(1, 1),
                                              c(5, 5), out=t(out))
    assert isinstance(y, np.ndarray) and np.allclose(y, 0.9 * x) and np.allclose(out, 0.9 * x)
