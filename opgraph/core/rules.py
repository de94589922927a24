"""A rewrite rule: ``pattern → replacement`` on IR nodes. Passes run tables of rules to a fixed
point (:class:`opgraph.core.passmanager.RewritePass`); l0 ops contribute their own rules.

    >>> drop = Rule("identity-cast", "Cast", lambda n: n.inputs[0].dtype == n.attrs.to,
    ...             lambda g, n: g.replace_all_uses_with(n.outputs[0], n.inputs[0]))
    >>> drop.name, drop.op
    ('identity-cast', 'Cast')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

Graph = Node = Any  # opgraph.core.ir types (ir imports this module through opdef)


@dataclass(frozen=True)
class Rule:
    """On nodes of op ``op`` (None: any) for which ``when(node)`` holds, ``then(graph, node)``
    rewrites the graph (dead nodes are swept afterwards); a ``then`` that returns False, having
    found in the graph that it cannot rewrite after all, changed nothing."""

    name: str
    op: Optional[str]
    when: Callable[[Node], bool]
    then: Callable[[Graph, Node], "bool | None"]
