"""Graph passes. ``optimize(graph, level)``: 0 = as recorded, 1 = what CANN launches, 2 = fused.

    >>> from opgraph.ir import Graph
    >>> optimize(Graph("empty"), 0).nodes
    []
"""
from __future__ import annotations


def optimize(graph, level: int):
    """A new graph optimised at ``level`` (the input graph is never modified)."""
    if level not in (0, 1, 2):
        raise ValueError(f"opt level must be 0, 1 or 2, got {level!r}")
    return graph.copy()
