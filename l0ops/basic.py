"""The generic l0 ops the op_api composes: Contiguous, Cast, RealDiv, UnsqueezeNd,
BroadcastTo, Fill and ViewCopy (their ops-math l0 APIs). Each call records one node, even when CANN would
launch nothing for it (the ``free`` predicates say when; level-1 pruning removes those).

    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType
    >>> g = Graph()
    >>> x = g.add_input("x", TensorType((3,), DataType.FLOAT))
    >>> y = UnsqueezeNd(g, x, dims=(0,))
    >>> str(BroadcastTo(g, y, shape=(2, 3)).type)
    'f32[2,3]'
"""
from __future__ import annotations

import numpy as np

from opgraph.core.dtypes import DataType
from opgraph.core.opdef import DType, Fidelity, L0Error, OpAttrs, require
from opgraph.core.tensor import shape_error
from opgraph.core.types import TensorType
from .define import define_op
from .primitives import cast_array, fill_value_ok

MOVES = (Fidelity("no arithmetic", "moves or views data"),)
EXACT = (Fidelity("bit-faithful", "IEEE 754: one rounding to the result dtype"),)


def _same(ts, a):
    return [ts[0].with_()]


def _contiguous(xs, a):
    return [np.asarray(xs[0], order="C")]  # (not ascontiguousarray, which makes 0-d arrays 1-d)


Contiguous = define_op(
    "Contiguous", infer=_same, compute=_contiguous, kind="copy", num_inputs=1, fidelity=MOVES,
    expand=lambda emit, args, a, ts: args[0],  # fused: a strided read
    free=lambda node: node.inputs[0].type.is_contiguous,
    doc="A contiguous copy of a (possibly strided) tensor; free when the input is contiguous.")


class CastAttrs(OpAttrs):
    """Cast's attributes: ``to``, the dtype to convert to (a DataType or its name)."""

    to: DType


Cast = define_op(
    "Cast", attrs=CastAttrs, num_inputs=1, kind="elementwise",
    infer=lambda ts, a: [ts[0].with_(dtype=a.to)],
    compute=lambda xs, a: [cast_array(xs[0], a.to)],
    expand=lambda emit, args, a, ts: emit("cast", args, a.to),
    free=lambda node: node.inputs[0].dtype == node.attrs.to, fidelity=EXACT,
    doc="Elementwise dtype conversion; identity (no kernel) when the dtype already matches.")


def _norm_axes(op: str, axes, rank: int) -> tuple[int, ...]:
    out = []
    for d in axes:
        require(-max(rank, 1) <= d < max(rank, 1), op, f"axis {d} out of range for rank {rank}")
        out.append(d % rank if rank else 0)
    require(len(set(out)) == len(out), op, f"repeated axes {tuple(axes)}")
    return tuple(out)


def _div_infer(ts, a):
    x, y = ts
    require(x.dtype == y.dtype, "RealDiv", f"operand dtypes differ ({x.dtype.short} vs {y.dtype.short})")
    try:
        shape = np.broadcast_shapes(x.shape, y.shape)
    except ValueError:
        raise L0Error(f"RealDiv: shapes {list(x.shape)} and {list(y.shape)} do not broadcast") from None
    return [x.with_(shape=shape)]


RealDiv = define_op(
    "RealDiv", num_inputs=2, kind="elementwise", infer=_div_infer,
    expand=lambda emit, args, a, ts: emit("div", args, ts[0].dtype), fidelity=EXACT,
    doc="Broadcasting true division of two tensors of one dtype.")


class UnsqueezeAttrs(OpAttrs):
    """UnsqueezeNd's attributes: ``dims``, the positions of the new size-1 dims in the output
    (negative counts from the output's end; no repeats)."""

    dims: tuple[int, ...]


def _unsqueeze_dims(rank_in: int, dims) -> tuple[int, ...]:
    out_rank = rank_in + len(dims)
    norm = _norm_axes("UnsqueezeNd", dims, out_rank)
    return tuple(sorted(norm))


def _unsqueeze_infer(ts, a):
    t = ts[0]
    require(t.is_contiguous, "UnsqueezeNd", "input must be contiguous")
    dims = _unsqueeze_dims(t.rank, a.dims)
    shape = list(t.shape)
    for d in dims:
        shape.insert(d, 1)
    return [t.with_(shape=tuple(shape))]


UnsqueezeNd = define_op(
    "UnsqueezeNd", attrs=UnsqueezeAttrs, num_inputs=1, kind="view", infer=_unsqueeze_infer,
    compute=lambda xs, a: [np.expand_dims(xs[0], _unsqueeze_dims(xs[0].ndim, a.dims))],
    expand=lambda emit, args, a, ts: emit("view", args, ts[0].dtype,
                                          shape=_unsqueeze_infer(ts, a)[0].shape),
    free=lambda node: True, fidelity=MOVES,
    doc="Insert size-1 dims at output positions ``dims``; a pure view (no kernel).")


class ShapeAttrs(OpAttrs):
    """BroadcastTo's attributes: ``shape``, the target shape, to which the input must broadcast."""

    shape: tuple[int, ...]


def _broadcast_infer(ts, a):
    t = ts[0]
    try:
        out = np.broadcast_shapes(t.shape, a.shape)
    except ValueError:
        out = None
    require(out == tuple(a.shape), "BroadcastTo", f"cannot broadcast {list(t.shape)} to {list(a.shape)}")
    return [t.with_(shape=tuple(a.shape))]


BroadcastTo = define_op(
    "BroadcastTo", attrs=ShapeAttrs, num_inputs=1, kind="movement", infer=_broadcast_infer,
    compute=lambda xs, a: [np.array(np.broadcast_to(xs[0], a.shape))], fidelity=MOVES,
    expand=lambda emit, args, a, ts: args[0],  # fused: a stride-0 read
    doc="Materialise a broadcast to ``shape`` (always a kernel in CANN).")


class FillAttrs(OpAttrs):
    """Fill's attributes: the new tensor's ``shape``, its ``dtype`` (default float32) and the
    ``value`` every element holds (into an integer dtype: truncated, its integer part must fit)."""

    shape: tuple[int, ...]
    value: float
    dtype: DType = DataType.FLOAT


def _fill_infer(ts, a):
    """A shape a tensor can have (as ``opgraph.Tensor`` checks it) and a value the dtype holds."""
    shape = a.shape
    problem = shape_error(shape)
    require(problem is None, "Fill", problem or "")
    require(fill_value_ok(a.value, a.dtype), "Fill",
            f"value {a.value!r} does not convert to {a.dtype.short} (its integer part must fit)")
    return [TensorType(shape, a.dtype)]


Fill = define_op(
    "Fill", attrs=FillAttrs, num_inputs=0, kind="source", infer=_fill_infer,
    compute=lambda xs, a: [np.full(a.shape, a.value, dtype=a.dtype.np)], fidelity=MOVES,
    expand=lambda emit, args, a, ts: emit("fill", [], a.dtype, shape=a.shape, value=a.value),
    doc="A new tensor of ``shape`` filled with ``value`` (writes a fresh buffer).")


def _viewcopy_infer(ts, a):
    x, y = ts
    require(x.dtype == y.dtype, "ViewCopy", f"dtypes differ ({x.dtype.short} -> {y.dtype.short})")
    require(x.shape == y.shape or (x.numel == 1 and y.numel == 1), "ViewCopy",
            f"shapes differ ({list(x.shape)} -> {list(y.shape)})")
    return [y]


def _viewcopy_compute(xs, a):
    x, dst = xs
    np.copyto(dst, x.reshape(dst.shape))
    return [dst]


class ViewCopyAttrs(OpAttrs):
    """ViewCopy's attributes: ``redirect``, set by level-1 pruning when the producer of x writes
    straight into y (y contiguous, x an intermediate): then no copy runs."""

    redirect: bool = False  # set by level-1 pruning: the producer writes straight into y


ViewCopy = define_op(
    "ViewCopy", attrs=ViewCopyAttrs, num_inputs=2, kind="copy", writes=(1,),
    infer=_viewcopy_infer, compute=_viewcopy_compute,
    free=lambda node: node.attrs.redirect, redirect=lambda node: node.attrs.redirect,
    fidelity=MOVES,
    doc="Copy x into the (possibly strided) user tensor y, touching only y's view; an effect. "
        "With redirect=True (contiguous y, x an intermediate) no kernel runs: x's producer "
        "writes into y's memory.")
