"""Views that launch nothing: Reshape, SqueezeNd and ReFormat (ops-math l0 APIs; UnsqueezeNd is
in :mod:`l0ops.basic`). Each needs a contiguous input and returns a new view of it.

    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType, Format
    >>> g = Graph(); x = g.add_input("x", TensorType((1, 3), DataType.FLOAT))
    >>> str(SqueezeNd(g, x, dims=(0,)).type), str(ReFormat(g, x, format=Format.NC).type)
    ('f32[3]', 'f32[1,3]@NC')
"""
from __future__ import annotations

import math
from typing import Annotated

import numpy as np
from pydantic import BeforeValidator

from opgraph.core.dtypes import Format, format_of
from opgraph.core.opdef import Fidelity, OpAttrs, require
from .basic import _norm_axes
from .define import define_op

VIEW = (Fidelity("no arithmetic", "a view: no kernel"),)
# formats that fix the rank (a re-tag to them needs that rank)
FORMAT_RANK = {Format.NCHW: 4, Format.NHWC: 4, Format.HWCN: 4, Format.NCDHW: 5, Format.NDHWC: 5,
               Format.NC: 2, Format.NCL: 3}


class ShapeAttrs(OpAttrs):
    """Reshape's attributes: ``shape``, the new shape, with at most one -1 (inferred from the
    element count)."""

    shape: tuple[int, ...]


def _reshape_shape(t, shape) -> tuple[int, ...]:
    require(shape.count(-1) <= 1, "Reshape", f"more than one -1 in {list(shape)}")
    known = math.prod(n for n in shape if n != -1)
    if -1 in shape:
        require(known > 0 and t.numel % known == 0, "Reshape",
                f"cannot infer -1 in {list(shape)} for {t.numel} elements")
        shape = tuple(t.numel // known if n == -1 else n for n in shape)
    require(math.prod(shape) == t.numel and all(n >= 0 for n in shape), "Reshape",
            f"{list(t.shape)} ({t.numel} elements) cannot be viewed as {list(shape)}")
    return tuple(shape)


def _reshape_infer(ts, a):
    t = ts[0]
    require(t.is_contiguous, "Reshape", "input must be contiguous")
    shape = _reshape_shape(t, a.shape)
    fmt = t.format if len(shape) == t.rank else Format.ND  # a rank change re-tags ND
    return [t.with_(shape=shape, format=fmt)]


Reshape = define_op(
    "Reshape", attrs=ShapeAttrs, num_inputs=1, kind="view", infer=_reshape_infer,
    compute=lambda xs, a: [np.reshape(xs[0], _reshape_shape(_T(xs[0]), a.shape))],
    expand=lambda emit, args, a, ts: emit("view", args, ts[0].dtype, shape=_reshape_infer(ts, a)[0].shape),
    free=lambda node: True, fidelity=VIEW, doc="The same elements under another shape (one -1 allowed).")


class _T:
    """The two fields of a TensorType _reshape_shape reads, for an array."""

    def __init__(self, x: np.ndarray):
        self.shape, self.numel = x.shape, x.size


class DimsAttrs(OpAttrs):
    """SqueezeNd's attributes: ``dims``, the dims to remove where their size is 1 (others stay);
    empty: every size-1 dim."""

    dims: tuple[int, ...] = ()


def _squeezed(shape, dims) -> tuple[int, ...]:
    """Drop each listed dim whose size is 1 (others stay); no dims: every size-1 dim."""
    ax = _norm_axes("SqueezeNd", dims, len(shape)) if dims else tuple(range(len(shape)))
    return tuple(n for i, n in enumerate(shape) if not (i in ax and n == 1))


def _squeeze_infer(ts, a):
    t = ts[0]
    require(t.is_contiguous, "SqueezeNd", "input must be contiguous")
    return [t.with_(shape=_squeezed(t.shape, a.dims))]


SqueezeNd = define_op(
    "SqueezeNd", attrs=DimsAttrs, num_inputs=1, kind="view", infer=_squeeze_infer,
    compute=lambda xs, a: [np.reshape(xs[0], _squeezed(xs[0].shape, a.dims))],
    expand=lambda emit, args, a, ts: emit("view", args, ts[0].dtype, shape=_squeeze_infer(ts, a)[0].shape),
    free=lambda node: True, fidelity=VIEW,
    doc="Remove listed dims of size 1 (a listed dim of another size stays, as in ops-math).")


class FormatAttrs(OpAttrs):
    """ReFormat's attributes: ``format``, the new format tag (a Format, its name or number); a tag
    with a fixed rank (NCHW: 4, NCDHW: 5 ...) needs that rank."""

    format: Annotated[Format, BeforeValidator(format_of)]  # a Format, its name or its number


def _reformat_infer(ts, a):
    t = ts[0]
    want = FORMAT_RANK.get(a.format)
    require(want is None or want == t.rank, "ReFormat",
            f"format {a.format.name} needs rank {want}, the tensor has rank {t.rank}")
    # A view keeps a strided input's layout; a contiguous one is plain (as a recorded Contiguous
    # output is), so dropping an identity Contiguous in front of it leaves the type unchanged.
    return [t.with_(format=a.format, strides=None if t.is_contiguous else t.strides)]


ReFormat = define_op(
    "ReFormat", attrs=FormatAttrs, num_inputs=1, kind="view", infer=_reformat_infer,
    compute=lambda xs, a: [xs[0]], expand=lambda emit, args, a, ts: args[0],
    free=lambda node: True, fidelity=VIEW, doc="Re-tag the tensor's format (data unchanged).")
