"""aclOpExecutor analog: the recorded graph, the user tensors bound to its inputs, the compiled
(optimised) graph phase 2 runs, and the single-use / repeatable state.

    >>> import numpy as np, l0ops
    >>> from opgraph.tensor import tensor
    >>> ex = Executor("aclnnCastDemo")
    >>> x = ex.input("x", tensor(np.ones(4, np.float32)))
    >>> out = ex.input("out", tensor(np.zeros(4, np.float16)))
    >>> ex.output(l0ops.ViewCopy(ex, l0ops.Cast(ex, x, to="float16"), out))
    >>> len(ex.graph.nodes)
    2
"""
from __future__ import annotations

from typing import Optional

from .ir import Graph, TensorType, Value
from .platform import Platform, get_platform
from .tensor import Tensor


def tensor_type(t: Tensor) -> TensorType:
    """The IR type of a user tensor (shape, dtype, format, strides)."""
    return TensorType(t.shape, t.dtype, t.format, t.strides)


class Executor:
    """What phase 1 returns. ``graph`` is the graph as recorded (level 0); ``compiled`` the graph
    phase 2 runs at ``opt_level``; ``workspace_size`` the bytes phase 2 needs."""

    def __init__(self, name: str, platform: Optional[Platform] = None):
        self.graph = Graph(name)
        self.bindings: dict[str, Tensor] = {}
        self.platform = platform or get_platform()
        self.compiled: Optional[Graph] = None
        self.opt_level = 0
        self.workspace_size = 0
        self.memory_plan = None
        self.repeatable = False
        self.runs = 0
        self.destroyed = False
        self.cached = False

    @property
    def name(self) -> str:
        return self.graph.name

    def input(self, name: str, t: Tensor) -> Value:
        """Register user tensor ``t`` as graph input ``%name`` and bind it."""
        v = self.graph.add_input(name, tensor_type(t))
        self.bindings[name] = t
        return v

    def output(self, *values: Value) -> None:
        self.graph.outputs = list(values)

    def compile(self, level: int) -> None:
        """Optimise the recorded graph at ``level`` and plan its workspace."""
        from .memory import plan_memory
        from .passes import optimize
        self.opt_level = level
        self.compiled = optimize(self.graph, level, verify_each=False) if self.graph.nodes else self.graph
        self.memory_plan = plan_memory(self.compiled)
        self.workspace_size = self.memory_plan.size

    @property
    def kernel_count(self) -> int:
        """Kernels phase 2 launches (free nodes excluded)."""
        g = self.compiled or self.graph
        return sum(1 for n in g.nodes if not n.opdef.is_free(n))

    def __repr__(self) -> str:
        return (f"<Executor {self.name}: {len(self.graph.nodes)} recorded nodes, level {self.opt_level}, "
                f"workspace {self.workspace_size} B, {self.platform.soc}>")
