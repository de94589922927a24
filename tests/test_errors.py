"""Argument checks of aclnnBatchNormElemtBackwardGetWorkspaceSize (reference §5.3, §5.4) and the
platform gate: status code, a message naming the argument, and an untouched output buffer."""
from __future__ import annotations

import re
import threading

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import aclnn
from opgraph.core.dtypes import PRIVATE_FORMATS, Format

from reference import BF16, F16, F32, I32, NAMES, assert_bits_equal, make_case

ARGS = NAMES + ("gradInput",)
NULLPTR, INVALID = 161001, 161002
SUPPORTED = ("Ascend910B", "Ascend910_93", "Ascend950", "Ascend910")
SENTINEL = 0x5A


def sentinel(shape, dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.full(n, SENTINEL, np.uint8).view(dtype).reshape(shape)


def valid_args(shape=(2, 3, 4), dtype=F32, out_dtype=None) -> dict:
    c = make_case(shape, dtype, out_dtype=out_dtype, seed=1)
    args = {n: getattr(c, n) for n in NAMES}
    args["gradInput"] = sentinel(shape, c.out_dtype)
    return args


def as_tensor(v):
    return v if v is None or isinstance(v, opgraph.Tensor) else opgraph.tensor(v)


def phase1(args: dict, soc: str = "Ascend910B"):
    ts = [as_tensor(args[n]) for n in ARGS]
    with opgraph.platform(soc):
        st, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*ts)
    return st, ws, ex, aclnn.aclGetRecentErrMsg()


def out_bytes(args: dict) -> bytes:
    g = args["gradInput"]
    if g is None:
        return b""
    if isinstance(g, opgraph.Tensor):
        return g.storage.tobytes()
    return g.tobytes()


_NAME_RE = re.compile(r"(?<![A-Za-z])(" + "|".join(sorted(ARGS, key=len, reverse=True)) + r")(?![A-Za-z])")


def first_named(msg: str) -> "str | None":
    """The first argument name that occurs as a word in ``msg``."""
    m = _NAME_RE.search(msg)
    return m.group(1) if m else None


def expect_error(args: dict, status: int, name: str, *keywords: str, soc: str = "Ascend910B"):
    before = out_bytes(args)
    st, ws, ex, msg = phase1(args, soc)
    assert int(st) == status, f"expected {status}, got {int(st)}: {msg}"
    assert ex is None and ws == 0
    assert first_named(msg) == name, f"message should name {name}: {msg!r}"
    for k in keywords:
        assert k in msg, f"message should mention {k!r}: {msg!r}"
    assert out_bytes(args) == before, "gradInput was written by a failing call"
    return msg


def expect_ok(args: dict, soc: str = "Ascend910B"):
    st, ws, ex, msg = phase1(args, soc)
    assert int(st) == 0, msg
    assert ex is not None
    return ws, ex


# --------------------------------------------------------------------------------------------
# 1. NULL pointers
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in ARGS if n != "weight"])
def test_null_required_tensor_is_161001(name):
    args = valid_args()
    args[name] = None
    expect_error(args, NULLPTR, name, "NULL")


def test_null_weight_is_accepted():
    args = valid_args()
    args["weight"] = None
    ws, ex = expect_ok(args)
    assert "weight" not in [v.name for v in ex.graph.inputs]


def test_null_is_reported_before_bad_dtype():
    args = valid_args()
    args["input"] = args["input"].astype(np.int32)
    args["mean"] = None
    expect_error(args, NULLPTR, "mean")


def test_null_output_is_reported_before_bad_rank_and_empty_input():
    args = valid_args(shape=(0, 3, 4))
    args["gradOut"] = np.zeros((1,) * 9, F32)
    args["gradInput"] = None
    expect_error(args, NULLPTR, "gradInput")


def test_null_order_follows_argument_order():
    args = valid_args()
    args["sumDyXmu"] = None
    args["invstd"] = None
    expect_error(args, NULLPTR, "invstd")


# --------------------------------------------------------------------------------------------
# 2. dtypes
# --------------------------------------------------------------------------------------------
DATA = ("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "gradInput")


@pytest.mark.parametrize("name", DATA)
def test_int32_data_tensor_is_rejected(name):
    args = valid_args()
    args[name] = args[name].astype(np.int32) if name != "gradInput" else sentinel((2, 3, 4), np.int32)
    expect_error(args, INVALID, name, "INT32")


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.int8, np.bool_])
def test_other_data_dtypes_are_rejected(dtype):
    args = valid_args()
    args["input"] = args["input"].astype(dtype)
    expect_error(args, INVALID, "input", opgraph.dtype_of(np.dtype(dtype)).name)


@pytest.mark.parametrize("name", DATA)
def test_bf16_rejected_on_ascend910(name):
    args = valid_args()
    args[name] = args[name].astype(BF16) if name != "gradInput" else sentinel((2, 3, 4), BF16)
    expect_error(args, INVALID, name, "BF16", "Ascend910", soc="Ascend910")


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend910_93", "Ascend950"])
@pytest.mark.parametrize("name", DATA)
def test_bf16_accepted_on_bf16_platforms(soc, name):
    args = valid_args()
    args[name] = args[name].astype(BF16) if name != "gradInput" else sentinel((2, 3, 4), BF16)
    expect_ok(args, soc)


def test_all_bf16_accepted_and_fp16_fp32_accepted_on_ascend910():
    expect_ok(valid_args(dtype=BF16), "Ascend910B")
    expect_ok(valid_args(dtype=F16), "Ascend910")
    expect_ok(valid_args(dtype=F32), "Ascend910")


@pytest.mark.parametrize("soc", SUPPORTED)
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.int64), np.dtype(np.float64), np.dtype(np.int8)])
def test_counter_bad_dtype_is_rejected(soc, dtype):
    args = valid_args()
    args["counter"] = args["counter"].astype(dtype)
    expect_error(args, INVALID, "counter", opgraph.dtype_of(dtype).name, soc=soc)


@pytest.mark.parametrize("soc", SUPPORTED)
@pytest.mark.parametrize("dtype", [I32, F16, F32])
def test_counter_good_dtypes_are_accepted(soc, dtype):
    args = valid_args()
    args["counter"] = args["counter"].astype(dtype)
    expect_ok(args, soc)


def test_mixed_dtypes_are_legal():
    args = valid_args()
    args["gradOut"] = args["gradOut"].astype(F16)
    args["mean"] = args["mean"].astype(BF16)
    args["gradInput"] = sentinel((2, 3, 4), F16)
    expect_ok(args)


# --------------------------------------------------------------------------------------------
# 3. formats
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gradOut", "input", "gradInput"])
def test_private_format_nc1hwc0_is_rejected(name):
    args = valid_args()
    args[name] = opgraph.tensor(args[name], format="NC1HWC0")
    expect_error(args, INVALID, name, "NC1HWC0")


@pytest.mark.parametrize("fmt", sorted(f.name for f in PRIVATE_FORMATS))
def test_every_private_format_is_rejected_on_input(fmt):
    args = valid_args()
    args["input"] = opgraph.tensor(args["input"], format=fmt)
    expect_error(args, INVALID, "input", fmt)


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW", "ND", "HWCN", "NC"])
def test_plain_formats_are_accepted_channel_is_dim1(fmt):
    args = valid_args(shape=(2, 3, 2, 2))
    for n in ("gradOut", "input", "gradInput"):
        args[n] = opgraph.tensor(args[n], format=fmt)
    ws, ex = expect_ok(args)
    assert aclnn.aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex) == 0
    c = make_case((2, 3, 2, 2), F32, seed=1)  # same values as valid_args
    assert_bits_equal(args["gradInput"].numpy(), c.expected())


# --------------------------------------------------------------------------------------------
# 4. shapes
# --------------------------------------------------------------------------------------------
def test_input_rank_1_is_rejected():
    args = valid_args()
    for n in ("gradOut", "input", "gradInput"):
        args[n] = np.zeros(3, F32) if n != "gradInput" else sentinel((3,), F32)
    expect_error(args, INVALID, "input", "rank")


NINE = (1, 3, 1, 1, 1, 1, 1, 1, 2)


def test_input_rank_9_is_rejected():
    args = valid_args()
    for n in ("gradOut", "input"):
        args[n] = np.zeros(NINE, F32)
    args["gradInput"] = sentinel(NINE, F32)
    expect_error(args, INVALID, "input", "rank")


@pytest.mark.parametrize("name", ["gradOut", "gradInput", "counter"])
def test_rank_9_is_rejected(name):
    args = valid_args()
    args[name] = np.ones(NINE, I32 if name == "counter" else F32) if name != "gradInput" \
        else sentinel(NINE, F32)
    expect_error(args, INVALID, name, "rank")


def test_rank_8_is_accepted():
    shape = (1, 3, 1, 2, 1, 1, 1, 2)
    args = valid_args(shape=shape)
    args["counter"] = np.ones((1, 1, 1, 1, 1, 1, 2, 3), I32)
    expect_ok(args)


@pytest.mark.parametrize("shape", [(2, 0, 4), (2, 0, 1, 4), (1, 0)])
def test_zero_channels_is_rejected(shape):
    args = valid_args()
    for n in ("gradOut", "input"):
        args[n] = np.zeros(shape, F32)
    args["gradInput"] = sentinel(shape, F32)
    for n in ("mean", "invstd", "weight", "sumDy", "sumDyXmu"):
        args[n] = np.zeros(0, F32)
    expect_error(args, INVALID, "input", "channel")


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 12), (2, 3, 4, 1), (3, 3, 4)])
def test_grad_out_shape_mismatch(shape):
    args = valid_args()
    args["gradOut"] = np.zeros(shape, F32)
    expect_error(args, INVALID, "gradOut", "shape")


@pytest.mark.parametrize("shape", [(2, 3, 5), (24,), (2, 3, 4, 1)])
def test_grad_input_shape_mismatch(shape):
    args = valid_args()
    args["gradInput"] = sentinel(shape, F32)
    expect_error(args, INVALID, "gradInput", "shape")


@pytest.mark.parametrize("name", ["mean", "invstd", "weight", "sumDy", "sumDyXmu"])
@pytest.mark.parametrize("shape", [(4,), (2,), (1, 3), (3, 1), ()])
def test_channel_param_shape_mismatch(name, shape):
    args = valid_args()
    args[name] = np.ones(shape, F32)
    expect_error(args, INVALID, name, "[3]")


@pytest.mark.parametrize("shape", [(7,), (1,), (2, 5), (1, 1, 1, 1, 1, 1, 1, 4)])
def test_counter_shape_is_not_checked_against_c(shape):
    args = valid_args()
    args["counter"] = np.ones(shape, I32)
    expect_ok(args)


# --------------------------------------------------------------------------------------------
# 5. check order among 161002 errors (dtype, format, rank, C, gradOut, gradInput, [C])
# --------------------------------------------------------------------------------------------
def test_dtype_before_format():
    args = valid_args()
    args["gradOut"] = opgraph.tensor(args["gradOut"], format="NC1HWC0")
    args["sumDy"] = args["sumDy"].astype(np.int32)
    expect_error(args, INVALID, "sumDy", "INT32")


def test_format_before_rank():
    args = valid_args()
    args["input"] = np.zeros(3, F32)
    args["gradInput"] = opgraph.tensor(sentinel((2, 3, 4), F32), format="FRACTAL_NZ")
    expect_error(args, INVALID, "gradInput", "FRACTAL_NZ")


def test_counter_rank_before_channel_shapes():
    args = valid_args()
    args["counter"] = np.ones(NINE, I32)
    args["mean"] = np.ones(5, F32)
    expect_error(args, INVALID, "counter", "rank")


def test_zero_channels_before_grad_out_mismatch():
    args = valid_args()
    args["input"] = np.zeros((2, 0, 4), F32)
    expect_error(args, INVALID, "input")


def test_grad_out_before_grad_input_before_params():
    args = valid_args()
    args["gradOut"] = np.zeros((2, 3, 5), F32)
    args["gradInput"] = sentinel((2, 3, 6), F32)
    args["weight"] = np.ones(9, F32)
    expect_error(args, INVALID, "gradOut")
    args["gradOut"] = np.zeros((2, 3, 4), F32)
    expect_error(args, INVALID, "gradInput")
    args["gradInput"] = sentinel((2, 3, 4), F32)
    expect_error(args, INVALID, "weight")


def test_checks_run_before_the_empty_exit():
    args = valid_args(shape=(0, 3, 4))
    args["input"] = args["input"].astype(np.int32)
    expect_error(args, INVALID, "input")
    args = valid_args(shape=(0, 3, 4))
    args["mean"] = np.ones(2, F32)
    expect_error(args, INVALID, "mean")


def test_read_only_output_is_rejected_in_phase1():
    args = valid_args()
    ro = sentinel((2, 3, 4), F32)
    ro.flags.writeable = False
    args["gradInput"] = ro
    expect_error(args, INVALID, "gradInput", "read-only")
    with pytest.raises(opgraph.AclnnError) as e:
        opgraph.ops.batch_norm_elemt_backward(*[args[n] for n in NAMES], out=ro)
    assert int(e.value.status) == INVALID


def test_non_tensor_argument_is_rejected_not_raised():
    args = valid_args()
    ts = [as_tensor(args[n]) for n in ARGS]
    ts[2] = [0.0, 0.0, 0.0]  # a list, not a Tensor
    st, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*ts)
    assert int(st) == INVALID and ex is None
    assert first_named(aclnn.aclGetRecentErrMsg()) == "mean"


# --------------------------------------------------------------------------------------------
# 6. platform gate
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("soc", ["Ascend310P", "Ascend310B"])
def test_unsupported_platforms_fail_naming_the_platform(soc):
    args = valid_args()
    before = out_bytes(args)
    st, ws, ex, msg = phase1(args, soc)
    assert int(st) != 0 and ex is None and ws == 0
    assert soc in msg
    assert out_bytes(args) == before
    with opgraph.platform(soc), pytest.raises(opgraph.AclnnError) as e:
        opgraph.ops.batch_norm_elemt_backward(*[args[n] for n in NAMES], out=args["gradInput"])
    assert soc in str(e.value) and int(e.value.status) == int(st)
    assert out_bytes(args) == before


@pytest.mark.parametrize("soc", SUPPORTED)
def test_supported_platforms_succeed(soc):
    expect_ok(valid_args(dtype=F16), soc)


def test_error_message_is_per_thread():
    args = valid_args()
    args["mean"] = None
    phase1(args)
    main_msg = aclnn.aclGetRecentErrMsg()
    seen = {}

    def other():
        seen["before"] = aclnn.aclGetRecentErrMsg()
        bad = valid_args()
        bad["counter"] = None
        phase1(bad)
        seen["after"] = aclnn.aclGetRecentErrMsg()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["before"] == ""
    assert first_named(seen["after"]) == "counter"
    assert aclnn.aclGetRecentErrMsg() == main_msg and first_named(main_msg) == "mean"


def test_success_clears_the_error_message():
    args = valid_args()
    args["mean"] = None
    phase1(args)
    assert aclnn.aclGetRecentErrMsg() != ""
    expect_ok(valid_args())
    assert aclnn.aclGetRecentErrMsg() == ""


# --------------------------------------------------------------------------------------------
# 7. the Pythonic API raises AclnnError with .status
# --------------------------------------------------------------------------------------------
PY_CASES = [
    ("null-mean", lambda a: a.update(mean=None), NULLPTR, "mean"),
    ("null-counter", lambda a: a.update(counter=None), NULLPTR, "counter"),
    ("int32-input", lambda a: a.update(input=a["input"].astype(np.int32)), INVALID, "input"),
    ("bf16-counter", lambda a: a.update(counter=a["counter"].astype(ml_dtypes.bfloat16)), INVALID, "counter"),
    ("nc1hwc0-gradOut", lambda a: a.update(gradOut=opgraph.tensor(a["gradOut"], format="NC1HWC0")),
     INVALID, "gradOut"),
    ("rank9-counter", lambda a: a.update(counter=np.ones(NINE, np.int32)), INVALID, "counter"),
    ("gradOut-shape", lambda a: a.update(gradOut=np.zeros((2, 3, 5), np.float32)), INVALID, "gradOut"),
    ("invstd-shape", lambda a: a.update(invstd=np.ones(4, np.float32)), INVALID, "invstd"),
    ("null-plus-dtype", lambda a: a.update(sumDy=None, input=a["input"].astype(np.int8)), NULLPTR, "sumDy"),
]


@pytest.mark.parametrize("mutate,status,name", [c[1:] for c in PY_CASES], ids=[c[0] for c in PY_CASES])
def test_pythonic_api_raises_aclnn_error(mutate, status, name):
    args = valid_args()
    mutate(args)
    before = out_bytes(args)
    with pytest.raises(opgraph.AclnnError) as e:
        opgraph.ops.batch_norm_elemt_backward(*[args[n] for n in NAMES], out=args["gradInput"])
    assert int(e.value.status) == status
    assert isinstance(e.value.status, opgraph.Status)
    assert first_named(e.value.message) == name, e.value.message
    assert str(status) in str(e.value)
    assert out_bytes(args) == before


def test_aclnn_error_is_a_runtime_error_as_torchs_kernel_errors_are():
    """Code written for torch's batch-norm kernels catches RuntimeError: opgraph's kernels
    (opgraph.torch) raise AclnnError, which must be one."""
    args = valid_args()
    with pytest.raises(RuntimeError, match="161001.*mean"):
        opgraph.ops.batch_norm_elemt_backward(*[None if n == "mean" else args[n] for n in NAMES])


def test_pythonic_api_null_input_without_out():
    args = valid_args()
    with pytest.raises(opgraph.AclnnError) as e:
        opgraph.ops.batch_norm_elemt_backward(*[None if n == "input" else args[n] for n in NAMES])
    assert int(e.value.status) == NULLPTR and "input" in e.value.message


def test_status_enum_numbers():
    S = opgraph.Status
    assert (S.ACLNN_SUCCESS, S.ACLNN_ERR_PARAM_NULLPTR, S.ACLNN_ERR_PARAM_INVALID) == (0, 161001, 161002)
    assert (S.ACLNN_ERR_RUNTIME_ERROR, S.ACLNN_ERR_INNER, S.ACLNN_ERR_INNER_NULLPTR) == (361001, 561000, 561103)
    assert S.ACLNN_ERR_INNER_FIND_KERNEL_ERROR == 561003 and S.ACLNN_ERR_INNER_KEY_CONFLICT == 561105
    assert S.ACLNN_ERR_INNER_STATIC_BLOCK_DIM_INVALID == 561119
    e = opgraph.AclnnError(161002, "x: bad")
    assert e.status is S.ACLNN_ERR_PARAM_INVALID and e.message == "x: bad"
    assert str(e) == "ACLNN_ERR_PARAM_INVALID (161002): x: bad"
    assert Format.NC1HWC0.is_private
