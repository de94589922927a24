"""Per-graph cost figures: node count, kernel launches, bytes moved, planned workspace.

    >>> import numpy as np, opgraph
    >>> from opgraph.aclnn import aclnnBatchNormElemtBackwardGetWorkspaceSize as ws
    >>> t = lambda a: opgraph.tensor(np.asarray(a))
    >>> x, c = np.ones((2, 3, 4), np.float32), np.ones(3, np.float32)
    >>> ex = ws(t(x), t(x), t(c), t(c), t(c), t(c), t(c), t(np.int32([2])), t(x))[2]
    >>> [graph_stats(opgraph.passes.optimize(ex.graph, n)).launches for n in (0, 1, 2)]
    [11, 10, 1]
"""
from __future__ import annotations

from dataclasses import dataclass

from opgraph.core.ir import Graph, Node
from opgraph.core.memory import plan_memory


@dataclass(frozen=True)
class GraphStats:
    """What :func:`graph_stats` counts: ``nodes``, ``launches`` (nodes that run a kernel),
    ``bytes_moved`` (bytes the launched nodes read and write) and ``workspace`` (planned bytes)."""

    nodes: int
    launches: int
    bytes_moved: int
    workspace: int



def node_traffic(node: Node) -> int:
    """Bytes a launched node reads and writes (broadcast operands count at their real size)."""
    return sum(v.type.nbytes for v in node.inputs) + sum(v.type.nbytes for v in node.outputs)


def graph_stats(graph: Graph) -> GraphStats:
    """Launches are nodes CANN would run a kernel for (free identities/views excluded)."""
    launched = [n for n in graph.nodes if not n.opdef.is_free(n)]
    return GraphStats(nodes=len(graph.nodes), launches=len(launched),
                      bytes_moved=sum(node_traffic(n) for n in launched),
                      workspace=plan_memory(graph).size)
