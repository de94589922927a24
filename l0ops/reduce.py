"""Reductions: ReduceSum, ReduceMean, ReduceVar, ReduceMeanWithCount and ReduceStdWithMean (the
ops-math l0 APIs the SyncBatchNorm family calls). Their vendor kernels publish no summation
order (910B kernels are prebuilt; the 950 templates use tiling-dependent trees), so every float
sum here runs in opgraph's fixed order (:mod:`l0ops.ordered`), accumulating in float32, and the
op order around it follows the public sources where there are any.

    >>> import numpy as np
    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType
    >>> g = Graph(); x = g.add_input("x", TensorType((2, 3, 4), DataType.FLOAT))
    >>> var, mean = ReduceVar(g, x, axes=(0, 2))
    >>> str(var.type), str(mean.type)
    ('f32[3]', 'f32[3]')
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from opgraph.core.dtypes import DataType
from opgraph.core.opdef import Fidelity, OpAttrs, require
from opgraph.core.types import TensorType
from .basic import _norm_axes
from .define import define_op
from .expansion import expansion_compute
from .primitives import as_f32

F32 = DataType.FLOAT
ORDER = "float32 sums in opgraph's fixed order (l0ops.ordered): the vendor's order is not public"


class ReduceAttrs(OpAttrs):
    """ReduceSum's, ReduceMean's and ReduceMeanWithCount's attributes: ``axes``, the dims reduced
    (negative counts from the end; no repeats); ``keepdims``, keep them as size 1."""

    axes: tuple[int, ...]
    keepdims: bool = False


def reduced_type(t: TensorType, axes: Sequence[int], keepdims: bool, op: str,
                 dtype: "DataType | None" = None) -> TensorType:
    """The TensorType of ``t`` reduced over ``axes``."""
    ax = _norm_axes(op, axes, t.rank)
    shape = tuple(1 if i in ax else n for i, n in enumerate(t.shape) if keepdims or i not in ax)
    return t.with_(shape=shape, dtype=t.dtype if dtype is None else dtype)


def _keep(t, axes) -> tuple[int, ...]:
    return tuple(1 if i in axes else n for i, n in enumerate(t.shape))


def _f32(emit, r: str, t) -> str:
    """``r`` as float32 (exact from f16/bf16)."""
    return r if t.dtype == F32 else emit("cast", [r], F32)


def _finish(emit, r: str, out) -> str:
    """Round a float32 (keepdims) register to the output's dtype and shape."""
    r = r if out.dtype == F32 else emit("cast", [r], out.dtype)
    return emit("view", [r], out.dtype, shape=out.shape)


def _fill(emit, value: float) -> str:
    return emit("fill", [], F32, value=as_f32(value))


def _sum_infer(ts, a):
    t = ts[0]  # (no axes: the identity, free of a kernel, so BOOL stays BOOL)
    return [reduced_type(t, a.axes, a.keepdims, "ReduceSum",
                         DataType.INT64 if t.dtype == DataType.BOOL and a.axes else None)]


def _sum_expand(emit, args, a, ts):
    """Floats: cast to float32, the ordered sum, round back once."""
    t, out = ts[0], _sum_infer(ts, a)[0]
    if not a.axes:
        return args[0]
    axes = _norm_axes("ReduceSum", a.axes, t.rank)
    x = _f32(emit, args[0], t)
    if len(axes) == t.rank and not a.keepdims:  # to a scalar: hoistable inside elementwise fusion
        r = emit("sum", [x], F32, over=t.shape)
        return r if out.dtype == F32 else emit("cast", [r], out.dtype)
    return _finish(emit, emit("sum", [x], F32, shape=_keep(t, axes), over=t.shape), out)


def _float(t) -> bool:
    return t.dtype in (F32, DataType.FLOAT16, DataType.BF16)


_sum_float = expansion_compute(_sum_expand)


def _sum_compute(xs, a):
    x = np.asarray(xs[0])
    if not a.axes:
        return [x]
    if x.dtype.kind in "fV":
        return _sum_float(xs, a)
    # integers: exact in any order; a 0-d tensor's axis 0 is itself (nothing to reduce)
    axes = tuple(d for d in _norm_axes("ReduceSum", a.axes, x.ndim) if d < x.ndim)
    return [np.asarray(np.sum(x, axis=axes, keepdims=a.keepdims,
                              dtype=np.int64 if x.dtype == np.bool_ else x.dtype))]


ReduceSum = define_op(
    "ReduceSum", attrs=ReduceAttrs, num_inputs=1, kind="reduce", infer=_sum_infer,
    compute=_sum_compute, expand=_sum_expand,
    expandable=lambda node: _float(node.inputs[0].type),
    free=lambda node: not node.attrs.axes,
    fidelity=(Fidelity("formula", ORDER + "; integer sums are exact"),),
    doc="Sum over ``axes`` (empty axes is the identity); BOOL sums to INT64.")


def _inverse(n: int) -> float:
    """1/n for the f32 scale of a mean; inf for n = 0, as float32 division gives it (so a mean of
    no elements is 0 × inf: NaN, not a ZeroDivisionError)."""
    return 1.0 / n if n else math.inf


def _count(shape, axes) -> int:
    """The elements each result averages (1 on a 0-d tensor, whose axis 0 is itself)."""
    return math.prod(shape[d] for d in _norm_axes("reduce", axes, len(shape)) if d < len(shape))


def _mean_infer(ts, a):
    return [reduced_type(ts[0], a.axes, a.keepdims, "ReduceMean")]


def _mean_expand(emit, args, a, ts):
    """sum, then × f32(1/N) — the order of the 950 DAG and of the newer public TBE copy."""
    t, out = ts[0], _mean_infer(ts, a)[0]
    if not a.axes:
        return args[0]
    axes = _norm_axes("ReduceMean", a.axes, t.rank)
    s = emit("sum", [_f32(emit, args[0], t)], F32, shape=_keep(t, axes), over=t.shape)
    return _finish(emit, emit("mul", [s, _fill(emit, _inverse(_count(t.shape, axes)))], F32), out)


ReduceMean = define_op(
    "ReduceMean", attrs=ReduceAttrs, num_inputs=1, kind="reduce", infer=_mean_infer,
    expand=_mean_expand,
    fidelity=(Fidelity("formula", "Σx × f32(1/N) (sum then scale, as the 950 DAG and the newer "
                       "public 910B TBE copy); " + ORDER),),
    doc="Mean over ``axes``.")


class VarAttrs(OpAttrs):
    """ReduceVar's attributes: ``axes`` and ``keepdims`` as :class:`ReduceAttrs`; ``correction``,
    subtracted from the element count in the divisor (0: biased, 1: unbiased)."""

    axes: tuple[int, ...]
    correction: int = 0
    keepdims: bool = False


def _var_infer(ts, a):
    return [reduced_type(ts[0], a.axes, a.keepdims, "ReduceVar")] * 2


def _var_expand(emit, args, a, ts):
    """The 950 two-pass order (reduce_var_twopass.h): mean = S·f32(1/R) (its 2^-k pre-scaling is
    exact), var = Σ f32(f32((x − mean)·f32(1/(R − correction)))·(x − mean))."""
    t, out = ts[0], _var_infer(ts, a)[0]
    axes = _norm_axes("ReduceVar", a.axes, t.rank)
    R = _count(t.shape, axes)
    x = _f32(emit, args[0], t)
    mean = emit("mul", [emit("sum", [x], F32, shape=_keep(t, axes), over=t.shape), _fill(emit, _inverse(R))], F32)
    scale = _fill(emit, 1.0 / (R - a.correction) if R > a.correction else np.inf)
    d = emit("sub", [x, mean], F32)
    var = emit("sum", [emit("mul", [emit("mul", [d, scale], F32), d], F32)], F32, shape=_keep(t, axes),
               over=t.shape)
    return _finish(emit, var, out), _finish(emit, mean, out)


ReduceVar = define_op(
    "ReduceVar", attrs=VarAttrs, num_inputs=1, kind="reduce", infer=_var_infer, expand=_var_expand,
    fidelity=(Fidelity("formula", "the 950 kernel's two-pass op order (ops-math reduce_var "
                       "arch35); the Welford path it takes for very large reductions is not "
                       "modelled; " + ORDER, (3510,)),),
    doc="(variance, mean) over ``axes`` with ``correction`` (0: biased).")


def _mean_with_count_infer(ts, a):
    x, c, cs = ts
    require(c.shape == x.shape and cs.shape == x.shape, "ReduceMeanWithCount",
            f"count {list(c.shape)} and countSum {list(cs.shape)} must have x's shape {list(x.shape)}")
    return [reduced_type(x, a.axes, a.keepdims, "ReduceMeanWithCount")]


def _mean_with_count_expand(emit, args, a, ts):
    x, c, cs = (_f32(emit, r, t) for r, t in zip(args, ts))
    t, out = ts[0], _mean_with_count_infer(ts, a)[0]
    axes = _norm_axes("ReduceMeanWithCount", a.axes, t.rank)
    terms = emit("div", [emit("mul", [x, c], F32), cs], F32)  # Mul, Div: each rounded
    return _finish(emit, emit("sum", [terms], F32, shape=_keep(t, axes), over=t.shape), out)


ReduceMeanWithCount = define_op(
    "ReduceMeanWithCount", attrs=ReduceAttrs, num_inputs=3, kind="reduce",
    infer=_mean_with_count_infer, expand=_mean_with_count_expand,
    fidelity=(Fidelity("formula", "Σ f32(f32(x·count)/countSum) (the 950 DAG's Mul, Div, "
                       "ReduceSum; the public 910B TBE copy); " + ORDER),),
    doc="Σ over ``axes`` of x·count/countSum (count and countSum broadcast to x's shape).")


class StdAttrs(OpAttrs):
    """ReduceStdWithMean's attributes: ``axes``, ``keepdims`` and ``correction`` as
    :class:`VarAttrs`; ``eps``, added to the variance; ``invert``, return 1/sqrt(var + eps)
    (computed as sqrt(1/(var + eps))) rather than sqrt(var + eps)."""

    axes: tuple[int, ...]
    correction: int = 0
    keepdims: bool = False
    invert: bool = True
    eps: float = 0.001


def _std_infer(ts, a):
    require(ts[1].shape == ts[0].shape, "ReduceStdWithMean",
            f"mean {list(ts[1].shape)} must be broadcast to x's shape {list(ts[0].shape)}")
    return [reduced_type(ts[0], a.axes, a.keepdims, "ReduceStdWithMean")]


def _std_expand(emit, args, a, ts):
    """d = x − mean; var = Σ f32(f32(d·d)·f32(1/N)) (scaled per element, before the sum);
    invert: sqrt(f32(1/(var + eps))) — the reciprocal before the square root."""
    x, mean = (_f32(emit, r, t) for r, t in zip(args, ts))
    t, out = ts[0], _std_infer(ts, a)[0]
    axes = _norm_axes("ReduceStdWithMean", a.axes, t.rank)
    d = emit("sub", [x, mean], F32)
    q = emit("mul", [emit("mul", [d, d], F32), _fill(emit, _inverse(_count(t.shape, axes) - a.correction))], F32)
    v = emit("add", [emit("sum", [q], F32, shape=_keep(t, axes), over=t.shape), _fill(emit, a.eps)], F32)
    y = emit("sqrt", [emit("div", [_fill(emit, 1.0), v], F32) if a.invert else v], F32)
    return _finish(emit, y, out)


ReduceStdWithMean = define_op(
    "ReduceStdWithMean", attrs=StdAttrs, num_inputs=2, kind="reduce", infer=_std_infer,
    expand=_std_expand,
    fidelity=(Fidelity("formula", "no public 910B kernel source; the op order of a public TBE "
                       "copy (per-element 1/N, reciprocal before sqrt); " + ORDER),),
    doc="The standard deviation (or with invert=True, 1/sqrt(var + eps) as sqrt(1/(var + eps))) "
        "over ``axes`` of x around a given (broadcast) mean.")

__all__ = ["ReduceMean", "ReduceMeanWithCount", "ReduceStdWithMean", "ReduceSum", "ReduceVar",
           "reduced_type"]
