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

import numpy as np

from opgraph.core.dtypes import DataType
from opgraph.core.opdef import Fidelity, OpAttrs, require
from .basic import _norm_axes
from .define import define_op
from .ordered import ordered_sum

F32 = DataType.FLOAT
ORDER = "float32 sums in opgraph's fixed order (l0ops.ordered): the vendor's order is not public"


class ReduceAttrs(OpAttrs):
    axes: tuple[int, ...]
    keepdims: bool = False


def reduced_type(t, axes, keepdims: bool, op: str, dtype=None):
    """The TensorType of ``t`` reduced over ``axes``."""
    ax = _norm_axes(op, axes, t.rank)
    shape = tuple(1 if i in ax else n for i, n in enumerate(t.shape) if keepdims or i not in ax)
    return t.with_(shape=shape, dtype=t.dtype if dtype is None else dtype)


def _sum(x: np.ndarray, a) -> np.ndarray:
    """Sum in the data's dtype: floats through the ordered float32 sum, rounded back."""
    axes = _norm_axes("ReduceSum", a.axes, x.ndim)
    if x.dtype == np.bool_:
        return np.asarray(np.sum(x, axis=axes, keepdims=a.keepdims, dtype=np.int64))
    if x.dtype.kind in "fV":
        s = ordered_sum(x, axes, a.keepdims)
        return np.asarray(s).astype(x.dtype)
    return np.asarray(np.sum(x, axis=axes, keepdims=a.keepdims, dtype=x.dtype))  # exact


def _sum_infer(ts, a):
    t = ts[0]
    return [reduced_type(t, a.axes, a.keepdims, "ReduceSum",
                         DataType.INT64 if t.dtype == DataType.BOOL else None)]


ReduceSum = define_op(
    "ReduceSum", attrs=ReduceAttrs, num_inputs=1, kind="reduce", infer=_sum_infer,
    compute=lambda xs, a: [xs[0] if not a.axes else _sum(xs[0], a)],
    expand=lambda emit, args, a, ts: emit("sum", args, _sum_infer(ts, a)[0].dtype),
    expandable=lambda node: (not node.attrs.keepdims and node.inputs[0].dtype != DataType.BOOL
                             and len(node.attrs.axes) == node.inputs[0].type.rank),
    free=lambda node: not node.attrs.axes,
    fidelity=(Fidelity("formula", ORDER + "; integer sums are exact"),),
    doc="Sum over ``axes`` (empty axes is the identity); BOOL sums to INT64.")


def _count(shape, axes) -> int:
    return math.prod(shape[d] for d in _norm_axes("reduce", axes, len(shape)))


def _mean(x: np.ndarray, a) -> np.ndarray:
    """sum, then × f32(1/N) — the order of the 950 DAG and of the newer public TBE copy."""
    axes = _norm_axes("ReduceMean", a.axes, x.ndim)
    s = ordered_sum(x, axes, a.keepdims)
    return (s * np.float32(1.0 / _count(x.shape, axes))).astype(x.dtype)


ReduceMean = define_op(
    "ReduceMean", attrs=ReduceAttrs, num_inputs=1, kind="reduce",
    infer=lambda ts, a: [reduced_type(ts[0], a.axes, a.keepdims, "ReduceMean")],
    compute=lambda xs, a: [xs[0] if not a.axes else _mean(xs[0], a)],
    fidelity=(Fidelity("formula", "Σx × f32(1/N) (sum then scale, as the 950 DAG and the newer "
                       "public 910B TBE copy); " + ORDER),),
    doc="Mean over ``axes``.")


class VarAttrs(OpAttrs):
    axes: tuple[int, ...]
    correction: int = 0
    keepdims: bool = False


def _var(x: np.ndarray, a) -> list[np.ndarray]:
    """The 950 two-pass order (reduce_var_twopass.h): mean = S·f32(1/R) (its 2^-k pre-scaling is
    exact), var = Σ f32(f32((x − mean)·f32(1/(R − correction)))·(x − mean))."""
    axes = _norm_axes("ReduceVar", a.axes, x.ndim)
    xf = x.astype(np.float32)
    R = _count(x.shape, axes)
    mean_k = (ordered_sum(xf, axes, True) * np.float32(1.0 / R)).astype(np.float32)
    scale = np.float32(1.0 / (R - a.correction)) if R > a.correction else np.float32(np.inf)
    d = xf - mean_k
    var = ordered_sum((d * scale) * d, axes, a.keepdims)
    mean = mean_k if a.keepdims else mean_k.reshape(var.shape)
    return [var.astype(x.dtype), mean.astype(x.dtype)]


ReduceVar = define_op(
    "ReduceVar", attrs=VarAttrs, num_inputs=1, kind="reduce",
    infer=lambda ts, a: [reduced_type(ts[0], a.axes, a.keepdims, "ReduceVar")] * 2,
    compute=lambda xs, a: _var(xs[0], a),
    fidelity=(Fidelity("formula", "the 950 kernel's two-pass op order (ops-math reduce_var "
                       "arch35); the Welford path it takes for very large reductions is not "
                       "modelled; " + ORDER, (3510,)),),
    doc="(variance, mean) over ``axes`` with ``correction`` (0: biased).")


def _mean_with_count(xs, a):
    x, count, count_sum = (np.asarray(v).astype(np.float32) for v in xs)
    axes = _norm_axes("ReduceMeanWithCount", a.axes, x.ndim)
    terms = (x * count) / count_sum  # Mul, Div: each rounded to float32
    return [ordered_sum(terms, axes, a.keepdims).astype(xs[0].dtype)]


def _mean_with_count_infer(ts, a):
    x, c, cs = ts
    require(c.shape == x.shape and cs.shape == x.shape, "ReduceMeanWithCount",
            f"count {list(c.shape)} and countSum {list(cs.shape)} must have x's shape {list(x.shape)}")
    return [reduced_type(x, a.axes, a.keepdims, "ReduceMeanWithCount")]


ReduceMeanWithCount = define_op(
    "ReduceMeanWithCount", attrs=ReduceAttrs, num_inputs=3, kind="reduce",
    infer=_mean_with_count_infer, compute=_mean_with_count,
    fidelity=(Fidelity("formula", "Σ f32(f32(x·count)/countSum) (the 950 DAG's Mul, Div, "
                       "ReduceSum; the public 910B TBE copy); " + ORDER),),
    doc="Σ over ``axes`` of x·count/countSum (count and countSum broadcast to x's shape).")


class StdAttrs(OpAttrs):
    axes: tuple[int, ...]
    correction: int = 0
    keepdims: bool = False
    invert: bool = True
    eps: float = 0.001


def _std_with_mean(xs, a):
    """d = x − mean; var = Σ f32(f32(d·d)·f32(1/N)) (scaled per element, before the sum);
    invert: sqrt(f32(1/(var + eps))) — the reciprocal before the square root."""
    x, mean = (np.asarray(v).astype(np.float32) for v in xs)
    axes = _norm_axes("ReduceStdWithMean", a.axes, x.ndim)
    n = _count(x.shape, axes) - a.correction
    d = x - mean
    var = ordered_sum((d * d) * np.float32(1.0 / n), axes, a.keepdims)
    eps = np.float32(a.eps)
    out = np.sqrt(np.float32(1.0) / (var + eps)) if a.invert else np.sqrt(var + eps)
    return [np.asarray(out, np.float32).astype(xs[0].dtype)]


def _std_infer(ts, a):
    require(ts[1].shape == ts[0].shape, "ReduceStdWithMean",
            f"mean {list(ts[1].shape)} must be broadcast to x's shape {list(ts[0].shape)}")
    return [reduced_type(ts[0], a.axes, a.keepdims, "ReduceStdWithMean")]


ReduceStdWithMean = define_op(
    "ReduceStdWithMean", attrs=StdAttrs, num_inputs=2, kind="reduce", infer=_std_infer,
    compute=_std_with_mean,
    fidelity=(Fidelity("formula", "no public 910B kernel source; the op order of a public TBE "
                       "copy (per-element 1/N, reciprocal before sqrt); " + ORDER),),
    doc="The standard deviation (or with invert=True, 1/sqrt(var + eps) as sqrt(1/(var + eps))) "
        "over ``axes`` of x around a given (broadcast) mean.")

__all__ = ["ReduceMean", "ReduceMeanWithCount", "ReduceStdWithMean", "ReduceSum", "ReduceVar",
           "reduced_type"]
