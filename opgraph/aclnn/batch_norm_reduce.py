"""aclnnBatchNormReduce, composed like the C++ op_api (ops-nn
norm/bn_training_reduce/op_api/aclnn_batch_norm_reduce.cpp): per-channel ``sum = Σx`` and
``squareSum = Σx²`` of a 4-D x tagged NCHW or NHWC (C = dim 1, or dim 3 for NHWC), into
float32 [C] outputs.

The vendor's order: NULL (161001); then the **empty test, before any other check**: if x, sum
or squareSum is empty, both outputs are filled with 0 in their own dtype (Fill + re-tag ND +
ViewCopy) and the call succeeds; then dtype, format and shape (161002). There is no
OP_CHECK_COMM_INPUT. The graph is the same on 910B/910_93 and 950: Contiguous(x), ResizeTo4D of
sum (an UnsqueezeNd whose shape alone is used), BNTrainingReduce, SqueezeNd + re-tag ND on each
result, two ViewCopys — one kernel.

Quirks kept: a strided (non-contiguous) ``sum`` fails with 561103, because ResizeTo4D's
UnsqueezeNd needs a contiguous tensor (a strided ``squareSum`` is fine). Where the vendor would
crash (Ascend910, 310P, 310B have no BNTrainingReduce kernel: the l0 returns NULL unchecked and
ResizeTo1D dereferences it), opgraph returns 561003 after the checks; an empty call succeeds
there too (its path has only Fill kernels).

    >>> import numpy as np, opgraph
    >>> x = np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)
    >>> s, q = np.zeros(2, np.float32), np.zeros(2, np.float32)
    >>> st, ws, ex = aclnnBatchNormReduceGetWorkspaceSize(
    ...     opgraph.tensor(x, format="NCHW"), opgraph.tensor(s), opgraph.tensor(q))
    >>> aclnnBatchNormReduce(bytearray(ws) if ws else None, ws, ex)
    <Status.ACLNN_SUCCESS: 0>
    >>> s.tolist(), q.tolist()
    ([6.0, 22.0], [14.0, 126.0])
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from l0ops.basic import Contiguous, Fill, UnsqueezeNd, ViewCopy
from l0ops.bn_training_reduce import BNTrainingReduce, channel_dim, small_r
from l0ops.views import ReFormat, SqueezeNd
from opgraph.core.dtypes import DataType, Format
from opgraph.core.executor import Executor
from opgraph.core.ir import Value
from opgraph.core.opapi import Arrays, InputConfig, Param
from opgraph.core.opdef import L0Error
from opgraph.core.platform import Platform
from opgraph.core.status import AclnnError, Status
from opgraph.core.tensor import Tensor, tensor
from .common import BF16, F16, F32, check_dtype, invalid, require_kernel
from .direct import NUMPY_CALLS
from .pythonic import as_tensor, refuse_null, result, run_op_api
from .twophase import check_not_null, op_api, run_executor

PLATFORMS = ("Ascend910B", "Ascend910_93", "Ascend950")  # the doc: 950, A3, A2 (not 910/310)
X_DTYPES = (F32, F16, BF16)  # no SoC gate
X_FORMATS = (Format.NCHW, Format.NHWC)
PARAMS = (Param("x", "tensor", "input"), Param("sum", "tensor", "output"),
          Param("squareSum", "tensor", "output"))


def x_dtypes(p: Platform) -> tuple[DataType, ...]:
    """x's dtypes: FLOAT, FLOAT16 and BFLOAT16 on every SoC (the op_api has no BF16 gate)."""
    return X_DTYPES


def check_params(p: Platform, x: Tensor, sum: Tensor, squareSum: Tensor) -> None:
    """CheckDtypeValid, CheckFormat, CheckShape — in that order (161002)."""
    check_dtype("x", x, X_DTYPES, p)
    check_dtype("sum", sum, (F32,), p)
    check_dtype("squareSum", squareSum, (F32,), p)
    if x.format not in X_FORMATS:
        raise invalid(f"x: storage format {x.format.name} is not supported (supported: NCHW, NHWC)")
    for name, t in (("sum", sum), ("squareSum", squareSum)):
        if t.format != Format.ND:
            raise invalid(f"{name}: storage format {t.format.name} is not supported (supported: ND)")
    if x.ndim != 4:
        raise invalid(f"x: rank {x.ndim} must be 4 (shape {list(x.shape)})")
    for name, t in (("sum", sum), ("squareSum", squareSum)):
        if t.ndim != 1:
            raise invalid(f"{name}: rank {t.ndim} must be 1 (shape {list(t.shape)})")
    c = channel_dim(x.format)
    C = x.shape[c]
    for name, t in (("sum", sum), ("squareSum", squareSum)):
        if t.shape[0] != C:
            raise invalid(f"{name}: shape {list(t.shape)} must be [C] = [{C}] "
                          f"(C = x.shape[{c}], x is {x.format.name})")


def fill_zeros(ex: Executor, dst: Value) -> Value:
    """ProcessEmptyTensorWithValue(dst, 0): Fill(dst's shape, 0 in dst's dtype), re-tag ND,
    ViewCopy into dst."""
    zeros = Fill(ex, shape=dst.type.shape, value=0.0, dtype=dst.dtype)
    return ViewCopy(ex, ReFormat(ex, zeros, format=Format.ND), dst)


def resize_to_4d(ex: Executor, sum: Value, fmt: Format) -> Value:
    """ResizeTo4D: sum [C] → [1,C,1,1] (NCHW) or [1,1,1,C] (NHWC), re-tagged ``fmt``. UnsqueezeNd
    returns NULL for a non-contiguous tensor, which the op_api reports as 561103."""
    try:
        v = UnsqueezeNd(ex, sum, dims=(0, 1, 2) if fmt == Format.NHWC else (0, 2, 3))
    except L0Error as e:
        raise AclnnError(Status.ACLNN_ERR_INNER_NULLPTR,
                         f"sum: ResizeTo4D's UnsqueezeNd returned NULL ({e}); the vendor op_api "
                         "needs a contiguous sum") from None
    return ReFormat(ex, v, format=fmt)


def resize_to_1d(ex: Executor, v: Value) -> Value:
    """ResizeTo1D: SqueezeNd the non-channel dims ([0,1,2] for NHWC, else [0,2,3]), re-tag ND."""
    dims = (0, 1, 2) if v.type.format == Format.NHWC else (0, 2, 3)
    return ReFormat(ex, SqueezeNd(ex, v, dims=dims), format=Format.ND)


# --- what the CLI, the backend kit and the docs need beyond the compose function -------------
def make_inputs(cfg: InputConfig, rng: np.random.Generator) -> Arrays:
    """Random valid arguments: x ~ N(0.5, 1) of cfg.shape (channel = dim 1), zeroed outputs."""
    C = cfg.shape[1] if len(cfg.shape) > 1 else 1
    return {"x": rng.normal(0.5, 1.0, cfg.shape).astype(cfg.dtype.np),
            "sum": np.zeros(C, np.float32), "squareSum": np.zeros(C, np.float32)}


def input_bytes(cfg: InputConfig) -> int:
    """Bytes of the arrays :func:`make_inputs` makes, computed without making them."""
    C = cfg.shape[1] if len(cfg.shape) > 1 else 1
    return math.prod(cfg.shape) * cfg.dtype.itemsize + 2 * 4 * C


def _data_and_channel(x: Any) -> tuple[np.ndarray, int]:
    """x's values in float64 and its channel dim (an NHWC-tagged Tensor: 3; else 1)."""
    if isinstance(x, Tensor):
        return x.numpy().astype(np.float64), channel_dim(x.format)
    return np.asarray(x).astype(np.float64), 1


def reference(a: Arrays) -> dict[str, np.ndarray]:
    """Σx and Σx² in float64 over every dim but the channel dim (dim 1; dim 3 for NHWC)."""
    x, c = _data_and_channel(a["x"])
    axes = tuple(d for d in range(x.ndim) if d != c)
    return {"sum": x.sum(axis=axes), "squareSum": (x * x).sum(axis=axes)}


@op_api("aclnnBatchNormReduce", params=PARAMS, platforms=PLATFORMS, dtypes=x_dtypes,
        make_inputs=make_inputs, input_bytes=input_bytes, reference=reference, rank=(4, 4),
        formats=lambda cfg: {"x": "NCHW"},
        default_shape=(2, 3, 4, 5),
        summary="per-channel Σx and Σx² of a 4-D NCHW/NHWC x into float32 [C]")
def aclnnBatchNormReduceGetWorkspaceSize(ex: Executor, x: Optional[Tensor], sum: Optional[Tensor],
                                         squareSum: Optional[Tensor]) -> None:
    """Phase 1. Returns ``(status, workspace_size, executor)``; ``None`` is a NULL pointer."""
    p = ex.platform
    check_not_null(x=x, sum=sum, squareSum=squareSum)
    xv, sv, qv = ex.input("x", x), ex.input("sum", sum), ex.input("squareSum", squareSum)
    if x.is_empty or sum.is_empty or squareSum.is_empty:
        ex.output(fill_zeros(ex, sv), fill_zeros(ex, qv))
        return
    check_params(p, x, sum, squareSum)
    require_kernel(PLATFORMS, p, "BNTrainingReduce")
    xc = Contiguous(ex, xv)
    sum4 = resize_to_4d(ex, sv, xc.type.format)
    s4, q4 = BNTrainingReduce(ex, xc, shape=sum4.type.shape, sequential=p.is_regbase and small_r(xc.type))
    s1, q1 = resize_to_1d(ex, s4), resize_to_1d(ex, q4)
    ex.output(ViewCopy(ex, s1, sv), ViewCopy(ex, q1, qv))


aclnnBatchNormReduce = run_executor
"""Phase 2: ``aclnnBatchNormReduce(workspace, workspace_size, executor, stream=None)``."""


def _channels(t: Tensor) -> int:
    """The C the outputs get: x's channel dim for a 4-D x, else dim 1 (the op_api then rejects
    a non-empty x, or fills zeros for an empty one)."""
    if t.ndim == 4:
        return t.shape[channel_dim(t.format)]
    return t.shape[1] if t.ndim > 1 else 1


def batch_norm_reduce(input: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel ``(Σx, Σx²)`` as float32 [C] arrays. A numpy ``input`` must be 4-D and is
    taken as NCHW; pass an ``opgraph.tensor(a, format="NHWC")`` for channels-last data.
    Raises AclnnError (naming the op_api's parameter ``x``) on bad input.

    >>> x = np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)
    >>> [a.tolist() for a in batch_norm_reduce(x)]
    [[6.0, 22.0], [14.0, 126.0]]
    """
    args = (input,)
    return tuple(NUMPY_CALLS.call("aclnnBatchNormReduce", args, lambda: _batch_norm_reduce(*args)))


def _batch_norm_reduce(input: Any) -> tuple[np.ndarray, np.ndarray]:
    """The usual two-phase call of :func:`batch_norm_reduce`."""
    t = as_tensor("input", input)
    if t is None:  # no C for the outputs: the op_api's own refusal, naming x
        refuse_null(aclnnBatchNormReduceGetWorkspaceSize, aclnnBatchNormReduce, None, None, None)
    if not isinstance(input, Tensor):  # numpy data: tag it NCHW
        t = Tensor(t.storage, t.shape, t.strides, t.offset, Format.NCHW, t.storage_shape,
                   copied=t.copied)
    C = _channels(t)
    s, q = np.zeros(C, np.float32), np.zeros(C, np.float32)
    st, qt = tensor(s), tensor(q)
    run_op_api(aclnnBatchNormReduceGetWorkspaceSize, aclnnBatchNormReduce, t, st, qt)
    return result(s, st), result(q, qt)
