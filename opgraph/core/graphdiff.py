"""What a pass changed, node by node: nodes are matched by their first output's name (SSA names
survive passes; new nodes get fresh names).

    >>> import l0ops
    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType
    >>> g = Graph(); x = g.add_input("x", TensorType((2,), DataType.FLOAT))
    >>> c = g.add_node("Cast", [x], to=DataType.FLOAT).outputs[0]
    >>> g.outputs = [g.add_node("Cast", [c], to=DataType.FLOAT16).outputs[0]]
    >>> h = g.copy(); h.replace_all_uses_with(h.nodes[0].outputs[0], h.inputs[0])
    >>> h.remove_node(h.nodes[0])
    >>> d = diff_nodes(g, h)
    >>> d.removed, d.rewired, d.marks_after()
    (['0'], ['1'], {'1': 'rewired'})
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Graph = Node = Any  # opgraph.core.ir types (this module needs only their attributes)

KINDS = ("added", "removed", "rewritten", "rewired")


def node_key(node: Node) -> str:
    """The name a node is known by across passes: its first output's name."""
    return node.outputs[0].name if node.outputs else f"@{id(node)}"


def _signature(node: Node) -> tuple:
    """What makes a node the same op call: op, attrs and output types (not its operands)."""
    return node.op, node.attrs, tuple(v.type for v in node.outputs)


@dataclass
class NodeDiff:
    """Keys of nodes ``added`` (only after), ``removed`` (only before), ``rewritten`` (op, attrs
    or type changed) and ``rewired`` (same call, other operands); ``was`` maps a rewritten or
    rewired key to its old dump line."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    rewritten: list[str] = field(default_factory=list)
    rewired: list[str] = field(default_factory=list)
    was: dict[str, str] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        """True when any node was added, removed, rewritten or rewired."""
        return bool(self.added or self.removed or self.rewritten or self.rewired)

    def marks_before(self) -> dict[str, str]:
        """``{key: "removed"}`` for the graph before the pass."""
        return {k: "removed" for k in self.removed}

    def marks_after(self) -> dict[str, str]:
        """``{key: "added" | "rewritten" | "rewired"}`` for the graph after the pass."""
        marks = {k: "added" for k in self.added}
        marks.update({k: "rewritten" for k in self.rewritten})
        marks.update({k: "rewired" for k in self.rewired})
        return marks


def diff_nodes(before: Graph, after: Graph) -> NodeDiff:
    """Node-level difference of two graphs (keys in each graph's node order)."""
    old = {node_key(n): n for n in before.nodes}
    new = {node_key(n): n for n in after.nodes}
    d = NodeDiff(removed=[k for k in old if k not in new], added=[k for k in new if k not in old])
    for k, n in new.items():
        m = old.get(k)
        if m is None:
            continue
        if _signature(m) != _signature(n):
            d.rewritten.append(k)
        elif [v.name for v in m.inputs] != [v.name for v in n.inputs]:
            d.rewired.append(k)
        else:
            continue
        d.was[k] = m.header()
    return d


__all__ = ["KINDS", "NodeDiff", "diff_nodes", "node_key"]
