"""The ``native`` backend: every FusedElementwise node runs as one compiled C call (its
per-channel part, then one pass over the data on the persistent thread team of :mod:`.team`;
bit-identical to the numpy backend, for any thread count); all other nodes, and fused bodies the
renderer does not handle (non-float registers, per-element view/sum/fill, an output that partly
overlaps an input), run on numpy. The hoisted per-channel part runs in numpy when the C
prologue (:mod:`.prologue`) does not cover it.

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
import weakref
from collections import Counter
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from l0ops.interpreter import Hoisted, program, renaming
from l0ops.primitives import FusedAttrs, IdentityMemo
from opgraph.core.backend import LoweringTable
from opgraph.core.ir import Graph
from opgraph.core.memory import MemoryPlan
from opgraph.core.platform import Platform
from opgraph.core.tensor import Tensor
from ..numpy_backend import NUMPY_LOWERINGS, NumpyBackend, NumpyExecutable
from . import build, render, team
from .build import NativeBuildError, PointerArray, address, availability, int64_array
from .prologue import Prologue, render_fused
from .reduce import run_fused_reduce_native
from .direct_reduce import DirectReduce
from .small import run_small_reduce_native
from .render import Unsupported

_ARGTYPES = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_void_p]
_FUSED_ARGTYPES = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p]


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


def row_major(shape: Sequence[int]) -> list[int]:
    """Element strides of a C-contiguous array of ``shape``.

    >>> row_major([6, 4, 2])
    [8, 2, 1]
    """
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


class _Launch:
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
        groups = collapse_groups(full, strides)
        shape, loop_strides = collapsed(full, strides, groups)
        self._set_loop(shape, loop_strides)
        self.extents = [_extent(x) for x in read]
        self.out_extent = _extent(out)
        self.same = [x.shape == out.shape and x.strides == out.strides for x in read]
        # operands all row-major at the full shape: every size of them merges the same dims
        # (a size-1 dim stays 1 under resized()'s renaming, and the dims a hoisted register
        # walks are sizes it pins), so resized() lays the loop out from these groups
        self.groups = groups if _row_major_at(full, read, out) else None
        self.hoisted_loop_strides = sum(loop_strides[len(self.big):-1], [])

    def _set_loop(self, shape: list[int], strides: list[list[int]]) -> None:
        self._set_flat_loop(shape, sum(strides, []))

    def _set_flat_loop(self, shape: list[int], strides: list[int]) -> None:
        self.ndim = len(shape)
        self.shape, self.strides = int64_array(shape), int64_array(strides)
        self.last: tuple = ()  # fused: (weak references to the arrays, their pointer array)

    def _relay(self, full: tuple[int, ...], big: Sequence[np.ndarray], out: np.ndarray) -> None:
        """:meth:`_lay_out` for operands row-major at ``full`` when this launch's were too."""
        assert self.groups is not None
        shape = [math.prod([full[d] for d in g]) for g in self.groups] or [1]
        steps = row_major(shape) if self.groups else [0]
        self._set_flat_loop(shape, steps * len(big) + self.hoisted_loop_strides + steps)
        self.extents = [(0, x.nbytes) for x in big]
        self.out_extent = (0, out.nbytes)
        self.same = [x.strides == out.strides for x in big]

    def resized(self, a: FusedAttrs, inputs: Sequence[np.ndarray], out: np.ndarray) -> "_Launch | None":
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
        made = object.__new__(_Launch)
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


def _extent(x: np.ndarray) -> tuple[int, int]:
    """Byte offsets [lo, hi) around the data pointer that ``x`` touches (empty: (0, 0))."""
    if x.size == 0:
        return 0, 0
    if x.flags.c_contiguous:
        return 0, x.nbytes
    lo = sum((n - 1) * s for n, s in zip(x.shape, x.strides) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(x.shape, x.strides) if s > 0) + x.itemsize
    return lo, hi


_LAUNCHES: dict[tuple, _Launch] = {}
_BY_BODY = IdentityMemo(limit=256)  # the last launch built per body object and operand dtypes


def _launch(a: FusedAttrs, inputs: Sequence[np.ndarray], out: np.ndarray) -> _Launch:
    """The cached :class:`_Launch` for these operands' dtypes and layouts (built on a miss)."""
    key = (id(a), out.dtype, out.shape, out.strides) + tuple(
        (x.dtype, x.shape, x.strides) for x in inputs)
    ln = _LAUNCHES.get(key)
    if ln is None or ln.attrs is not a:
        ln = _new_launch(a, inputs, out)
        if len(_LAUNCHES) >= 1024:
            _LAUNCHES.clear()
        _LAUNCHES[key] = ln
    return ln


def _new_launch(a: FusedAttrs, inputs: Sequence[np.ndarray], out: np.ndarray) -> _Launch:
    """A launch for these operands: the last one of the same body and dtypes laid out at their
    sizes (a new batch size: the same kernel) when it can be, else built."""
    dtypes = (out.dtype,) + tuple([x.dtype for x in inputs])
    last = _BY_BODY.peek(a.body, dtypes)
    ln = last.resized(a, inputs, out) if last is not None else None
    if ln is None:
        ln = _Launch(a, Hoisted(a, inputs), inputs, out)
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
    ln = _launch(a, inputs, out)
    if ln.empty:
        return out
    if ln.fused:
        arrays = [inputs[k] for k in ln.small] + [inputs[k] for k in ln.big] + [out]
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
        ln = _Launch(a, h, inputs, out, use_prologue=False)
    read = [address(inputs[k]) for k in ln.big] + [address(v) for v in hv]
    o = address(out)
    _check_overlap(ln, read, o)
    ln.fn(ln.ndim, ln.shape, ln.ptrs(*read, o), ln.strides, render.BLOCK, team.runner())
    return out


def _check_overlap(ln: _Launch, read: Sequence[int], o: int) -> None:
    """Unsupported when the output at address ``o`` partly overlaps an operand the kernel reads
    (at addresses ``read``); writing over an input of exactly the output's layout is fine."""
    o_lo, o_hi = o + ln.out_extent[0], o + ln.out_extent[1]
    for x, (lo, hi), same in zip(read, ln.extents, ln.same):
        if x + lo < o_hi and o_lo < x + hi and not (same and x == o):
            raise Unsupported("the output partly overlaps an input")


def _fused_pointers(ln: _Launch, arrays: Sequence[np.ndarray]) -> Any:
    """The pointer array of a fused call (per-channel inputs, big inputs, output), checked for
    overlap and remembered on ``ln`` with weak references to ``arrays``."""
    addrs = [address(x) for x in arrays]
    nb = len(ln.big)
    _check_overlap(ln, addrs[-1 - nb:-1], addrs[-1])
    ptrs = ln.ptrs(*addrs)
    try:
        ln.last = (tuple(weakref.ref(x) for x in arrays), ptrs)
    except TypeError:  # an array type without weak references: nothing remembered
        ln.last = ()
    return ptrs


def _lower_fused(exe: Any, node: Any, args: list) -> list:
    """FusedElementwise as a compiled C kernel; unsupported bodies (and any smaller than
    ``min_fused_elements``) run on numpy."""
    a: FusedAttrs = node.attrs
    backend: NativeBackend = exe.backend
    if math.prod(a.shape) < backend.min_fused_elements:
        backend.small += 1
        return node.opdef.compute(args, a)
    ins, dst = (args[:-1], args[-1]) if a.store else (args, None)
    try:
        return [run_fused_native(a, ins, dst)]
    except Unsupported as e:
        backend.fallbacks[str(e)] += 1
        return node.opdef.compute(args, a)


def _lower_reduce(exe: Any, node: Any, args: list) -> list:
    """FusedReduce with its reductions in C; bodies the C pass does not cover run on numpy.
    Below ``min_elements`` the whole body is one serial C call (:mod:`.small`) when the
    prologue renderer covers it, else numpy."""
    backend: NativeBackend = exe.backend
    if sum(np.asarray(x).size for x in args) < backend.min_elements:
        try:
            return run_small_reduce_native(node.attrs, args)
        except Unsupported:
            backend.small += 1
            return node.opdef.compute(args, node.attrs)
    try:
        return run_fused_reduce_native(node.attrs, args)
    except Unsupported as e:
        backend.fallbacks[str(e)] += 1
        return node.opdef.compute(args, node.attrs)


NATIVE_LOWERINGS: LoweringTable = NUMPY_LOWERINGS.extend({"FusedElementwise": _lower_fused,
                                                          "FusedReduce": _lower_reduce})


class NativeExecutable(NumpyExecutable):
    """A graph compiled for the native backend. When every node is a FusedElementwise that reads
    the caller's tensors and stores into one of them (BatchNormElemt and BatchNormElemtBackward at
    level 2), the first run prepares each kernel's launch from the bound tensors' views and
    every run launches the kernels straight from the bound tensors' addresses: the operand
    layouts are fixed for a compiled program, so no numpy views and no per-call layout lookup.
    Anything else — a kernel without a C prologue, a read-only output, an output that partly
    overlaps an input, a kernel below ``min_fused_elements``, a run with a ``profile`` hook —
    takes the node-by-node path. A graph that is one FusedReduce whose results land in the
    caller's tensors (BatchNormStats & co.) runs as :class:`.direct_reduce.DirectReduce`: the
    node's computation on the bound tensors and a copy per result, without the interpreter."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.all_direct = self._all_direct()
        self.copies = None if self.all_direct else self._reduce_copies()
        self._start()

    def resized(self, graph: Graph, memory_plan: MemoryPlan) -> "NativeExecutable | None":
        """See :meth:`opgraph.core.backend.Executable.resized`: which path the graph takes is
        shared too; launches are laid out on the first run, as for a compiled one."""
        if type(self) is not NativeExecutable:
            return None
        made = self._resized(graph, memory_plan)
        made.all_direct, made.copies = self.all_direct, self.copies
        made._start()
        made.seed = self
        return made

    def _start(self) -> None:
        """The state of the direct paths before the first run."""
        self.direct: Optional[list[Any]] = [node for node, _ in self.steps] if self.all_direct else None
        self.launches: Optional[list[tuple[_Launch, tuple[str, ...]]]] = None
        self.pointers: list[tuple[list[int], Any]] = []  # per node: the last addresses, pointers
        self.reduce = self._direct_reduce() if self.copies is not None else None
        self.direct_reduce: Optional[DirectReduce] = None  # prepared on the first run
        self.seed: Optional[NativeExecutable] = None  # what resized() made this from

    def _reduce_copies(self) -> Optional[list[tuple[str, str]]]:
        """When the graph is one FusedReduce over bound tensors followed only by redirected
        copies of its results into bound tensors, one per graph output: ``(output, the bound
        tensor it is copied into)`` per output; else None."""
        nodes = [node for node, _ in self.steps]
        bound = set(self.input_names)
        if not nodes or nodes[0].op != "FusedReduce" or any(v.name not in bound
                                                            for v in nodes[0].inputs):
            return None
        results = {v.name for v in nodes[0].outputs}
        copies = {}
        for node in nodes[1:]:
            if (node.op != "ViewCopy" or not node.opdef.redirects(node)
                    or node.inputs[0].name not in results):
                return None
            copies[node.outputs[0].name] = node.inputs[node.opdef.written(node)[0]].name
        if any(v.name not in copies for v in self.graph.outputs):
            return None
        return [(v.name, copies[v.name]) for v in self.graph.outputs]

    def _direct_reduce(self) -> Optional[tuple]:
        """``(node, dests, outputs)`` for :class:`.direct_reduce.DirectReduce` when, besides
        :meth:`_reduce_copies`, the memory plan places every result of the reduction in a bound
        tensor; else None."""
        node = self.steps[0][0]
        slots = [self.slots.get(v.name) for v in node.outputs]
        if self.copies is None or any(slot is None or slot.user is None for slot in slots):
            return None
        return node, [(slot.user, slot.shape) for slot in slots], self.copies

    def _all_direct(self) -> bool:
        """Whether every node is a FusedElementwise that reads bound tensors and stores into
        one of them, the graph's outputs being the nodes' results in order."""
        bound = set(self.input_names)
        nodes = [node for node, _ in self.steps]
        if not nodes or any(n.op != "FusedElementwise" or not n.attrs.store
                            or any(v.name not in bound for v in n.inputs) for n in nodes):
            return False
        return [v.name for v in self.graph.outputs] == [n.outputs[0].name for n in nodes]

    def run(self, bindings: Mapping[str, Tensor], workspace: Any = None) -> dict[str, np.ndarray]:
        if self.profile is None:  # (profiled: node by node)
            if self.direct is not None and self.launches is None:  # prepared once, on first run
                self.launches = self._prepared(bindings)
                self.pointers = [([], None)] * len(self.launches or ())
                self.direct = None if self.launches is None else self.direct
            if self.launches is not None:
                out = self._run_direct(bindings)
                if out is not None:
                    return out
            if self.reduce is not None:
                if self.direct_reduce is None:  # prepared once, on first run
                    self.direct_reduce = DirectReduce.prepare(
                        self.reduce[0], bindings, self.backend.min_elements, *self.reduce[1:])
                    self.reduce = None if self.direct_reduce is None else self.reduce
                if self.direct_reduce is not None:
                    out = self.direct_reduce.run(bindings, self.backend.min_elements)
                    if out is not None:
                        return out
        return super().run(bindings, workspace)

    def _prepared(self, bindings: Mapping[str, Tensor]) -> Optional[list]:
        """Each direct node's launch, laid out from the bound tensors' views, and the names of
        the bindings whose addresses its kernel takes, in order (the output last); None if one
        has no C prologue or a read-only output."""
        seeded = self.seed.launches if self.seed is not None else None
        launches = []
        for i, node in enumerate(self.direct or ()):
            a: FusedAttrs = node.attrs
            names = self.program[i][2]
            views = [bindings[n].view() for n in names]
            if not views[-1].flags.writeable:
                return None
            if seeded:  # the launch its seed prepared, at these sizes (its operands in order)
                ln = seeded[i][0].resized(a, views[:-1], views[-1])
                if ln is not None:
                    launches.append((ln, seeded[i][1]))
                    continue
            try:  # an executable prepares once: no need for the launch cache
                ln = _new_launch(a, views[:-1], views[-1])
            except Unsupported:
                return None
            if not ln.fused:
                return None
            order = list(ln.small) + list(ln.big) + [len(names) - 1]
            launches.append((ln, tuple(names[k] for k in order)))
        return launches

    def _run_direct(self, bindings: Mapping[str, Tensor]) -> Optional[dict[str, np.ndarray]]:
        """The direct launches, or None (nothing run) when one of them cannot be taken."""
        assert self.launches is not None
        smallest = self.backend.min_fused_elements
        calls = []
        for i, (ln, operands) in enumerate(self.launches):  # every check before any launch
            if smallest and math.prod(ln.attrs.shape) < smallest:
                return None
            if ln.empty:
                continue
            addrs = [bindings[n].data_address for n in operands]
            last = self.pointers[i]
            if last[0] == addrs:
                calls.append((ln, last[1]))
                continue
            try:
                _check_overlap(ln, addrs[len(ln.small):-1], addrs[-1])
            except Unsupported:
                return None
            ptrs = ln.ptrs(*addrs)
            self.pointers[i] = (addrs, ptrs)
            calls.append((ln, ptrs))
        for ln, ptrs in calls:
            if ln.fn(ln.ndim, ln.shape, ln.strides, render.BLOCK, team.runner(), ln.tab, ptrs):
                raise MemoryError("native kernel: cannot allocate the per-channel scratch")
        return {v.name: bindings[operands[-1]].view()
                for v, (_, operands) in zip(self.graph.outputs, self.launches)}


class NativeBackend(NumpyBackend):
    """NumpyBackend with FusedElementwise lowered to compiled C; ``fallbacks`` counts the fused
    nodes that ran on numpy, by reason. FusedReduce kernels smaller than ``min_elements`` run as
    one serial C call, or on numpy when the prologue renderer does not cover their body; those
    and FusedElementwise kernels smaller than ``min_fused_elements`` run on numpy (the same
    bits) and are counted in ``small``. A FusedElementwise call is cheaper in C at any size (its
    launch is cached and its per-channel part runs in C too), hence 0."""

    name = "native"
    min_elements = 4096
    min_fused_elements = 0
    lowerings = NATIVE_LOWERINGS

    def compile(self, graph: Graph, memory_plan: MemoryPlan, platform: Platform) -> NativeExecutable:
        return NativeExecutable(self, graph, memory_plan, platform, self.lowerings)

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


__all__ = ["DirectReduce", "NativeBackend", "NativeBuildError", "Unsupported", "available",
           "availability", "collapse", "emit_c", "run_fused_native"]
