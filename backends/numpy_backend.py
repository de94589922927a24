"""The numpy backend: the bit-faithful CPU golden reference. ``compile`` resolves each node's
lowering (the op's own numpy semantics unless the backend's table overrides it), the slot of
every intermediate in the workspace arena the memory plan lays out, and the last use of every
value; ``run`` interprets the graph node by node, storing each intermediate in its arena slot.

    >>> import numpy as np, opgraph, l0ops
    >>> from opgraph.core.ir import Graph, TensorType
    >>> g = Graph(); x = g.add_input("x", TensorType((2,), opgraph.DataType.FLOAT))
    >>> y = g.add_input("y", TensorType((2,), opgraph.DataType.FLOAT16))
    >>> c = g.add_node("Cast", [x], to=opgraph.DataType.FLOAT16).outputs[0]
    >>> g.outputs = [g.add_node("ViewCopy", [c, y]).outputs[0]]
    >>> out = np.zeros(2, np.float16)
    >>> _ = NumpyBackend().run(g, {"x": opgraph.tensor(np.float32([1.5, 2])), "y": opgraph.tensor(out)})
    >>> out.tolist()
    [1.5, 2.0]
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping, Optional

import numpy as np

from l0ops.fused import stores_in_place
from l0ops.interpreter import program as fused_program, run_fused
from opgraph.core.backend import Addressed, Backend, Executable, LoweringTable
from opgraph.core.ir import Graph, Node
from opgraph.core.memory import MemoryPlan
from opgraph.core.platform import Platform
from opgraph.core.quiet import restore, silence
from opgraph.core.tensor import Tensor

# lowering: fn(executable, node, input arrays) -> output arrays
NumpyLowering = Callable[[Any, Node, list], list]


def _op_semantics(op: str) -> NumpyLowering:
    return lambda exe, node, args: node.opdef.compute(args, node.attrs)


def _fused(exe: Any, node: Node, args: list, out: Optional[np.ndarray] = None) -> list:
    """FusedElementwise: its semantics; with ``out`` (see :func:`takes_out`), computed there."""
    if out is None:
        return node.opdef.compute(args, node.attrs)
    return [run_fused(node.attrs, args, out=out)]


def takes_out(fn: Callable) -> Callable:
    """Mark lowering ``fn`` as taking ``out=``: when its node's single output is placed in a user
    tensor (and the node does not store by itself), the executable passes that tensor (viewed
    with the output's shape, contiguous) and the lowering computes into it — no temporary, no
    copy. Returns ``fn``.

        >>> @takes_out
        ... def add_one(exe, node, args, out=None):
        ...     return [np.add(args[0], 1, out=out)]
        >>> add_one.takes_out
        True
    """
    fn.takes_out = True  # type: ignore[attr-defined]
    return fn


def _reshaped(exe: Any, node: Node, args: list) -> list:
    """UnsqueezeNd, SqueezeNd, Reshape: the input under the output's recorded shape (the ops'
    own numpy semantics, without working the shape out again from the attributes per run)."""
    return [args[0].reshape(node.outputs[0].shape)]


NUMPY_LOWERINGS = LoweringTable({"FusedElementwise": takes_out(_fused), "UnsqueezeNd": _reshaped,
                                 "SqueezeNd": _reshaped, "Reshape": _reshaped}, fallback=_op_semantics)


def last_uses(graph: Graph) -> dict[int, list[str]]:
    """``{node index: names of values whose last use is that node}`` (graph outputs excluded)."""
    last: dict[str, int] = {}
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            last[v.name] = i
        for v in n.outputs:
            last.setdefault(v.name, i)
    keep = {v.name for v in graph.outputs}
    out: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in keep:
            out.setdefault(i, []).append(name)
    return out


def _fused_store(exe: "NumpyExecutable") -> Optional[tuple[Node, tuple[str, ...], str]]:
    """``(node, operand names, result name)`` when the graph is one FusedElementwise, run by
    numpy semantics, that stores into a graph input (a level-2 element-wise op_api) and needs no
    workspace: :meth:`NumpyExecutable.run` then runs that node's lowering on the bound tensors'
    views with no environment."""
    if len(exe.program) != 1 or exe.plan.size:
        return None
    node, lower, inputs, outputs, _ = exe.program[0]
    if lower is not _fused or not getattr(node.attrs, "store", False) or outputs[0][1] is not None:
        return None
    if any(name not in exe.input_names for name in inputs) or \
            [v.name for v in exe.graph.outputs] != [outputs[0][0]]:
        return None
    return node, inputs, outputs[0][0]


class Slot:
    """Where a node output lives: ``offset`` bytes into the arena, or a user tensor (``user``)."""

    __slots__ = ("offset", "dtype", "shape", "user", "size")

    def __init__(self, offset: int, dtype: np.dtype, shape: tuple[int, ...], user: Optional[str]):
        self.offset, self.dtype, self.shape, self.user = offset, dtype, shape, user
        self.size = math.prod(shape)  # elements, counted once (np.prod costs µs at every run)


def _slots(graph: Graph, plan: MemoryPlan) -> dict[str, Slot]:
    """The slot of every node output the memory plan places (in the arena or a user tensor)."""
    slots: dict[str, Slot] = {}
    for node in graph.nodes:
        for v in node.outputs:
            if v.name in plan.offsets:
                slots[v.name] = Slot(plan.offsets[v.name][0], v.dtype.np, v.shape, None)
            elif v.name in plan.placed_in:
                slots[v.name] = Slot(0, v.dtype.np, v.shape, plan.placed_in[v.name])
    return slots


def _into(steps: list, slots: dict[str, Slot]) -> dict[int, Slot]:
    """Per step index, the user-tensor slot its lowering computes into (see :func:`takes_out`)."""
    return {i: slots[node.outputs[0].name] for i, (node, lower) in enumerate(steps)
            if getattr(lower, "takes_out", False) and len(node.outputs) == 1
            and not getattr(node.attrs, "store", False)
            and getattr(slots.get(node.outputs[0].name), "user", None) is not None}


def _in_place(exe: Any, node: Node, args: list) -> list:
    """A redirected copy (``opdef.redirects``): the memory plan placed the copied value in the
    destination user tensor, where its producer wrote it, so nothing is copied."""
    return [args[node.opdef.written(node)[0]]]


# profile hook: fn(node, start, stop) with time.perf_counter() seconds around the node's step
Profile = Callable[[Node, float, float], None]


class NumpyExecutable(Executable):
    """A graph compiled for numpy-semantics execution (also the base of native and ascend-sim).

    ``profile``: None (the default, no cost), or a callable that :meth:`run` calls after every
    node with ``(node, start, stop)`` in ``time.perf_counter()`` seconds — how ``opgraph run
    --trace-json`` and ``opgraph view --run`` time each node."""

    profile: Optional[Profile] = None

    def __init__(self, backend: Any, graph: Graph, plan: MemoryPlan, platform: Platform,
                 lowerings: LoweringTable):
        self.backend, self.graph, self.plan, self.platform = backend, graph, plan, platform
        self.steps = [(node, _in_place if node.opdef.redirects(node) else lowerings.lower(node))
                      for node in graph.nodes]
        self.slots = _slots(graph, plan)
        frees = last_uses(graph)
        # per step: node, lowering, input names, (output name, slot or None)s, names dead after it
        self.program = [(node, lower, tuple(v.name for v in node.inputs),
                         tuple((v.name, self.slots.get(v.name)) for v in node.outputs),
                         tuple(frees.get(i, ())))
                        for i, (node, lower) in enumerate(self.steps)]
        self.input_names = tuple(v.name for v in graph.inputs)
        self.into = _into(self.steps, self.slots)
        self.fused_store = _fused_store(self)
        self.store_program: Any = None  # see _run_store

    def resized(self, graph: Graph, memory_plan: MemoryPlan) -> "NumpyExecutable | None":
        """See :meth:`opgraph.core.backend.Executable.resized` (subclasses with state of their
        own: None unless they override it)."""
        return self._resized(graph, memory_plan) if type(self) is NumpyExecutable else None

    def _resized(self, graph: Graph, plan: MemoryPlan) -> Any:
        """A new executable of this type for ``graph`` (this one's at other sizes): the
        lowerings, names and frees shared, the slots made from ``graph``'s types and ``plan``."""
        made = object.__new__(type(self))
        made.backend, made.graph, made.plan, made.platform = self.backend, graph, plan, self.platform
        made.steps = [(node, lower) for node, (_, lower) in zip(graph.nodes, self.steps)]
        made.slots = slots = _slots(graph, plan)
        made.program = [(node, lower, names, tuple([(name, slots.get(name)) for name, _ in outs]), dead)
                        for node, (_, lower, names, outs, dead) in zip(graph.nodes, self.program)]
        made.input_names = self.input_names
        made.into = _into(made.steps, slots) if self.into else {}
        made.fused_store = _fused_store(made)
        made.store_program = None
        return made

    def _place(self, slot: Slot, value: np.ndarray, arena: Optional[np.ndarray],
               bindings: Mapping[str, Tensor]) -> np.ndarray:
        if slot.user is not None:  # a contiguous user tensor, viewed with the value's shape
            dst = bindings[slot.user].view().reshape(slot.shape)
        elif slot.size == 0:  # an empty value: no bytes of the workspace (which may be none)
            dst = np.empty(slot.shape, slot.dtype)
        else:
            if arena is None:
                raise ValueError("the graph needs a workspace but none was given")
            dst = np.frombuffer(arena, slot.dtype, slot.size, slot.offset).reshape(slot.shape)
        if dst is not value:
            np.copyto(dst, value)
        return dst

    quiet = True  # run() keeps numpy's floating-point warnings off: the NPU does not warn

    def run(self, bindings: Mapping[str, Tensor], workspace: Any = None) -> dict[str, np.ndarray]:
        """Run the graph; returns its outputs by value name."""
        store = self.fused_store
        if store is not None and self.profile is None:  # one fused kernel storing into a tensor
            node, names, result = store
            try:
                args = [bindings[name].view() for name in names]
            except KeyError:  # run_nodes names the unbound input
                args = None
        else:
            args = None
        token = silence()  # (np.errstate's effect at a third of its cost: opgraph.core.quiet)
        try:
            if args is not None:
                return {result: self._run_store(node, args)}
            return self.run_nodes(bindings, workspace)
        finally:
            restore(token)

    def _run_store(self, node: Node, args: list) -> np.ndarray:
        """The fused store's kernel on its operands' views ``args`` (the destination last), as
        its lowering runs it. The interpreter program is looked up at the first run, from the
        views, which have the graph inputs' types on every run; while it runs straight through
        (a small tensor) and the destination is writable and contiguous, later runs call it
        directly (~7 µs of a cached [1,2,4] call: the lookup's key and three calls' layers)."""
        prog = self.store_program
        if prog is None:
            prog = fused_program(node.attrs, args[:-1])
            self.store_program = prog = prog if prog.straight() else False
        dst = args[-1]
        if prog and stores_in_place(dst):  # as the lowering decides
            prog.run_flat(args[:-1], dst)
            return dst
        return _fused(self, node, args)[0]

    def run_direct(self, bindings: Mapping[str, Addressed]) -> bool:
        """See :meth:`opgraph.core.backend.Executable.run_direct`: a program that needs no
        workspace runs as :meth:`run` runs it (which reads nothing of a binding but its view)."""
        if self.plan.size:
            return False
        self.run(bindings)  # type: ignore[arg-type]
        return True

    def run_nodes(self, bindings: Mapping[str, Tensor], workspace: Any = None) -> dict[str, np.ndarray]:
        """:meth:`run` under the caller's ``np.errstate``."""
        arena = None if workspace is None else memoryview(workspace).cast("B")
        if self.plan.size and (arena is None or arena.nbytes < self.plan.size):
            raise ValueError(f"workspace holds {0 if arena is None else arena.nbytes} bytes, the "
                             f"memory plan needs {self.plan.size}")
        env: dict[str, np.ndarray] = {}
        for name in self.input_names:
            try:
                env[name] = bindings[name].view()
            except KeyError:
                raise ValueError(f"graph input %{name} is not bound to a tensor") from None
        profile, into = self.profile, self.into
        for i, (node, lower, inputs, outputs, dead) in enumerate(self.program):
            if profile is not None:
                start = time.perf_counter()
            slot = into.get(i) if into else None
            if slot is not None:  # computed in the user tensor the plan places it in
                dst = bindings[slot.user].view().reshape(slot.shape)
                r = lower(self, node, [env[name] for name in inputs], out=dst)[0]
                if r is not dst:
                    np.copyto(dst, r)
                env[outputs[0][0]] = dst
            else:
                results = lower(self, node, [env[name] for name in inputs])
                for (name, slot), r in zip(outputs, results):
                    env[name] = r if slot is None else self._place(slot, np.asarray(r), arena, bindings)
            if profile is not None:
                profile(node, start, time.perf_counter())
            for name in dead:
                env.pop(name, None)
        return {v.name: env[v.name] for v in self.graph.outputs}


class NumpyBackend(Backend):
    """Interpret any graph on numpy; results are bit-faithful to the NPU numerics."""

    name = "numpy"
    lowerings = NUMPY_LOWERINGS

    def compile(self, graph: Graph, memory_plan: MemoryPlan, platform: Platform) -> NumpyExecutable:
        """See :meth:`Backend.compile`; looks up every node's lowering now (a node without one is a
        NotImplementedError here, not at run time); each run interprets the steps on numpy."""
        return NumpyExecutable(self, graph, memory_plan, platform, self.lowerings)

    def evaluate(self, graph: Graph, bindings: Mapping[str, Tensor]) -> dict[str, np.ndarray]:
        """Run an ad-hoc graph once and return its outputs by value name."""
        return self.run(graph, bindings)
