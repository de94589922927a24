"""The native backend's elementwise launches: a FusedElementwise kernel call prepared once per
body and operand layouts (:class:`Launch`: the compiled kernel, its per-channel prologue table,
the collapsed loop as C arrays, the extents the overlap check needs), resized for a new batch
size of the same body, and :func:`run_fused_native`, which calls it.

    >>> collapse((2, 1, 4), [[4, 4, 1], [4, 0, 1]])
    ([8], [[1], [1]])
"""
from __future__ import annotations

import ctypes
import math
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from l0ops.interpreter import Hoisted, program, renaming
from l0ops.primitives import FusedAttrs, IdentityMemo
from opgraph.core.foreign import array_extent
from opgraph.core.tensor import row_major_strides
from . import build, c_text, render, team
from .build import PointerArray, address, int64_array
from .prologue import Prologue, render_fused
from .unsupported import Refused, Unsupported, remembered

_ARGTYPES = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_void_p]
_FUSED_ARGTYPES = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p]


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
    return collapsed(shape, strides, collapse_groups(shape, strides))


def collapse_groups(shape: Sequence[int], strides: Sequence[Sequence[int]]) -> list[list[int]]:
    """The dims :func:`collapse` merges into each of its dims, in order (size-1 dims dropped).

    >>> collapse_groups((2, 1, 4), [[4, 4, 1], [4, 0, 1]]), collapse_groups((1, 1), [[5, 7]])
    ([[0, 2]], [])
    """
    groups: list[list[int]] = []
    for d, n in enumerate(shape):
        if n == 1:
            continue
        if groups and all(s[groups[-1][-1]] == s[d] * n for s in strides):
            groups[-1].append(d)
        else:
            groups.append([d])
    return groups


def collapsed(shape: Sequence[int], strides: Sequence[Sequence[int]],
              groups: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """:func:`collapse`'s result from its ``groups``: each group's size, and per operand the
    stride of each group's last dim."""
    if not groups:
        return [1], [[0] for _ in strides]
    return ([math.prod([shape[d] for d in g]) for g in groups],
            [[s[g[-1]] for g in groups] for s in strides])


class Launch:
    """What a kernel call needs that depends only on the operands' dtypes and layouts: the
    kernel, the collapsed shape and strides (C arrays), the inputs whose pointers it takes, and
    per operand the byte extent it reads and whether it has the output's exact layout.

    With a C prologue (:mod:`.prologue`; ``fused`` set) the call passes the per-channel inputs'
    pointers and the prologue's table; otherwise the hoisted part runs in numpy per call and
    its registers ``hoisted`` (strides ``h_strides``) are passed."""

    # (no __slots__: resized() copies a launch's fields as one dict)

    def __init__(self, a: FusedAttrs, h: Hoisted, inputs: Sequence[np.ndarray], out: np.ndarray,
                 use_prologue: bool = True):
        p = render.plan(a, h)
        full = tuple(a.shape)
        if out.shape != full or out.dtype != a.out_dtype.np:
            raise Unsupported("the store destination is not a writeable array of the result type")
        self.attrs, self.hoisted = a, p.hoisted
        self.big = tuple(int(r[2:]) for r, _ in p.big)
        big = [inputs[k] for k in self.big]
        pro, prog = None, program(a, inputs)
        if use_prologue:
            try:
                pro = Prologue(a.body, prog.types, inputs, p.hoisted)
            except Unsupported:
                pro = None
        strides = [_element_strides(x) for x in big]
        if pro is not None:  # hoisted registers: in the prologue's scratch
            hv: list[np.ndarray] = []
            self.h_kernel_strides = [pro.kernel_strides(r, full) for r in p.hoisted]
            strides += self.h_kernel_strides
            self.small, self.tab = pro.small, int64_array(pro.table)
            source = render_fused(p, pro.source, len(pro.small), pro.hoisted_at)
        else:  # hoisted registers: numpy arrays passed per call
            self.h_kernel_strides = []
            hv = [_as_f32(h.values[r]) for r in p.hoisted]
            strides += [_element_strides(np.broadcast_to(v, full)) for v in hv]
            self.small, self.tab = (), None
            source = render.render(p)
        self.h_strides = tuple(v.strides for v in hv)
        self.ptrs = PointerArray(len(self.small) + len(big) + len(hv) + 1)
        kernel = build.load(source, symbol="opg_fused" if pro is not None else build.SYMBOL)
        self.fused = pro is not None
        self._lay_out(full, strides, big if self.fused else big + hv, out)
        fn = kernel.fn
        if fn.argtypes is None:
            fn.argtypes, fn.restype = (_FUSED_ARGTYPES, ctypes.c_int) if self.fused else (_ARGTYPES, None)
        self.fn = fn
        # what resized() needs: the operand shapes and the sizes the kernel and its prologue fix
        self.shapes = tuple(x.shape for x in inputs) + (full,)
        small = [inputs[k] for k in self.small]
        self.small_layouts = tuple((x.shape, x.strides) for x in small)
        self.pinned = (prog.pinned
                       | {n for x in small for n in x.shape}
                       | {n for _, shape, _ in (pro.regs.values() if pro else ()) for n in shape})

    def _lay_out(self, full: tuple[int, ...], strides: list[list[int]], read: Sequence[np.ndarray],
                 out: np.ndarray) -> None:
        """The parts that follow the operands' sizes and layouts: the collapsed loop (C arrays),
        the byte extents read and written, which operands have the output's layout."""
        self.empty = math.prod(full) == 0
        strides = strides + [_element_strides(out)]
        # the loop walks the output's memory in order (a channels_last output: channels
        # innermost, not a stride-C walk along W); each element's value is the same in any order
        order = sorted(range(len(full)), key=lambda d: -strides[-1][d])  # row-major: unchanged
        walk, strides = tuple(full[d] for d in order), [[s[d] for d in order] for s in strides]
        groups = collapse_groups(walk, strides)
        shape, loop_strides = collapsed(walk, strides, groups)
        self._set_flat_loop(shape, sum(loop_strides, []))
        self.extents = [array_extent(x) for x in read]
        self.out_extent = array_extent(out)
        self.same = [x.shape == out.shape and x.strides == out.strides for x in read]
        # operands all row-major at the full shape: every size of them merges the same dims
        # (a size-1 dim stays 1 under resized()'s renaming, and the dims a hoisted register
        # walks are sizes it pins), so resized() lays the loop out from these groups
        self.groups = groups if _row_major_at(full, read, out) else None
        self.hoisted_loop_strides = sum(loop_strides[len(self.big):-1], [])

    def _set_flat_loop(self, shape: list[int], strides: list[int]) -> None:
        self.ndim = len(shape)
        self.shape, self.strides = int64_array(shape), int64_array(strides)
        self.last: tuple = ()  # fused: (weak references to the arrays, their pointer array)

    def _relay(self, full: tuple[int, ...], big: Sequence[np.ndarray], out: np.ndarray) -> None:
        """:meth:`_lay_out` for operands row-major at ``full`` when this launch's were too."""
        assert self.groups is not None
        shape = [math.prod([full[d] for d in g]) for g in self.groups] or [1]
        steps = list(row_major_strides(tuple(shape))) if self.groups else [0]
        self._set_flat_loop(shape, steps * len(big) + self.hoisted_loop_strides + steps)
        self.extents = [(0, x.nbytes) for x in big]
        self.out_extent = (0, out.nbytes)
        self.same = [x.strides == out.strides for x in big]

    def resized(self, a: FusedAttrs, inputs: Sequence[np.ndarray], out: np.ndarray) -> "Launch | None":
        """This launch for the same body and operand dtypes at other sizes — the same kernel and
        prologue table, the loop laid out anew — or None unless (as for
        :meth:`l0ops.interpreter.Program.resized`) the operand shapes are a one-to-one renaming
        of this launch's that keeps every size the body, the prologue and its per-channel inputs
        fix, and those inputs keep their layouts."""
        full = tuple(a.shape)
        shapes = tuple([x.shape for x in inputs]) + (full,)
        if (not self.fused or a.body is not self.attrs.body or a.result != self.attrs.result
                or a.out_dtype != self.attrs.out_dtype or out.shape != full
                or renaming(self.shapes, shapes, self.pinned) is None
                or tuple([(inputs[k].shape, inputs[k].strides) for k in self.small])
                != self.small_layouts):
            return None
        made = object.__new__(Launch)
        made.__dict__.update(self.__dict__)
        made.attrs, made.shapes = a, shapes
        big = [inputs[k] for k in self.big]
        if self.groups is not None and _row_major_at(full, big, out):
            made._relay(full, big, out)
        else:  # the prologue's registers keep their shapes and the rank: so do their strides
            made._lay_out(full, [_element_strides(x) for x in big] + self.h_kernel_strides, big, out)
        return made


def _row_major_at(full: tuple[int, ...], arrays: Sequence[np.ndarray], out: np.ndarray) -> bool:
    """Whether ``out`` and every array in ``arrays`` is C-contiguous of shape ``full``."""
    return bool(out.flags.c_contiguous) and all(x.shape == full and x.flags.c_contiguous
                                                for x in arrays)


def _as_f32(v: Any) -> np.ndarray:
    return v if type(v) is np.ndarray and v.dtype == np.float32 else np.asarray(v, np.float32)


_LAUNCHES: dict[tuple, "Launch | Refused"] = {}
_BY_BODY = IdentityMemo(limit=256)  # the last launch built per body object and operand dtypes


def launch_for(a: FusedAttrs, inputs: Sequence[np.ndarray], out: np.ndarray) -> Launch:
    """The cached :class:`Launch` for these operands' dtypes and layouts (built on a miss; a
    body the kernel does not render raises :class:`Unsupported`, also remembered)."""
    key = (id(a), out.dtype, out.shape, out.strides) + tuple(
        (x.dtype, x.shape, x.strides) for x in inputs)
    ln = _LAUNCHES.get(key)
    if ln is None or ln.attrs is not a:
        ln = remembered(lambda: new_launch(a, inputs, out), a)
        if len(_LAUNCHES) >= 1024:
            _LAUNCHES.clear()
        _LAUNCHES[key] = ln
    if isinstance(ln, Refused):
        ln.raise_()
    return ln


def new_launch(a: FusedAttrs, inputs: Sequence[np.ndarray], out: np.ndarray) -> Launch:
    """A launch for these operands: the last one of the same body and dtypes laid out at their
    sizes (a new batch size: the same kernel) when it can be, else built."""
    dtypes = (out.dtype,) + tuple([x.dtype for x in inputs])
    last = _BY_BODY.peek(a.body, dtypes)
    ln = last.resized(a, inputs, out) if last is not None else None
    if ln is None:
        ln = Launch(a, Hoisted(a, inputs), inputs, out)
        _BY_BODY.put(a.body, dtypes, ln)
    return ln


def run_fused_native(a: FusedAttrs, inputs: Sequence[np.ndarray],
                     out: Optional[np.ndarray] = None) -> np.ndarray:
    """Like :func:`l0ops.interpreter.run_fused`, as a compiled kernel (bit-identical results).
    Raises :class:`Unsupported` for a body it does not render or an output that partly overlaps
    an input the kernel reads. Everything but the per-channel values and the data pointers is
    prepared once per (body, operand layouts)."""
    if out is None:
        out = np.empty(tuple(a.shape), a.out_dtype.np)
    if not out.flags.writeable:
        raise Unsupported("the store destination is not a writeable array of the result type")
    ln = launch_for(a, inputs, out)
    if ln.empty:
        return out
    if ln.fused:
        arrays = fused_operands(ln, inputs, out)
        last = ln.last  # the same array objects as the last call: their pointers are known
        if last and all(r() is x for r, x in zip(last[0], arrays)):
            ptrs = last[1]
        else:
            ptrs = _fused_pointers(ln, arrays)
        if ln.fn(ln.ndim, ln.shape, ln.strides, render.BLOCK, team.runner(), ln.tab, ptrs):
            raise MemoryError("native kernel: cannot allocate the per-channel scratch")
        return out
    h = Hoisted(a, inputs)  # no C prologue: the per-channel part in numpy
    hv = [_as_f32(h.values[r]) for r in ln.hoisted]
    if tuple(v.strides for v in hv) != ln.h_strides:  # not seen so far; prepared afresh
        ln = Launch(a, h, inputs, out, use_prologue=False)
    read = [address(inputs[k]) for k in ln.big] + [address(v) for v in hv]
    o = address(out)
    check_overlap(ln, read, o)
    ln.fn(ln.ndim, ln.shape, ln.ptrs(*read, o), ln.strides, render.BLOCK, team.runner())
    return out


def check_overlap(ln: Launch, read: Sequence[int], o: int) -> None:
    """Unsupported when the output at address ``o`` partly overlaps an operand the kernel reads
    (at addresses ``read``); writing over an input of exactly the output's layout is fine."""
    o_lo, o_hi = o + ln.out_extent[0], o + ln.out_extent[1]
    for x, (lo, hi), same in zip(read, ln.extents, ln.same):
        if x + lo < o_hi and o_lo < x + hi and not (same and x == o):
            raise Unsupported("the output partly overlaps an input")


def fused_operands(ln: Launch, inputs: Sequence[Any], out: Any) -> list:
    """A fused launch's operands in its pointer order: per-channel inputs, big inputs, output."""
    return [inputs[k] for k in ln.small] + [inputs[k] for k in ln.big] + [out]


def fused_pointers(ln: Launch, addrs: Sequence[int]) -> Any:
    """The pointer array of a fused launch for its operands' addresses (in
    :func:`fused_operands` order); Unsupported when the output partly overlaps an input."""
    check_overlap(ln, addrs[len(ln.small):-1], addrs[-1])
    return ln.ptrs(*addrs)


def _fused_pointers(ln: Launch, arrays: Sequence[np.ndarray]) -> Any:
    """:func:`fused_pointers` of ``arrays``, remembered on ``ln`` with weak references to them."""
    ptrs = fused_pointers(ln, [address(x) for x in arrays])
    try:
        ln.last = (tuple(weakref.ref(x) for x in arrays), ptrs)
    except TypeError:  # an array type without weak references: nothing remembered
        ln.last = ()
    return ptrs


_LANES_SOURCE = c_text.HELPERS + c_text.V_HELPERS + """
int opg_lanes(void)
{
#if defined(OPG_VEC)
    return OPG_W;
#else
    return 1;
#endif
}
"""


def vector_isa() -> str:
    """Which vector code the elementwise kernels compile to on this machine and compiler: their
    own preamble built and asked for its float lanes (what a benchmark log should state).

        >>> vector_isa() in ("AVX-512, 16 float lanes", "AVX2 + F16C, 8 float lanes", "scalar C",
        ...                  "no C compiler")
        True
    """
    if not build.availability()[0]:
        return "no C compiler"
    lanes = build.load(_LANES_SOURCE, symbol="opg_lanes").fn
    lanes.argtypes, lanes.restype = [], ctypes.c_int
    return {16: "AVX-512, 16 float lanes", 8: "AVX2 + F16C, 8 float lanes"}.get(lanes(), "scalar C")


__all__ = ["Launch", "check_overlap", "collapse", "collapse_groups", "collapsed", "launch_for",
           "new_launch", "run_fused_native", "vector_isa"]
