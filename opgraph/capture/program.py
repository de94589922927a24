"""A captured program: the recorded graph of many op_api calls, compiled once (optimised at a
level, memory planned) and replayed on any backend with the captured tensors or new ones of the
same types.

    >>> import numpy as np, opgraph
    >>> from opgraph.aclnn.batch_norm_stats import batch_norm_stats
    >>> with opgraph.capture() as prog:
    ...     mean, invstd = batch_norm_stats(np.ones((2, 3, 4), np.float32), 1e-5)
    >>> out = prog.replay(input=np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    >>> out["mean"].tolist(), np.shares_memory(mean, out["mean"])
    ([7.5, 11.5, 15.5], True)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from l0ops.collectives import is_collective
from opgraph.aclnn.twophase import memory_partner, unwritable_reason, written_inputs
from opgraph.core.backend import Backend, Executable, get as get_backend, made
from opgraph.core.config import BackendRef, check_level, current_backend_ref
from opgraph.core.executor import tensor_type
from opgraph.core.ir import Graph, Node
from opgraph.core.memory import MemoryPlan, plan_memory
from opgraph.core.platform import Platform
from opgraph.core.quiet import restore, silence
from opgraph.core.tensor import Tensor, tensor
from opgraph.passes import fast_math_applied, optimize
from opgraph.passes.program import optimize_program
from .recorder import CaptureError


def traffic(node: Node) -> int:
    """Bytes a launched node reads and writes: its operands (at their real size) and results; a
    written operand (a store's destination) counts once, as the result written into it."""
    written = set(node.opdef.written(node))
    return (sum(v.type.nbytes for k, v in enumerate(node.inputs) if k not in written)
            + sum(v.type.nbytes for v in node.outputs))


@dataclass(frozen=True)
class ProgramStats:
    """Kernel launches (collectives apart), collectives, bytes the launched kernels read and
    write (:func:`traffic`), nodes and workspace of a graph."""

    nodes: int
    launches: int
    collectives: int
    bytes_moved: int
    workspace: int

    @classmethod
    def of(cls, graphs: "list[Graph]") -> "ProgramStats":
        """The totals over ``graphs`` (free nodes launch nothing; the workspace is the largest one)."""
        launched = [n for g in graphs for n in g.nodes if not n.opdef.is_free(n)]
        kernels = [n for n in launched if not is_collective(n)]
        return cls(sum(len(g.nodes) for g in graphs), len(kernels), len(launched) - len(kernels),
                   sum(traffic(n) for n in kernels),
                   max((plan_memory(g).size for g in graphs), default=0))


def check_schedule(graph: Graph, plan: MemoryPlan) -> None:
    """CaptureError unless the collectives keep their captured order and every user tensor is
    read only up to the node that first writes it (a write, or a value produced into it)."""
    seqs = [n.attrs.seq for n in graph.nodes if is_collective(n)]
    if seqs != sorted(seqs):
        raise CaptureError(f"the optimised program reorders its collectives: {seqs}")
    first: dict[str, int] = {}
    producer_at = {id(v): i for i, n in enumerate(graph.nodes) for v in n.outputs}
    for i, n in enumerate(graph.nodes):
        for k in n.opdef.written(n):
            first.setdefault(n.inputs[k].name, i)
    for value, user in plan.placed_in.items():
        at = next((producer_at[id(v)] for v in graph.values() if v.name == value
                   and id(v) in producer_at), None)
        if at is not None:
            first[user] = min(first.get(user, at), at)
    for i, n in enumerate(graph.nodes):
        for k, v in enumerate(n.inputs):
            if v.producer is None and k not in n.opdef.written(n) and i > first.get(v.name, i):
                raise CaptureError(f"the optimised program reads %{v.name} at node {i} after "
                                   f"node {first[v.name]} wrote it: {n.header()}")


def _layout_mark(value: Any) -> Optional[tuple]:
    """What identifies where an array object's elements are, for arrays that can change it in
    place (``ndarray.shape = ...``, torch's ``resize_``/``set_``); None when unknown."""
    if isinstance(value, np.ndarray):
        return value.shape, value.strides, value.dtype
    data_ptr, stride = getattr(value, "data_ptr", None), getattr(value, "stride", None)
    if callable(data_ptr) and callable(stride):  # torch.Tensor (duck-typed: no torch import)
        try:
            return data_ptr(), tuple(value.shape), stride(), value.dtype
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


class Program:
    """Many op_api calls as one graph. ``graph``: as recorded (level 0, the calls chained);
    ``compiled``: optimised at ``level`` (at level 2 with the opt-in, NOT bit-exact fast-math
    rewrites if ``fast_math``; :attr:`fast_math` then says whether one applied);
    ``inputs``: the captured tensor of every graph input (by name);
    ``outputs``: the names of the tensors a replay writes. Build one with
    :func:`opgraph.capture.capture`."""

    def __init__(self, graph: Graph, inputs: Mapping[str, Tensor], level: int,
                 platform: Platform, backend: Optional[BackendRef] = None,
                 calls: "list[Graph] | None" = None, on_replay: Sequence[Callable[[], Any]] = (),
                 *, fast_math: bool = False):
        self.graph, self.level, self.platform, self.backend = graph, check_level(level), platform, backend
        self._fast_math_asked = fast_math
        self.on_replay = tuple(on_replay)  # host effects after every replay (opgraph.capture.on_replay)
        self.inputs = dict(inputs)
        self.calls = list(calls or [])  # each captured op_api call's own recorded graph
        done: list = []
        self.compiled = (optimize_program(graph, self.level, fast_math=fast_math, stats=done)
                         if graph.nodes else graph)
        self.fast_math = fast_math_applied(done)
        self.memory_plan = plan_memory(self.compiled)
        check_schedule(self.compiled, self.memory_plan)
        self.outputs = written_inputs(self.compiled)
        self._types = {v.name: v.type for v in self.compiled.inputs}
        # each input's type as a tensor's signature (shape, strides, dtype, format), which a
        # rebound tensor carries built once: one tuple comparison a rebinding
        self._signatures = {name: (t.shape, t.strides, int(t.dtype), int(t.format))
                            for name, t in self._types.items()}
        self._written = frozenset(self.outputs)
        self._executables: dict[int, tuple[Backend, Executable]] = {}
        self._workspace: Optional[bytearray] = None
        self._workspace_lock = threading.Lock()  # held by the replay running in _workspace
        self._rebound: dict[str, tuple[Any, Any, Tensor]] = {}  # name: (object, layout, Tensor)
        self._apart: tuple = ()  # the (name, tensor) pairs last rebound and found apart

    def at_level(self, level: int) -> "Program":
        """The same recorded program compiled at another level (same tensors)."""
        return Program(self.graph, self.inputs, level, self.platform, self.backend, self.calls,
                       self.on_replay, fast_math=self._fast_math_asked)

    @property
    def workspace_size(self) -> int:
        """Bytes of workspace a replay needs: the compiled program's memory plan."""
        return self.memory_plan.size

    def stats(self) -> ProgramStats:
        """The compiled program's launches, collectives, bytes moved, nodes and workspace."""
        return ProgramStats.of([self.compiled])

    def stats_one_by_one(self) -> ProgramStats:
        """The same figures for the calls run one by one, each compiled at ``level`` (workspace:
        the largest call's)."""
        graphs = [optimize(g, self.level, fast_math=self._fast_math_asked) if g.nodes else g
                  for g in self.calls]
        return replace(ProgramStats.of(graphs),
                       collectives=sum(1 for n in self.graph.nodes if is_collective(n)))

    def _bindings(self, new: Mapping[str, Any]) -> dict[str, Tensor]:
        bindings = dict(self.inputs)
        types, signatures = self._types, self._signatures
        for name, value in new.items():
            if name not in types:
                raise ValueError(f"replay: {name}: not an input of the program (inputs: "
                                 f"{', '.join(types)})")
            try:
                t = value if isinstance(value, Tensor) else self._viewed(name, value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"replay: {name}: cannot be used as a tensor "
                                 f"({type(value).__name__}): {e}") from None
            if t.signature != signatures[name] and tensor_type(t) != types[name]:
                raise ValueError(f"replay: {name}: the program was captured with {types[name]}, "
                                 f"got {tensor_type(t)}; capture again for other shapes")
            if name in self._written:
                why = unwritable_reason(t) if t.numel else None
                if why:
                    raise ValueError(f"replay: {name}: {why}")
            bindings[name] = t
        if new:
            self._check_apart(bindings, new)
        return bindings

    def _check_apart(self, bindings: Mapping[str, Tensor], rebound: Iterable[str]) -> None:
        """Refuse a rebound tensor that shares memory with another input where either is
        written: the capture kept such tensors apart (:class:`~.recorder.Recorder` refuses an
        overlap and makes one input of the very same view), and the compiled program's order of
        reads and writes relies on it. Skipped when the rebound tensors are the last checked."""
        checked = tuple([(name, bindings[name]) for name in rebound])
        if checked == self._apart:
            return
        for name in rebound:
            other = memory_partner(bindings, self._written, name)
            if other is not None:
                w, r = (name, other) if name in self._written else (other, name)
                raise ValueError(f"replay: {name}: shares memory with {other}; the program "
                                 f"writes {w} and was captured with {w} and {r} apart "
                                 "(pass tensors that do not overlap, or capture again)")
        self._apart = checked

    def _viewed(self, name: str, value: Any) -> Tensor:
        """``tensor(value)``; the same Tensor as the last replay's when ``value`` is the same
        object with the same memory and layout (so a backend that bound itself to the last
        replay's tensors stays bound, :meth:`Executable.run_repeatable`)."""
        mark = _layout_mark(value)
        last = self._rebound.get(name)
        if last is not None and last[0] is value and mark is not None and last[1] == mark:
            return last[2]
        t = tensor(value)
        self._rebound[name] = (value, mark, t)
        return t

    def executable(self, backend: Backend) -> Executable:
        """``backend``'s executable of the compiled program (compiled once per backend)."""
        hit = self._executables.get(id(backend))
        if hit is None or hit[0] is not backend:
            hit = (backend, backend.compile_checked(self.compiled, self.memory_plan, self.platform))
            self._executables[id(backend)] = hit
        return hit[1]

    def replay(self, backend: Optional[BackendRef] = None, **new_inputs: Any) -> dict[str, np.ndarray]:
        """Run the program once. ``new_inputs`` rebind inputs by name (arrays or tensors of the
        captured types; outputs are written into them); the others are the captured tensors.
        ``backend``: this one, else the one the captured calls' phase 2 would have used, else
        the current one. Then the host effects registered with :func:`opgraph.capture.on_replay`
        run. Returns every written tensor by name (as numpy views)."""
        bindings = self._bindings(new_inputs)
        ref = backend if backend is not None else self.backend
        if ref is None:
            ref = current_backend_ref()
        be = made(ref)  # a backend that compiled this program runs it without asking again
        if be is None or self._executables.get(id(be), (None,))[0] is not be:
            be = get_backend(ref)  # whether it is available, named when not
        if self.compiled.nodes:
            # the program's workspace, unless another thread's replay is running in it: then
            # one of this replay's own (which the executable runs node by node, as any other)
            mine = self._workspace_lock.acquire(blocking=False)
            workspace = None
            if self.workspace_size:
                if not mine:
                    workspace = bytearray(self.workspace_size)
                else:
                    if self._workspace is None or len(self._workspace) < self.workspace_size:
                        self._workspace = bytearray(self.workspace_size)
                    workspace = self._workspace
            token = silence()  # IEEE results are defined; the NPU does not warn
            try:
                self.executable(be).run_repeatable(bindings, workspace)
            finally:
                restore(token)
                if mine:
                    self._workspace_lock.release()
        for effect in self.on_replay:
            effect()
        return {name: bindings[name].view() for name in self.outputs}

    run = replay

    def __getattr__(self, name: str) -> Any:  # an attribute the program does not have (yet)
        if name.startswith("__") or "compiled" in self.__dict__:  # built: hasattr works
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise CaptureError(f"prog.{name}: the program is built when the capture block ends "
                           "(without an exception)")

    def __repr__(self) -> str:
        if "compiled" not in self.__dict__:
            return "<Program (capturing)>"
        s = self.stats()
        level = f"{self.level} with fast-math" if self.fast_math else self.level
        return (f"<Program of {len(self.calls)} op_api calls: level {level}, {s.launches} launches + "
                f"{s.collectives} collectives, inputs {', '.join(self.inputs)}>")


__all__ = ["Program", "ProgramStats", "check_schedule", "traffic"]
