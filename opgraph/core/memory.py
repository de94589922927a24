"""Memory planning: which values need workspace, their lifetimes, and 512-byte-aligned offsets in
one arena with buffer reuse. The plan's size is what phase 1 reports as the workspace.

    >>> import l0ops
    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType
    >>> g = Graph(); x = g.add_input("x", TensorType((256,), DataType.FLOAT))
    >>> y = g.add_node("Cast", [x], to=DataType.FLOAT16).outputs[0]
    >>> z = g.add_node("Cast", [y], to=DataType.FLOAT).outputs[0]
    >>> g.outputs = [z]
    >>> plan_memory(g).size        # y: 512 B; z is an output and lives in its own buffer
    512
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Container, Iterable

from .types import GraphError

ALIGN = 512


def align_up(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a`` (default 512, the workspace alignment).

        >>> align_up(0), align_up(1), align_up(512), align_up(10, 8)
        (0, 512, 512, 16)
    """
    return (n + a - 1) // a * a


@dataclass
class MemoryPlan:
    """``offsets[value name] = (offset, bytes)`` inside a workspace of ``size`` bytes."""

    size: int = 0
    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # value -> value whose buffer it uses
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)
    placed_in: dict[str, str] = field(default_factory=dict)  # value -> user tensor it is made in

    def buffer_of(self, name: str) -> str:
        """The value (or graph input) whose buffer ``name`` lives in."""
        return self.aliases.get(name, name)


def buffer_root(node: Any) -> "int | None":
    """Index of the operand whose memory ``node``'s output reuses, or None for a new buffer:
    free nodes (identities and views) alias operand 0, writers alias their destination."""
    opdef = node.opdef
    written = opdef.written(node)
    if written:
        return written[0]
    if node.inputs and opdef.is_free(node):
        return 0
    return None


def buffer_root_value(v: Any) -> Any:
    """The value whose buffer ``v`` lives in when it is a free view (or identity) of it."""
    p = v.producer
    while p is not None and p.inputs and p.opdef.is_free(p) and not p.opdef.written(p):
        v = p.inputs[0]
        p = v.producer
    return v


def redirectable(root: Any, dst: Any, taken: Container[str]) -> bool:
    """Whether a copy of ``root`` (a :func:`buffer_root_value`) into the tensor ``dst`` can be a
    redirect, the kernel making ``root`` writing into ``dst``: ``root`` is a kernel's own
    output (not a free view, not an in-place write), not redirected already (its name not in
    ``taken``), and ``dst`` is contiguous. The redirect pass and the memory plan keep this rule."""
    p = root.producer
    return (dst.type.is_contiguous and p is not None and not p.opdef.is_free(p)
            and not p.opdef.written(p) and root.name not in taken)


def memory_of(v: Any) -> Any:
    """The value whose memory ``v`` is: through free views, and through in-place writes to the
    tensor they wrote (a ViewCopy's result is its destination).

        >>> from opgraph.core.ir import Graph, TensorType
        >>> from opgraph.core.dtypes import DataType
        >>> import l0ops
        >>> g = Graph(); x = g.add_input("x", TensorType((4,), DataType.FLOAT))
        >>> out = g.add_input("out", TensorType((4,), DataType.FLOAT))
        >>> copied = g.add_node("ViewCopy", [x, out]).outputs[0]
        >>> memory_of(copied).name
        'out'
    """
    v = buffer_root_value(v)
    while v.producer is not None and v.producer.opdef.written(v.producer):
        v = buffer_root_value(v.producer.inputs[v.producer.opdef.written(v.producer)[0]])
    return v


def written_memory(n: Any) -> list[Any]:
    """The values whose memory node ``n`` writes (:func:`memory_of` its written inputs)."""
    return [memory_of(n.inputs[k]) for k in n.opdef.written(n)]


def writes_any(nodes: Iterable[Any], memories: Container[int]) -> bool:
    """Whether a node of ``nodes`` writes a memory whose value's id is in ``memories``."""
    return any(id(m) in memories for n in nodes for m in written_memory(n))


def plan_memory(graph: Any) -> MemoryPlan:
    """Liveness over the node order, then first-fit offsets (lowest gap that fits)."""
    plan = MemoryPlan()
    root: dict[str, str] = {v.name: v.name for v in graph.inputs}
    owners: dict[str, int] = {}  # buffer name -> defining node index (workspace buffers only)
    last: dict[str, int] = {}
    sizes: dict[str, int] = {}
    # a redirecting copy (opdef.redirects): the copied value lives in the destination user
    # tensor from the start, so its producer writes there
    redirected = {}
    for n in graph.nodes:
        if n.opdef.redirects(n):
            src, dst = buffer_root_value(n.inputs[0]), n.inputs[n.opdef.written(n)[0]]
            if not redirectable(src, dst, redirected):
                raise GraphError(f"a redirected copy needs a kernel's own output, redirected once, "
                                 f"into a contiguous tensor (no kernel would write %{dst.name}): {n}")
            redirected[src.name] = dst.name
    plan.placed_in = dict(redirected)
    for i, node in enumerate(graph.nodes):
        for v in node.inputs:
            last[root[v.name]] = i
        k = buffer_root(node)
        for j, v in enumerate(node.outputs):
            if v.name in redirected:
                root[v.name] = root[redirected[v.name]]
                plan.aliases[v.name] = root[v.name]
            elif k is not None and j == 0:
                root[v.name] = root[node.inputs[k].name]
                plan.aliases[v.name] = root[v.name]
            else:
                root[v.name] = v.name
                owners[v.name] = i
                sizes[v.name] = v.type.nbytes
                last.setdefault(v.name, i)
    outputs = {root[v.name] for v in graph.outputs}
    live: list[tuple[int, int, int]] = []  # (offset, size, last use)
    for name, start in sorted(owners.items(), key=lambda kv: kv[1]):
        if name in outputs:
            continue  # a graph output that is not a user tensor is returned, not workspace
        end = last.get(name, start)
        plan.lifetimes[name] = (start, end)
        nbytes = align_up(sizes[name]) if sizes[name] else 0
        live = [b for b in live if b[2] >= start]
        offset = 0
        for b_off, b_size, _ in sorted(live):
            if offset + nbytes <= b_off:
                break
            offset = max(offset, b_off + b_size)
        live.append((offset, nbytes, end))
        plan.offsets[name] = (offset, nbytes)
        plan.size = max(plan.size, offset + nbytes)
    return plan
