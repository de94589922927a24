"""The ``native`` backend: every FusedElementwise node runs as a compiled C kernel (one pass over
the data, OpenMP threads, bit-identical to the numpy backend); all other nodes, and fused bodies
the renderer does not handle (non-float registers, per-element view/sum/fill, an output that
partly overlaps an input), run on numpy.

Needs a C compiler on PATH (``cc``/``gcc``/``clang``, or ``$CC``). Without one,
``backends.get("native")`` raises ``BackendUnavailable`` with one line saying so, and
``available()`` is False; opgraph's default backend stays numpy, so only a user who asks for
``native`` explicitly sees the error. Kernels are cached on disk (see :mod:`.build`).

    >>> import numpy as np
    >>> from l0ops.fused import FusedAttrs, Instr
    >>> from opgraph.core.dtypes import DataType as D
    >>> a = FusedAttrs(shape=(2, 3), body=(Instr(op="mul", args=("in0", "in1"), dtype=D.FLOAT),),
    ...                result="t0", out_dtype=D.FLOAT)
    >>> x, w = np.arange(6, dtype=np.float32).reshape(2, 3), np.float32([[1, 2, 3]])
    >>> (run_fused_native(a, [x, w]) if available() else x * w).tolist()
    [[0.0, 2.0, 6.0], [3.0, 8.0, 15.0]]
"""
from __future__ import annotations

import ctypes
import math
from collections import Counter
from typing import Any, Optional, Sequence

import numpy as np

from l0ops.primitives import FusedAttrs, Hoisted
from opgraph.core.backend import LoweringTable
from ..numpy_backend import NUMPY_LOWERINGS, NumpyBackend
from . import build, render
from .build import NativeBuildError, availability
from .reduce import run_fused_reduce_native
from .render import Unsupported

_ARGTYPES = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]


def available() -> bool:
    """True when a C compiler is on PATH (the native backend can run here)."""
    return availability()[0]


def _element_strides(x: np.ndarray) -> list[int]:
    if any(s % x.itemsize for s in x.strides):
        raise Unsupported("an operand's strides are not a multiple of its element size")
    return [s // x.itemsize for s in x.strides]


def collapse(shape: Sequence[int], strides: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that every operand walks contiguously.

    >>> collapse((2, 3, 4), [[12, 4, 1], [0, 1, 0]])
    ([2, 3, 4], [[12, 4, 1], [0, 1, 0]])
    >>> collapse((2, 1, 4), [[4, 4, 1], [4, 0, 1]])
    ([8], [[1], [1]])
    """
    dims = [d for d, n in enumerate(shape) if n != 1]
    out_shape: list[int] = []
    out_st: list[list[int]] = [[] for _ in strides]
    for d in dims:
        if out_shape and all(st[-1] == s[d] * shape[d] for st, s in zip(out_st, strides)):
            out_shape[-1] *= shape[d]
            for st, s in zip(out_st, strides):
                st[-1] = s[d]
            continue
        out_shape.append(shape[d])
        for st, s in zip(out_st, strides):
            st.append(s[d])
    if not out_shape:
        return [1], [[0] for _ in strides]
    return out_shape, out_st


def _check_out(a: FusedAttrs, out: np.ndarray, inputs: Sequence[np.ndarray]) -> None:
    if out.shape != tuple(a.shape) or out.dtype != a.out_dtype.np or not out.flags.writeable:
        raise Unsupported("the store destination is not a writeable array of the result type")
    for x in inputs:
        if np.may_share_memory(x, out) and not (
                x.__array_interface__["data"][0] == out.__array_interface__["data"][0]
                and x.strides == out.strides and x.shape == out.shape):
            raise Unsupported("the output partly overlaps an input")


def run_fused_native(a: FusedAttrs, inputs: Sequence[np.ndarray],
                     out: Optional[np.ndarray] = None) -> np.ndarray:
    """Like :func:`l0ops.primitives.run_fused`, as a compiled kernel (bit-identical results).
    Raises :class:`Unsupported` for a body it does not render."""
    h = Hoisted(a, inputs)
    p = render.plan(a, h)
    full = tuple(a.shape)
    if out is None:
        out = np.empty(full, a.out_dtype.np)
    _check_out(a, out, inputs)
    if math.prod(full) == 0:
        return out
    operands = [h.big[r] for r, _ in p.big]
    operands += [np.broadcast_to(np.asarray(h.values[r], np.float32), full) for r in p.hoisted]
    operands.append(out)
    shape, strides = collapse(full, [_element_strides(x) for x in operands])
    kernel = build.load(render.render(p))
    fn = kernel.fn
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _ARGTYPES, None
    c_shape = np.asarray(shape, np.int64)
    c_ptrs = np.asarray([x.__array_interface__["data"][0] for x in operands], np.uintp)
    c_strides = np.asarray(strides, np.int64).reshape(-1)
    fn(len(shape), c_shape.ctypes.data, c_ptrs.ctypes.data, c_strides.ctypes.data, render.BLOCK)
    return out


def _lower_fused(exe: Any, node: Any, args: list) -> list:
    """FusedElementwise as a compiled C kernel; small or unsupported bodies run on numpy."""
    a: FusedAttrs = node.attrs
    backend: NativeBackend = exe.backend
    if math.prod(a.shape) < backend.min_elements:
        backend.small += 1
        return node.opdef.compute(args, a)
    ins, dst = (args[:-1], args[-1]) if a.store else (args, None)
    try:
        return [run_fused_native(a, ins, dst)]
    except Unsupported as e:
        backend.fallbacks[str(e)] += 1
        return node.opdef.compute(args, a)


def _lower_reduce(exe: Any, node: Any, args: list) -> list:
    """FusedReduce with its reductions in C; bodies the C pass does not cover run on numpy."""
    backend: NativeBackend = exe.backend
    if sum(np.asarray(x).size for x in args) < backend.min_elements:
        backend.small += 1
        return node.opdef.compute(args, node.attrs)
    try:
        return run_fused_reduce_native(node.attrs, args)
    except Unsupported as e:
        backend.fallbacks[str(e)] += 1
        return node.opdef.compute(args, node.attrs)


NATIVE_LOWERINGS: LoweringTable = NUMPY_LOWERINGS.extend({"FusedElementwise": _lower_fused,
                                                          "FusedReduce": _lower_reduce})


class NativeBackend(NumpyBackend):
    """NumpyBackend with FusedElementwise lowered to compiled C; ``fallbacks`` counts the fused
    nodes that ran on numpy, by reason. Kernels smaller than ``min_elements`` run on numpy
    (the same bits; calling into C costs more than it saves there) and are counted in ``small``."""

    name = "native"
    min_elements = 4096
    lowerings = NATIVE_LOWERINGS

    def __init__(self) -> None:
        self.fallbacks: Counter[str] = Counter()
        self.small = 0

    def availability(self) -> tuple[bool, str]:
        return availability()


def emit_c(node: Any) -> str:
    """C source of a FusedElementwise node's kernel (per-channel inputs filled with ones: the
    source depends only on the node's types). Raises :class:`Unsupported`."""
    dummies = [np.broadcast_to(np.ones((), v.dtype.np), v.type.shape) for v in node.inputs]
    a: FusedAttrs = node.attrs
    return render.render(render.plan(a, Hoisted(a, dummies[:-1] if a.store else dummies)))


__all__ = ["NativeBackend", "NativeBuildError", "Unsupported", "available", "availability",
           "collapse", "emit_c", "run_fused_native"]
