"""Inference batch norm kernels behind aclnnBatchNormElemt: BNInfer (910B, prebuilt — the
documented formula in a stated order) and BatchNormV3 with training = false (950, following the
arch35 kernel source), plus ConvertToTensor, the host-side constant tensor an op_api builds with
``executor->ConvertToTensor(scalar, dtype)`` (no kernel). BNInfer and BatchNormV3 are defined by
their expansion, so level 2 fuses them; the per-channel part (rstd) is hoisted, computed once.

    >>> from typing import Callable

import numpy as np
    >>> x = np.float32([[[[1.0]], [[3.0]]]])                       # [1, 2, 1, 1]
    >>> c = lambda *v: np.float32(v).reshape(1, 2, 1, 1)
    >>> BNInfer.compute([x, c(1, 1), c(0, 0), c(1, 1), c(3, 3)], BNInfer.make_attrs(eps=1.0))[0].ravel()
    array([0., 1.], dtype=float32)
    >>> v = lambda *v: np.float32(v)                                # BatchNormV3 takes [C] params
    >>> y = BatchNormV3.compute([x, v(1, 1), v(0, 0), v(1, 1), v(3, 3)], BatchNormV3.make_attrs(eps=1.0))
    >>> y[0].ravel()
    array([0., 1.], dtype=float32)
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from opgraph.core.dtypes import DataType, Format
from opgraph.core.opdef import DType, Fidelity, OpAttrs, require
from opgraph.core.types import TensorType
from .define import define_op
from .primitives import as_f32, fill_value_ok

F32, F16, BF16 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16
FLOATS = (F32, F16, BF16)
POS_INF = float("inf")  # the kernel's POS_INF literal, 3.40282366920938E+38, rounds to +inf as a float


class EpsAttrs(OpAttrs):
    """BNInfer's attributes: ``eps``, added to var before the square root (rounded to float32)."""

    eps: float


def _check_bninfer(ts) -> None:
    x = ts[0]
    require(x.rank in (4, 5), "BNInfer", f"x must be 4-D or 5-D, got rank {x.rank}")
    want = (1, x.shape[1]) + (1,) * (x.rank - 2)
    for name, t in zip(("weight", "bias", "mean", "var"), ts[1:5]):
        require(t.shape == want and t.dtype == F32, "BNInfer", f"{name} must be f32{list(want)}, got {t}")


def _bninfer_infer(ts, a):
    _check_bninfer(ts)
    return [ts[0].with_()]


def _upcast(emit, args, ts) -> list[str]:
    return [r if t.dtype == F32 else emit("cast", [r], F32) for r, t in zip(args, ts)]


def _bninfer(emit, args, a: EpsAttrs, ts) -> str:
    """rstd = 1/sqrt(var + eps); y = ((x − mean)·rstd)·w + b, every step rounded to float32."""
    x, w, b, mean, var = _upcast(emit, args, ts)
    v = emit("add", [var, emit("fill", [], F32, value=as_f32(a.eps))], F32)
    rstd = emit("div", [emit("fill", [], F32, value=1.0), emit("sqrt", [v], F32)], F32)
    y = emit("add", [emit("mul", [emit("mul", [emit("sub", [x, mean], F32), rstd], F32), w], F32), b], F32)
    return y if ts[0].dtype == F32 else emit("cast", [y], ts[0].dtype)


BNInfer = define_op(
    "BNInfer", attrs=EpsAttrs, num_inputs=5, kind="elementwise", infer=_bninfer_infer,
    expand=_bninfer,
    fidelity=(Fidelity("formula", "no public 910B kernel source (prebuilt): y = ((x − mean)·rstd)·w "
                       "+ b, rstd = 1/sqrt(var + eps), each step rounded to float32, x's dtype "
                       "rounded once at the end", (2201, 1001)),),
    doc="Inference batch norm with per-channel [1,C,1,1] (5-D: [1,C,1,1,1]) float32 weight, "
        "bias, mean, var; y has x's shape, dtype and format.")


class V3Attrs(OpAttrs):
    """BatchNormV3's attributes: ``eps`` (added to var, as float32); ``momentum``, kept for the
    call but unused in inference; ``training``, must be False; ``channel_axis``, the channel
    dim (:func:`v3_channel_axis` of x: 1, or the last for NHWC / NDHWC)."""

    eps: float
    momentum: float = 0.0
    training: bool = False
    channel_axis: int = 1  # v3_channel_axis(x): the numpy semantics see arrays, not formats


def rstd_newton_raphson(emit: Callable[..., str], var: str, eps: float) -> str:
    """ComputeRstdNewtonRaphsonReg (ops-nn norm_common reduce_common_regbase.h), in float32:
    v = max(var + eps, −99.99); r = 1/v; y = sqrt(r); t = (v·−0.5)·y; rstd = y·(t·y + 1.5);
    s = (v·−1)·r + 1; r = (rstd·−1)·rstd + r; s = (v·r + s)·rstd; rstd = s·0.5 + rstd
    (each Mula ``a·b + c`` modelled as the ``fma`` primitive: a multiply-add in float64 rounded
    to float32, which a single-rounding fused multiply-add differs from by one ulp on rare
    inputs; no public source says how the 950 rounds a Mula); then v == +inf → 0 and
    v == 0 → +inf."""
    c = lambda value: emit("fill", [], F32, value=value)  # noqa: E731
    v = emit("max", [emit("add", [var, c(as_f32(eps))], F32), c(as_f32(-99.99))], F32)
    r = emit("div", [c(1.0), v], F32)
    y = emit("sqrt", [r], F32)
    t = emit("mul", [emit("mul", [v, c(-0.5)], F32), y], F32)
    t1 = emit("fma", [t, y, c(1.5)], F32)
    rstd = emit("mul", [y, t1], F32)
    s = emit("fma", [emit("mul", [v, c(-1.0)], F32), r, c(1.0)], F32)
    r = emit("fma", [emit("mul", [rstd, c(-1.0)], F32), rstd, r], F32)
    s = emit("mul", [emit("fma", [v, r, s], F32), rstd], F32)
    rstd = emit("fma", [s, c(0.5), rstd], F32)
    rstd = emit("where", [emit("eq", [v, c(POS_INF)], DataType.BOOL), c(0.0), rstd], F32)
    return emit("where", [emit("eq", [v, c(0.0)], DataType.BOOL), c(POS_INF), rstd], F32)


def v3_channel_axis(x: TensorType) -> int:
    """The dim BatchNormV3's inference tilings take as the channel: the last for a 4-D NHWC or
    5-D NDHWC storage format (the infer template takes only ND, NCHW and NCDHW; the
    last-channel one reads C from dim 3 / dim 4: batch_norm_v3_tiling_infer_arch35.cpp:185-227,
    batch_norm_v3_tiling_infer_last_channel_arch35.cpp:199-211), else dim 1."""
    last = (x.rank == 4 and x.format == Format.NHWC) or (x.rank == 5 and x.format == Format.NDHWC)
    return x.rank - 1 if last else 1


def _check_v3(ts, a: V3Attrs) -> None:
    """x 4-D or 5-D; ``channel_axis`` is :func:`v3_channel_axis` of x; weight, bias, running
    mean and var 1-D [C] (no ResizeFrom1D on 950), weight/bias of one dtype (x's or float32),
    mean/var likewise (the op_api's casts)."""
    x = ts[0]
    require(x.rank in (4, 5), "BatchNormV3", f"x must be 4-D or 5-D, got rank {x.rank}")
    require(a.channel_axis == v3_channel_axis(x), "BatchNormV3",
            f"channel_axis {a.channel_axis} must be {v3_channel_axis(x)} for x {x}")
    C = x.shape[a.channel_axis]
    for name, t in zip(("weight", "bias", "mean", "var"), ts[1:5]):
        require(t.shape == (C,) and t.dtype in FLOATS, "BatchNormV3",
                f"{name} must be a float [{C}] tensor, got {t}")
    for pair, (a, b) in (("weight/bias", ts[1:3]), ("mean/var", ts[3:5])):
        require(a.dtype == b.dtype and a.dtype in (x.dtype, F32), "BatchNormV3",
                f"{pair} dtypes {a.dtype.short}/{b.dtype.short} must be equal and x's or f32")


def _v3_y(emit, args, a: V3Attrs, ts) -> str:
    """y = ((x − mean)·gamma)·rstd + beta in float32 (batch_norm_v3_infer.h), then RINT to x's dtype."""
    x, w, b, mean, var = _upcast(emit, args, ts)
    bshape = tuple(n if d == a.channel_axis else 1 for d, n in enumerate(ts[0].shape))
    w, b, mean, var = (emit("view", [r], F32, shape=bshape) for r in (w, b, mean, var))
    rstd = rstd_newton_raphson(emit, var, a.eps)
    y = emit("add", [emit("mul", [emit("mul", [emit("sub", [x, mean], F32), w], F32), rstd], F32), b], F32)
    return y if ts[0].dtype == F32 else emit("cast", [y], ts[0].dtype)


def _v3_infer(ts, a: V3Attrs):
    _check_v3(ts, a)
    require(not a.training, "BatchNormV3", "only inference (training = false) is modelled")
    return [ts[0].with_(), ts[3].with_(dtype=F32), ts[4].with_(dtype=F32)]


def _v3(emit, args, a: V3Attrs, ts) -> tuple[str, str, str]:
    """y, and the batch mean/var outputs: in inference the kernel does not write them (the
    op_api never reads them); they are given the running statistics as float32."""
    m, v = (r if t.dtype == F32 else emit("cast", [r], F32) for r, t in zip(args[3:5], ts[3:5]))
    return _v3_y(emit, args, a, ts), m, v


BatchNormV3 = define_op(
    "BatchNormV3", attrs=V3Attrs, num_inputs=5, kind="elementwise", infer=_v3_infer,
    expand=_v3,
    fidelity=(Fidelity("bit-faithful", "950 kernel source (ops-nn batch_norm_v3 arch35 "
                       "batch_norm_v3_infer.h; the Newton-Raphson rstd of reduce_common_regbase.h, "
                       "Mula modelled as a fused multiply-add)", (3510,)),),
    doc="BatchNormV3 with training = false, [C] parameters (C: dim 1, the last dim for NHWC / "
        "NDHWC): (y, batchMean, batchVar); y = ((x − mean)·w)·rstd + b.")


class ConstAttrs(OpAttrs):
    """ConvertToTensor's attributes: ``value``, rounded to float32 then (RNE) to ``dtype``, the
    0-d tensor's dtype."""

    value: float  # the float32 scalar
    dtype: DType


def _const(xs, a: ConstAttrs) -> list:
    with np.errstate(over="ignore"):
        return [np.asarray(np.float32(a.value)).astype(a.dtype.np)]


def _const_infer(ts, a: ConstAttrs) -> list:
    require(fill_value_ok(as_f32(a.value), a.dtype), "ConvertToTensor",
            f"value {a.value!r} does not convert to {a.dtype.short}")
    return [TensorType((), a.dtype)]


ConvertToTensor = define_op(
    "ConvertToTensor", attrs=ConstAttrs, num_inputs=0, kind="source",
    infer=_const_infer, compute=_const,  # fused: the float32 scalar, rounded once to dtype
    expand=lambda emit, args, a, ts: emit("fill", [], a.dtype, value=as_f32(a.value)),
    free=lambda node: True,
    fidelity=(Fidelity("no arithmetic", "a float32 scalar rounded (RNE) to dtype on the host"),),
    doc="A 0-d host tensor holding a scalar in ``dtype`` (aclOpExecutor::ConvertToTensor); it "
        "travels with the consuming kernel's arguments, so no kernel runs for it.")
