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

import math
from collections import Counter
from typing import Any, Mapping, Optional

import numpy as np

from l0ops.interpreter import Hoisted
from l0ops.primitives import FusedAttrs
from opgraph.core.backend import Addressed, LoweringTable, data_addresses
from opgraph.core.ir import Graph
from opgraph.core.memory import MemoryPlan
from opgraph.core.platform import Platform
from opgraph.core.quiet import restore, silence
from opgraph.core.tensor import Tensor
from ..numpy_backend import NUMPY_LOWERINGS, NumpyBackend, NumpyExecutable, takes_out
from . import render, team
from .bound import Bound, repeats
from .build import NativeBuildError, availability
from .direct_reduce import DirectReduce
from .gather_fused import DirectGather, run_gather_fused
from .launch import Launch, collapse, fused_operands, fused_pointers, new_launch, run_fused_native
from .reduce_run import run_fused_reduce_native
from .small import run_small_reduce_native, serial_below, serial_kind
from .unsupported import Unsupported

def available() -> bool:
    """True when a C compiler is on PATH (the native backend can run here)."""
    return availability()[0]


@takes_out
def _lower_fused(exe: Any, node: Any, args: list, out: Optional[np.ndarray] = None) -> list:
    """FusedElementwise as a compiled C kernel (into ``out`` when given); unsupported bodies
    (and any smaller than ``min_fused_elements``) run on numpy."""
    a: FusedAttrs = node.attrs
    backend: NativeBackend = exe.backend
    if math.prod(a.shape) < backend.min_fused_elements:
        backend.small += 1
        return node.opdef.compute(args, a)
    ins, dst = (args[:-1], args[-1]) if a.store else (args, out)
    try:
        return [run_fused_native(a, ins, dst)]
    except Unsupported as e:
        backend.fallbacks[str(e)] += 1
        return node.opdef.compute(args, a)


def _lower_reduce(exe: Any, node: Any, args: list) -> list:
    """FusedReduce with its reductions in C; bodies the C pass does not cover run on numpy.
    Below the backend's threshold (:func:`.small.serial_below`) the whole body is one serial C
    call (:mod:`.small`) when the prologue renderer covers it, else numpy."""
    backend: NativeBackend = exe.backend
    if sum(np.asarray(x).size for x in args) < serial_below(serial_kind(node.attrs), *backend.limits()):
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


def _lower_gather_fused(exe: Any, node: Any, args: list) -> list:
    """The 950's SyncBatchNormGatherStatsFused as one serial C call (:mod:`.gather_fused`);
    operands it does not cover run on numpy."""
    try:
        return run_gather_fused(node.attrs, args)
    except Unsupported as e:
        exe.backend.fallbacks[str(e)] += 1
        return node.opdef.compute(args, node.attrs)


_NATIVE = (_lower_fused, _lower_reduce)  # the lowerings whose C calls a Bound prepares itself
NATIVE_LOWERINGS: LoweringTable = NUMPY_LOWERINGS.extend({
    "FusedElementwise": _lower_fused, "FusedReduce": _lower_reduce,
    "SyncBatchNormGatherStatsFused": _lower_gather_fused})


def _reshaped_view(x: np.ndarray, shape: tuple[int, ...]) -> Optional[np.ndarray]:
    """``x`` with ``shape``, sharing its memory and its first element's address; None when numpy
    would have to copy (a reshape the layout does not allow)."""
    if x.shape == shape:
        return x
    r = x.reshape(shape)
    same = x.size == 0 or r.__array_interface__["data"][0] == x.__array_interface__["data"][0]
    return r if same and np.may_share_memory(r, x) else None


# views that only reshape: the same elements in row-major order, so an operand seen through a
# chain of them lives at its bound tensor's address with the view's shape
RESHAPES = frozenset({"Reshape", "ReFormat", "UnsqueezeNd", "SqueezeNd"})


class NativeExecutable(NumpyExecutable):
    """A graph compiled for the native backend. When every kernel is a FusedElementwise that
    reads the caller's tensors and writes into one of them (BatchNormElemt and
    BatchNormElemtBackward at level 2), the first run prepares each kernel's launch from the
    bound tensors' views and every run launches the kernels straight from the bound tensors'
    addresses: the operand layouts are fixed for a compiled program, so no numpy views and no
    per-call layout lookup. A kernel may read a tensor through reshapes (:data:`RESHAPES`) and
    write a result the memory plan places in a tensor its redirected copy goes to (the 910B's
    BatchNormElemt on a 2-d or 3-d input views it as 4-d).
    Anything else — a kernel without a C prologue, a read-only output, an output that partly
    overlaps an input, a kernel below ``min_fused_elements``, a run with a ``profile`` hook —
    takes the node-by-node path. A graph that is one FusedReduce whose results land in the
    caller's tensors (BatchNormStats & co.) runs as :class:`.direct_reduce.DirectReduce`: the
    node's computation on the bound tensors and a copy per result, without the interpreter; one
    that is the 950's SyncBatchNormGatherStatsFused on them, its results placed in them
    (BatchNormGatherStatsWithCounts), as :class:`.gather_fused.DirectGather`: its C call on
    their addresses."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        plan = self._direct_plan()
        self.all_direct = plan is not None
        self.copies = None if self.all_direct else self._reduce_copies()
        self._start(plan)

    def resized(self, graph: Graph, memory_plan: MemoryPlan) -> "NativeExecutable | None":
        """See :meth:`opgraph.core.backend.Executable.resized`: which path the graph takes is
        shared too; launches are laid out on the first run, as for a compiled one."""
        if type(self) is not NativeExecutable:
            return None
        made = self._resized(graph, memory_plan)
        made.all_direct, made.copies = self.all_direct, self.copies
        made._start(made._direct_plan() if made.all_direct else None)
        made.seed = self
        return made

    def _start(self, plan: Optional[tuple[list[tuple], dict[str, tuple]]]) -> None:
        """The state of the direct paths before the first run (``plan``: :meth:`_direct_plan`'s)."""
        # per kernel: (node, the bound tensor of each operand, inputs then output; their shapes)
        self.direct: Optional[list[tuple]] = plan[0] if plan is not None else None
        self.direct_outputs: dict[str, tuple] = plan[1] if plan is not None else {}
        self.launches: Optional[list[tuple[Launch, tuple[str, ...]]]] = None
        self.pointers: list[tuple[list[int], Any]] = []  # per node: the last addresses, pointers
        self.reduce = self._direct_reduce() if self.copies is not None else None
        self.direct_reduce: Optional[DirectReduce] = None  # prepared on the first run
        # the 950's gather on the caller's tensors: None when not, prepared (fn set) on first run
        self.gather = None if plan is not None or self.copies is not None else self._direct_gather()
        self.seed: Optional[NativeExecutable] = None  # what resized() made this from
        self.bound: Optional[Bound] = None  # run_repeatable's steps bound to its tensors
        self.last_key: Optional[tuple] = None

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

    @property
    def direct_without_workspace(self) -> bool:  # type: ignore[override]
        """The 950's gather runs direct without the arena: it casts its counts itself."""
        return self.gather is not None

    def _direct_gather(self) -> Optional[DirectGather]:
        """When the graph is reshapes of bound tensors, one SyncBatchNormGatherStatsFused on
        them whose results the memory plan places in bound tensors, and per result a reshape
        and a redirected copy into that tensor (a graph output): its :class:`DirectGather`."""
        home: dict[str, str] = {n: n for n in self.input_names}  # value -> its bound tensor
        node, placed, outputs = None, {}, []  # placed: the gather's result -> its bound tensor
        cast = None  # a Cast of the counts (a bound tensor) before the gather
        for n, _ in self.steps:
            ins = n.inputs
            lies_in = placed if node else home  # before the gather: its operands; after: results
            if n.op in RESHAPES and ins[0].name in lies_in:
                lies_in[n.outputs[0].name] = lies_in[ins[0].name]
            elif n.op == "Cast" and node is None and cast is None and ins[0].name in home:
                cast = n
                home[n.outputs[0].name] = home[ins[0].name]
            elif (n.op == "SyncBatchNormGatherStatsFused" and node is None
                    and all(v.name in home for v in ins)
                    and (cast is None or ins[2] is cast.outputs[0])):
                slots = [self.slots.get(v.name) for v in n.outputs]
                if any(s is None or s.user not in self.input_names for s in slots):
                    return None
                node, placed = n, {v.name: s.user for v, s in zip(n.outputs, slots)}
            elif (node is not None and n.op == "ViewCopy" and n.opdef.redirects(n)
                    and placed.get(ins[0].name) == ins[n.opdef.written(n)[0]].name):
                outputs.append((n.outputs[0].name, placed[ins[0].name]))
            else:
                return None
        if node is None or sorted(name for name, _ in outputs) != sorted(v.name for v in self.graph.outputs):
            return None
        return DirectGather(node, [home[v.name] for v in node.inputs],
                            [placed[v.name] for v in node.outputs], outputs, cast)

    def _direct_plan(self) -> Optional[tuple[list[tuple], dict[str, tuple]]]:
        """When every node is a FusedElementwise that reads bound tensors (or reshapes of them)
        and stores into one, or writes a result placed in a bound tensor, or a reshape, or a
        redirected copy of such a result into its tensor: per kernel ``(node, the bound tensor
        of each operand — inputs, then the output —, their shapes)``, and the bound tensor each
        graph output is in, with its shape. Else None."""
        bound = set(self.input_names)
        home: dict[str, str] = {n: n for n in bound}  # value -> the bound tensor it lives in
        kernels, made = [], set()
        for node, _ in self.steps:
            ins = node.inputs
            if node.op == "FusedElementwise" and all(v.name in home for v in ins):
                names = [home[v.name] for v in ins]
                shapes = [v.type.shape for v in ins]
                out = node.outputs[0]
                if not node.attrs.store:  # its result placed in a bound tensor, or not direct
                    slot = self.slots.get(out.name)
                    if slot is None or slot.user not in bound:
                        return None
                    names.append(slot.user)
                    shapes.append(slot.shape)
                home[out.name] = names[-1]
                made.add(out.name)
                kernels.append((node, tuple(names), tuple(shapes)))
            elif node.op in RESHAPES and ins[0].name in home:
                home[node.outputs[0].name] = home[ins[0].name]
                made.update(v.name for v in node.outputs if ins[0].name in made)
            elif (node.op == "ViewCopy" and node.opdef.redirects(node) and ins[0].name in made
                    and home[ins[0].name] == home.get(ins[1].name)):
                home[node.outputs[0].name] = home[ins[1].name]
                made.add(node.outputs[0].name)
            else:
                return None
        if not kernels or any(v.name not in made for v in self.graph.outputs):
            return None
        return kernels, {v.name: (home[v.name], v.type.shape) for v in self.graph.outputs}

    def run(self, bindings: Mapping[str, Tensor], workspace: Any = None) -> dict[str, np.ndarray]:
        """See :meth:`Executable.run`; a layout the executable learnt runs its C kernels directly,
        anything else node by node, each through its lowering (fused kernels in C)."""
        if not self._direct(bindings):
            return super().run(bindings, workspace)
        if self.launches is not None:
            return {name: bindings[where].view().reshape(shape)
                    for name, (where, shape) in self.direct_outputs.items()}
        direct = self.direct_reduce if self.gather is None else self.gather
        assert direct is not None
        return direct.graph_outputs(bindings)

    def run_direct(self, bindings: Mapping[str, Addressed]) -> bool:
        """See :meth:`opgraph.core.backend.Executable.run_direct`: the direct launches or the
        direct reduction (class docstring), else, with no workspace, node by node."""
        return self._direct(bindings) or super().run_direct(bindings)

    def _direct(self, bindings: Mapping[str, Addressed]) -> bool:
        """The direct launches or the direct reduction, prepared on the first run; False
        (nothing run) when the program has neither, they cannot take these tensors, or a
        ``profile`` hook is set."""
        if self.profile is not None:  # (profiled: node by node)
            return False
        if self.direct is not None and self.launches is None:  # prepared once, on first run
            with np.errstate(all="ignore"):  # (its numpy part: per-channel values, constants)
                launches = self._prepared(bindings)
            # the pointer memo before the launches: another thread takes them once they are set
            self.pointers = [([], None)] * len(launches or ())
            self.launches = launches
            self.direct = None if launches is None else self.direct
        if self.launches is not None:
            return self._run_direct(bindings)
        if self.reduce is not None:
            if self.direct_reduce is None:  # prepared once, on first run
                with np.errstate(all="ignore"):
                    self.direct_reduce = DirectReduce.prepare(
                        self.reduce[0], bindings, self.backend.limits(), *self.reduce[1:])
                self.reduce = None if self.direct_reduce is None else self.reduce
            if self.direct_reduce is not None:
                return self.direct_reduce.run(bindings, self.backend.limits())
        gather = self.gather
        if gather is not None:
            if gather.fn is None and not gather.prepare(bindings):  # once, on the first run
                self.gather = None
                return False
            gather.run(bindings)
            return True
        return False

    def run_repeatable(self, bindings: Mapping[str, Tensor], workspace: Any = None) -> dict[str, np.ndarray]:
        """:meth:`run`, for a caller that runs the program again and again in the same workspace:
        the second run on tensors of the same layouts as the first's (the same ones or new ones,
        :func:`.bound.repeats`) binds the steps to them (:class:`.bound.Bound`); later runs with
        the same ones run the bound steps, and a run with other tensors of the same layouts
        rebinds only the nodes that touch the ones that changed, and runs bound."""
        token = silence()  # binding evaluates numpy too (per-channel values)
        try:
            bound, same = self.bound, False
            if self.profile is None and bound is not None:
                same = bound.matches(bindings, workspace)
                if not same and bound.rebinds(bindings, workspace):
                    bound, same = Bound(self, bindings, workspace, _NATIVE, like=bound), True
                    self.bound = bound
                if same:
                    out = bound.run()
                    if out is not None:
                        return out
            out = self.run(bindings, workspace)  # checks the bindings and the workspace, as always
            if self.profile is None and not same:
                key = (workspace, *[bindings[n] for n in self.input_names])
                last, self.last_key = self.last_key, key
                if repeats(last, key):
                    self.bound = Bound(self, bindings, workspace, _NATIVE)
            return out
        finally:
            restore(token)

    def release(self, bindings: Mapping[str, Tensor]) -> None:
        """Forget the bound steps and the last key when they hold ``bindings``' tensors."""
        held = {id(t) for t in bindings.values()}
        for key in (self.last_key, self.bound.key if self.bound is not None else None):
            if key is not None and any(id(t) in held for t in key[1:]):
                self.bound = self.last_key = None

    def _prepared(self, bindings: Mapping[str, Addressed]) -> Optional[list]:
        """Each direct node's launch, laid out from the bound tensors' views, and the names of
        the bindings whose addresses its kernel takes, in order (the output last); None if one
        has no C prologue or a read-only output."""
        seeded = self.seed.launches if self.seed is not None else None
        launches = []
        for i, (node, names, shapes) in enumerate(self.direct or ()):
            a: FusedAttrs = node.attrs
            views = [_reshaped_view(bindings[n].view(), shape) for n, shape in zip(names, shapes)]
            if any(v is None for v in views) or not views[-1].flags.writeable:
                return None
            if seeded:  # the launch its seed prepared, at these sizes (its operands in order)
                ln = seeded[i][0].resized(a, views[:-1], views[-1])
                if ln is not None:
                    launches.append((ln, seeded[i][1]))
                    continue
            try:  # an executable prepares once: no need for the launch cache
                ln = new_launch(a, views[:-1], views[-1])
            except Unsupported:
                return None
            if not ln.fused:
                return None
            launches.append((ln, tuple(fused_operands(ln, names[:-1], names[-1]))))
        return launches

    def _run_direct(self, bindings: Mapping[str, Addressed]) -> bool:
        """The direct launches; False (nothing run) when one of them cannot be taken."""
        assert self.launches is not None
        smallest = self.backend.min_fused_elements
        calls = []
        for i, (ln, operands) in enumerate(self.launches):  # every check before any launch
            if smallest and math.prod(ln.attrs.shape) < smallest:
                return False
            if ln.empty:
                continue
            addrs = data_addresses(bindings, operands)
            last = self.pointers[i]
            if last[0] == addrs:
                calls.append((ln, last[1]))
                continue
            try:
                ptrs = fused_pointers(ln, addrs)
            except Unsupported:
                return False
            self.pointers[i] = (addrs, ptrs)
            calls.append((ln, ptrs))
        for ln, ptrs in calls:
            if ln.fn(ln.ndim, ln.shape, ln.strides, render.BLOCK, team.runner(), ln.tab, ptrs):
                raise MemoryError("native kernel: cannot allocate the per-channel scratch")
        return True


class NativeBackend(NumpyBackend):
    """NumpyBackend with FusedElementwise lowered to compiled C; ``fallbacks`` counts the fused
    nodes that ran on numpy, by reason. FusedReduce kernels smaller than ``min_elements`` (or,
    where each sum adds at most 64 elements, ``min_short_elements`` or ``min_stepped_elements``:
    :func:`.small.serial_kind`) run as one serial C call,
    or on numpy when the prologue renderer does not cover their body; those and
    FusedElementwise kernels smaller than ``min_fused_elements`` run on numpy (the same bits)
    and are counted in ``small``. A FusedElementwise call is cheaper in C at any size (its
    launch is cached and its per-channel part runs in C too), hence 0."""

    name = "native"
    min_elements = 4096
    # a body whose sums each add at most 64 elements (a BatchNorm1d of up to 64 rows, a sum
    # over the ranks) runs as the serial call up to here where the passes would run in C alone
    # (BatchNormStats on [8, 2048] 23 against 34 µs as the passes, even on [16, 4096], the
    # passes ahead on [32, 4096]: 76 against 113 µs) ...
    min_short_elements = 1 << 16
    # ... and up to here where they would stop for numpy instructions between them
    # (BatchNormGatherStatsWithCounts, 2048 channels over 4-64 ranks: 43-283 µs serial, 128-645
    # µs as the passes; HISTORY); the serial call's scratch, ~6 floats per input element
    # there, stays under ~25 MB
    min_stepped_elements = 1 << 20
    min_fused_elements = 0
    lowerings = NATIVE_LOWERINGS

    def compile(self, graph: Graph, memory_plan: MemoryPlan, platform: Platform) -> NativeExecutable:
        """See :meth:`Backend.compile`; kernels are compiled (or found in the cache) at a node's
        first run."""
        return NativeExecutable(self, graph, memory_plan, platform, self.lowerings)

    def __init__(self) -> None:
        self.fallbacks: Counter[str] = Counter()
        self.small = 0

    def availability(self) -> tuple[bool, str]:
        """See :meth:`Backend.availability`; whether a C compiler is on PATH."""
        return availability()

    def limits(self) -> tuple[int, int, int]:
        """``(min_elements, min_short_elements, min_stepped_elements)``: the FusedReduce
        thresholds (:func:`.small.serial_below`), read per run so that a change applies at once."""
        return self.min_elements, self.min_short_elements, self.min_stepped_elements


def emit_c(node: Any) -> str:
    """C source of a FusedElementwise node's kernel (per-channel inputs filled with ones: the
    source depends only on the node's types). Raises :class:`Unsupported`."""
    dummies = [np.broadcast_to(np.ones((), v.dtype.np), v.type.shape) for v in node.inputs]
    a: FusedAttrs = node.attrs
    return render.render(render.plan(a, Hoisted(a, dummies[:-1] if a.store else dummies)))


__all__ = ["DirectReduce", "NativeBackend", "NativeBuildError", "Unsupported", "available",
           "availability", "collapse", "emit_c", "run_fused_native"]
