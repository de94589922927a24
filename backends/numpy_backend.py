"""The numpy backend: the bit-faithful CPU golden reference. It interprets a graph node by node
with each l0 op's numpy semantics, freeing every value after its last use.

    >>> import numpy as np, opgraph
    >>> from opgraph.ir import Graph, TensorType
    >>> g = Graph(); x = g.add_input("x", TensorType((2,), opgraph.DataType.FLOAT))
    >>> y = g.add_input("y", TensorType((2,), opgraph.DataType.FLOAT16))
    >>> c = g.add_node("Cast", [x], to=opgraph.DataType.FLOAT16).outputs[0]
    >>> g.outputs = [g.add_node("ViewCopy", [c, y]).outputs[0]]
    >>> out = np.zeros(2, np.float16)
    >>> NumpyBackend().run(g, {"x": opgraph.tensor(np.float32([1.5, 2])), "y": opgraph.tensor(out)})
    >>> out.tolist()
    [1.5, 2.0]
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .base import Backend

# Per-backend lowering table: op name -> fn(node, args) -> list of arrays. Ops not listed use the
# op definition's own numpy semantics (OpDef.compute).
Lowering = Callable[[Any, list], list]


def last_uses(graph) -> dict[int, list[str]]:
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


def _cached_last_uses(graph) -> dict[int, list[str]]:
    """:func:`last_uses`, memoised on the graph while its node list is unchanged."""
    key = tuple(map(id, graph.nodes))
    cached = getattr(graph, "_last_uses", None)
    if cached is None or cached[0] != key:
        cached = (key, last_uses(graph))
        graph._last_uses = cached
    return cached[1]


class NumpyBackend(Backend):
    """Interpret any graph on numpy; results are bit-faithful to the NPU numerics (design §4)."""

    name = "numpy"
    lowerings: dict[str, Lowering] = {}

    def run(self, graph, bindings: Mapping[str, Any], workspace: Any = None) -> None:
        self.evaluate(graph, bindings)

    def evaluate(self, graph, bindings: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run the graph and return its outputs by value name."""
        env: dict[str, np.ndarray] = {}
        for v in graph.inputs:
            try:
                env[v.name] = bindings[v.name].view()
            except KeyError:
                raise ValueError(f"graph input %{v.name} is not bound to a tensor") from None
        frees = _cached_last_uses(graph)
        for i, node in enumerate(graph.nodes):
            args = [env[v.name] for v in node.inputs]
            lower = self.lowerings.get(node.op)
            results = lower(node, args) if lower else node.opdef.compute(args, node.attrs)
            for v, r in zip(node.outputs, results):
                env[v.name] = r
            for name in frees.get(i, ()):
                env.pop(name, None)
        return {v.name: env[v.name] for v in graph.outputs}
