"""aclOpExecutor analog. Phase 1 records a graph on an :class:`Executor`, then compiles it into
a :class:`CompiledProgram` (optimised graph, memory plan, workspace size) that the executor
cache shares between calls; phase 2 runs the program's executable for the current backend,
compiled once per backend, on the executor's bound tensors.

    >>> import numpy as np, l0ops
    >>> from opgraph.core.tensor import tensor
    >>> ex = Executor("aclnnCastDemo")
    >>> x = ex.input("x", tensor(np.ones(4, np.float32)))
    >>> out = ex.input("out", tensor(np.zeros(4, np.float16)))
    >>> ex.output(l0ops.ViewCopy(ex, l0ops.Cast(ex, x, to="float16"), out))
    >>> len(ex.graph.nodes), ex.program is None
    (2, True)
"""
from __future__ import annotations

import threading
from typing import Callable, Mapping, Optional

from .backend import Backend, Executable
from .ir import Graph, Value
from .memory import MemoryPlan
from .platform import Platform, get_platform
from .tensor import Tensor
from .types import RecordedCall, TensorType


def tensor_type(t: Tensor) -> TensorType:
    """The IR type of a user tensor (shape, dtype, format, strides)."""
    return TensorType(t.shape, t.dtype, t.format, t.strides)


class CompiledProgram:
    """What phase 1 produces and the executor cache keeps: the recorded ``graph``, the graph
    phase 2 runs at ``opt_level`` (``compiled``), its memory plan (``workspace_size`` bytes)
    and, per backend instance, the executable compiled from it (built on first use, then
    reused). ``graph`` may be given as a function that builds it: it is then built on first
    access (a program made for new sizes of a known structure records nothing until asked).

    ``family``: the executables of the same compiled graph at other sizes, per backend, shared
    by a structure's programs (:mod:`opgraph.aclnn.structure`): a backend's first executable
    joins it, and a later program's executable is derived from it
    (:meth:`~opgraph.core.backend.Executable.resized`) rather than compiled, when it can be.
    ``fast_math``: whether ``compiled`` holds an opt-in, NOT bit-exact fast-math rewrite."""

    def __init__(self, graph: "Graph | Callable[[], Graph]", compiled: Graph,
                 memory_plan: MemoryPlan, opt_level: int, platform: Platform,
                 family: Optional[dict[int, tuple[Backend, Executable]]] = None,
                 fast_math: bool = False):
        self.family, self.fast_math = family, fast_math
        self._graph = graph if isinstance(graph, Graph) else None
        self._make_graph = None if isinstance(graph, Graph) else graph
        self.compiled, self.memory_plan = compiled, memory_plan
        self.opt_level, self.platform = opt_level, platform
        self._executables: dict[int, tuple[Backend, Executable]] = {}
        self._lock = threading.Lock()

    @property
    def graph(self) -> Graph:
        """The graph the op_api recorded (level 0)."""
        if self._graph is None:
            with self._lock:
                if self._graph is None:
                    assert self._make_graph is not None
                    self._graph = self._make_graph()
        return self._graph

    @property
    def workspace_size(self) -> int:
        """Bytes of workspace phase 2 needs: the memory plan's size (0 when none)."""
        return self.memory_plan.size

    def executable(self, backend: Backend) -> Executable:
        """``backend``'s executable of the compiled graph (compiled once, thread-safe)."""
        built = self.known_executable(backend)
        if built is not None:
            return built
        with self._lock:
            built = self.built_executable(backend)
            if built is None:
                built = backend.compile_checked(self.compiled, self.memory_plan, self.platform)
                if self.family is not None:
                    self.family.setdefault(id(backend), (backend, built))
                self._executables[id(backend)] = (backend, built)
        return built

    def known_executable(self, backend: Optional[Backend]) -> Optional[Executable]:
        """``backend``'s executable when it has one already, or when it can be derived from
        the one its family holds (kept as this program's); else None — nothing compiled. Phase
        2 takes such a backend as it is, without asking again whether it is available."""
        built = self.built_executable(backend)
        if built is not None or self.family is None or backend is None:
            return built
        seed = self.family.get(id(backend))
        if seed is None or seed[0] is not backend:
            return None
        with self._lock:
            built = self.built_executable(backend)
            if built is None:
                built = seed[1].resized(self.compiled, self.memory_plan)
                if built is not None:
                    self._executables[id(backend)] = (backend, built)
        return built

    def built_executable(self, backend: Optional[Backend]) -> Optional[Executable]:
        """``backend``'s executable if :meth:`executable` has built it, else None."""
        hit = self._executables.get(id(backend))
        return hit[1] if hit is not None and hit[0] is backend else None

    def release(self, bindings: Mapping[str, Tensor]) -> None:
        """Let every executable built here forget ``bindings`` if it kept them for repeated runs
        (:meth:`~opgraph.core.backend.Executable.release`): a destroyed repeatable executor's
        tensors are not held on."""
        for _, built in list(self._executables.values()):
            built.release(bindings)

    @property
    def kernel_count(self) -> int:
        """Kernels phase 2 launches (free nodes excluded)."""
        return sum(1 for n in self.compiled.nodes if not n.opdef.is_free(n))


class Executor:
    """What phase 1 returns: the recorded ``graph`` (level 0), the ``bindings`` of its inputs to
    the caller's tensors, the shared ``program`` once compiled, and the single-use / repeatable
    run state of aclOpExecutor."""

    def __init__(self, name: str, platform: Optional[Platform] = None,
                 call: Optional[RecordedCall] = None):
        self._graph: Optional[Graph] = Graph(name, call)
        self.bindings: dict[str, Tensor] = {}
        self.platform = platform or get_platform()
        self.program: Optional[CompiledProgram] = None
        self.repeatable = False
        self.runs = 0
        self.destroyed = False

    @classmethod
    def of_program(cls, program: CompiledProgram, bindings: dict[str, Tensor]) -> "Executor":
        """A fresh single-use executor over a (cached) program, bound to new tensors."""
        ex = cls.__new__(cls)
        ex._graph, ex.bindings, ex.platform, ex.program = None, bindings, program.platform, program
        ex.repeatable, ex.runs, ex.destroyed = False, 0, False
        return ex

    @property
    def graph(self) -> Graph:
        """The recorded graph: this executor's own while recording, else its program's."""
        if self._graph is not None:
            return self._graph
        assert self.program is not None
        return self.program.graph

    @property
    def name(self) -> str:
        """The op_api that recorded the graph (the graph's name), e.g. ``aclnnBatchNormStats``."""
        return self.graph.name

    @property
    def compiled(self) -> Optional[Graph]:
        """The graph phase 2 runs (None before phase 1 compiled it)."""
        return None if self.program is None else self.program.compiled

    @property
    def memory_plan(self) -> Optional[MemoryPlan]:
        """The compiled graph's memory plan (None before phase 1 compiled it)."""
        return None if self.program is None else self.program.memory_plan

    @property
    def workspace_size(self) -> int:
        """Bytes phase 1 reports as the workspace (0 before it compiled, or when none is needed)."""
        return 0 if self.program is None else self.program.workspace_size

    @property
    def opt_level(self) -> int:
        """The level the program was compiled at (0 before phase 1 compiled it)."""
        return 0 if self.program is None else self.program.opt_level

    @property
    def fast_math(self) -> bool:
        """Whether the program phase 1 compiled holds an opt-in, NOT bit-exact fast-math
        rewrite (asked for with :func:`opgraph.fast_math` at level 2, and one applied)."""
        return self.program is not None and self.program.fast_math

    def input(self, name: str, t: Tensor) -> Value:
        """Register user tensor ``t`` as graph input ``%name`` and bind it."""
        v = self.graph.add_input(name, tensor_type(t))
        self.bindings[name] = t
        return v

    def output(self, *values: Value) -> None:
        """Make ``values`` the graph's outputs, in order (replacing any set before)."""
        self.graph.outputs = list(values)

    @property
    def kernel_count(self) -> int:
        """Kernels phase 2 launches (free nodes excluded)."""
        if self.program is not None:
            return self.program.kernel_count
        return sum(1 for n in self.graph.nodes if not n.opdef.is_free(n))

    def __repr__(self) -> str:
        level = f"{self.opt_level} with fast-math" if self.fast_math else self.opt_level
        return (f"<Executor {self.name}: {len(self.graph.nodes)} recorded nodes, level {level}, "
                f"workspace {self.workspace_size} B, {self.platform.soc}>")


__all__ = ["CompiledProgram", "Executor", "tensor_type"]
