"""Inference batch norm kernels behind aclnnBatchNormElemt: BNInfer (910B, prebuilt — the
documented formula in a stated order) and BatchNormV3 with training = false (950, following the
arch35 kernel source). Both are defined by their expansion, so level 2 fuses them; the
per-channel part (rstd) is hoisted and computed once.

    >>> import numpy as np
    >>> x = np.float32([[[[1.0]], [[3.0]]]])                       # [1, 2, 1, 1]
    >>> c = lambda *v: np.float32(v).reshape(1, 2, 1, 1)
    >>> BNInfer.compute([x, c(1, 1), c(0, 0), c(1, 1), c(3, 3)], BNInfer.make_attrs(eps=1.0))[0].ravel()
    array([0., 1.], dtype=float32)
"""
from __future__ import annotations

import numpy as np

from opgraph.core.dtypes import DataType
from opgraph.core.opdef import Fidelity, OpAttrs, require
from .define import define_op

F32 = DataType.FLOAT
FLT_MAX = float(np.finfo(np.float32).max)


class EpsAttrs(OpAttrs):
    eps: float


def _check(op: str, ts) -> None:
    x = ts[0]
    require(x.rank in (4, 5), op, f"x must be 4-D or 5-D, got rank {x.rank}")
    want = (1, x.shape[1]) + (1,) * (x.rank - 2)
    for name, t in zip(("weight", "bias", "mean", "var"), ts[1:5]):
        require(t.shape == want and t.dtype == F32, op,
                f"{name} must be f32{list(want)}, got {t}")


def _infer_y(op: str):
    def infer(ts, a):
        _check(op, ts)
        return [ts[0].with_()]
    return infer


def _upcast(emit, args, ts) -> list[str]:
    return [r if t.dtype == F32 else emit("cast", [r], F32) for r, t in zip(args, ts)]


def _bninfer(emit, args, a: EpsAttrs, ts) -> str:
    """rstd = 1/sqrt(var + eps); y = ((x − mean)·rstd)·w + b, every step rounded to float32."""
    x, w, b, mean, var = _upcast(emit, args, ts)
    v = emit("add", [var, emit("fill", [], F32, value=float(np.float32(a.eps)))], F32)
    rstd = emit("div", [emit("fill", [], F32, value=1.0), emit("sqrt", [v], F32)], F32)
    y = emit("add", [emit("mul", [emit("mul", [emit("sub", [x, mean], F32), rstd], F32), w], F32), b], F32)
    return y if ts[0].dtype == F32 else emit("cast", [y], ts[0].dtype)


BNInfer = define_op(
    "BNInfer", attrs=EpsAttrs, num_inputs=5, kind="elementwise", infer=_infer_y("BNInfer"),
    expand=_bninfer,
    fidelity=(Fidelity("formula", "no public 910B kernel source (prebuilt): y = ((x − mean)·rstd)·w "
                       "+ b, rstd = 1/sqrt(var + eps), each step rounded to float32, x's dtype "
                       "rounded once at the end", (2201, 1001)),),
    doc="Inference batch norm with per-channel [1,C,1,1] float32 weight, bias, mean, var.")


class V3Attrs(OpAttrs):
    eps: float
    momentum: float = 0.0
    training: bool = False


def rstd_newton_raphson(emit, var: str, eps: float) -> str:
    """ComputeRstdNewtonRaphsonReg (ops-nn norm_common reduce_common_regbase.h): v = max(var + eps,
    −99.99); r = 1/v; y = sqrt(r); one Newton step and a residual correction with Mula (modelled
    as fused multiply-add); v == FLT_MAX → 0, v == 0 → FLT_MAX."""
    c = lambda value: emit("fill", [], F32, value=value)  # noqa: E731
    v = emit("max", [emit("add", [var, c(float(np.float32(eps)))], F32), c(float(np.float32(-99.99)))], F32)
    r = emit("div", [c(1.0), v], F32)
    y = emit("sqrt", [r], F32)
    t = emit("mul", [emit("mul", [v, c(-0.5)], F32), y], F32)
    t1 = emit("fma", [t, y, c(1.5)], F32)
    rstd = emit("mul", [y, t1], F32)
    s = emit("fma", [emit("mul", [v, c(-1.0)], F32), r, c(1.0)], F32)
    r = emit("fma", [emit("mul", [rstd, c(-1.0)], F32), rstd, r], F32)
    s = emit("mul", [emit("fma", [v, r, s], F32), rstd], F32)
    rstd = emit("fma", [s, c(0.5), rstd], F32)
    rstd = emit("where", [emit("eq", [v, c(FLT_MAX)], DataType.BOOL), c(0.0), rstd], F32)
    return emit("where", [emit("eq", [v, c(0.0)], DataType.BOOL), c(FLT_MAX), rstd], F32)


def _v3_y(emit, args, a: V3Attrs, ts) -> str:
    """y = ((x − mean)·gamma)·rstd + beta in float32 (batch_norm_v3_infer.h), then RINT to x's dtype."""
    x, w, b, mean, var = _upcast(emit, args, ts)
    rstd = rstd_newton_raphson(emit, var, a.eps)
    y = emit("add", [emit("mul", [emit("mul", [emit("sub", [x, mean], F32), w], F32), rstd], F32), b], F32)
    return y if ts[0].dtype == F32 else emit("cast", [y], ts[0].dtype)


def _v3_infer(ts, a: V3Attrs):
    _check("BatchNormV3", ts)
    require(not a.training, "BatchNormV3", "only inference (training = false) is modelled")
    return [ts[0].with_(), ts[3].with_(), ts[4].with_()]


def _v3(emit, args, a: V3Attrs, ts) -> tuple[str, str, str]:
    """y, and the batch mean/var outputs: in inference no op_api reads them; they are given the
    running statistics."""
    return _v3_y(emit, args, a, ts), args[3], args[4]


BatchNormV3 = define_op(
    "BatchNormV3", attrs=V3Attrs, num_inputs=5, kind="elementwise", infer=_v3_infer, expand=_v3,
    fidelity=(Fidelity("bit-faithful", "950 kernel source (ops-nn batch_norm_v3 arch35 "
                       "batch_norm_v3_infer.h; the Newton-Raphson rstd of reduce_common_regbase.h, "
                       "Mula modelled as a fused multiply-add)", (3510,)),),
    doc="BatchNormV3 with training = false: (y, batchMean, batchVar); y = (x − mean)·w·rstd + b.")
