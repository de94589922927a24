"""Level-2 reduction fusion (bit-exact): a reduction and the elementwise work around it — the
producers that feed it, sibling reductions of the same data, the per-channel epilogue — become
one FusedReduce kernel with a result for every value used outside it. Nothing op-specific: every
op in the group is written as primitives by its own ``expand``.

    >>> import numpy as np, opgraph
    >>> from opgraph.core.ir import Graph, TensorType
    >>> g = Graph(); x = g.add_input("x", TensorType((4, 3, 5), opgraph.DataType.FLOAT))
    >>> sq = g.add_node("Mul", [x, x]).outputs[0]
    >>> s1 = g.add_node("ReduceSum", [sq], axes=(0, 2)).outputs[0]
    >>> s2 = g.add_node("ReduceSum", [x], axes=(0, 2)).outputs[0]
    >>> g.outputs = [s1, s2]
    >>> fused, stats = fuse_reductions.run(g)
    >>> [n.op for n in fused.nodes], stats.counts["fused"]
    (['FusedReduce'], 1)
"""
from __future__ import annotations

import heapq
from typing import Callable, Optional

from l0ops.fused_reduce import FusedReduceAttrs
from opgraph.core.dtypes import Format
from opgraph.core.ir import Graph, Node, Value
from opgraph.core.memory import memory_of, written_memory
from opgraph.core.opdef import L0Error
from opgraph.core.passmanager import FunctionPass, sweep_dead
from .fuse import expandable, grown_apart_from_views, viewed_broadcast


def _depends_on(node: Node, group: set[int], memo: dict[int, bool]) -> bool:
    """True when ``node`` (transitively) reads a value a node of ``group`` produces."""
    hit = memo.get(id(node))
    if hit is not None:
        return hit
    memo[id(node)] = False
    out = False
    for v in node.inputs:
        p = v.producer
        if p is not None and (id(p) in group or _depends_on(p, group, memo)):
            out = True
            break
    memo[id(node)] = out
    return out


def _acyclic(new: set[int], outside: list[Node]) -> bool:
    """True when no node outside ``new`` that feeds it depends on it (the fused node could not
    be placed: it would read a value computed from its own results)."""
    memo: dict[int, bool] = {}
    return not any(_depends_on(p, new, memo) for p in outside if id(p) not in new)


def _stays_inside(n: Node, big: int, outs: set[int], seen: "set[int] | None" = None) -> bool:
    """True when ``n``'s outputs need not leave a kernel: none is a graph output (ids ``outs``)
    and each user is a reduction, or an expandable node whose outputs are small (< ``big``
    elements) or again stay inside."""
    seen = set() if seen is None else seen
    if id(n) in seen:
        return True
    seen.add(id(n))
    for v in n.outputs:
        if id(v) in outs:
            return False
        for u in v.users:
            if not expandable(u):
                return False
            if u.opdef.kind != "reduce" and any(w.type.numel >= big for w in u.outputs) \
                    and not _stays_inside(u, big, outs, seen):
                return False
    return True


_CHEAP = ("reduce", "movement", "view", "copy")  # results that cost no more than their size


def _grow(seed: Node, taken: set[int], keep_big_inside: bool = False,
          outs: "set[int] | None" = None,
          order_ok: Optional[Callable[[set[int]], bool]] = None) -> list[Node]:
    """The seed plus expandable producers, consumers and siblings (other readers of the data it
    reads), to a fixed point. A node joins only when the group stays schedulable: no node
    outside it both reads one of its values and feeds it (a cycle, e.g. through a collective).
    With ``keep_big_inside`` (program graphs) an arithmetic node with a result as large as the
    seed's input joins only when that result need not leave the kernel: the kernel's results stay
    per-channel (or cheap broadcasts of it), which is what backends render. ``order_ok(ids)``
    (when given) must accept the group with the candidate: the kernel runs after its last
    member, which may not change the order of a user tensor's reads and writes."""
    group = {id(seed): seed}
    outside: list[Node] = [v.producer for v in seed.inputs if v.producer is not None]
    # "large": as large as the reduced data and larger than the reduction's result
    big = max(seed.inputs[0].type.numel if seed.inputs else 0, seed.outputs[0].type.numel + 1)

    def join(c: Node) -> bool:
        if keep_big_inside and c.opdef.kind not in _CHEAP and not _stays_inside(c, big, outs or set()) \
                and any(w.type.numel >= big for w in c.outputs):
            return False
        ids = set(group) | {id(c)}
        feeds = [w.producer for w in c.inputs if w.producer is not None and id(w.producer) not in ids]
        if viewed_broadcast(c) or not _acyclic(ids, outside + feeds) or (
                order_ok is not None and not order_ok(ids)):
            return False
        group[id(c)] = c
        outside.extend(feeds)
        return True

    changed = True
    while changed:
        changed = False
        for n in list(group.values()):
            for v in n.inputs:
                p = v.producer
                if p is not None and id(p) not in group and id(p) not in taken and expandable(p):
                    changed = join(p) or changed
            for v in n.outputs + n.inputs:
                for c in v.users:
                    if id(c) in group or id(c) in taken or not expandable(c):
                        continue
                    changed = join(c) or changed
    return list(group.values())


def _result_slots(g: Graph, order: list[Node], ids: set[int]) -> list[tuple[Value, "Node | None"]]:
    """The kernel's results: every value used outside the group; a value several copies
    (ViewCopy) read gets one result per copy, so each can be produced into its destination."""
    slots: list[tuple[Value, "Node | None"]] = []
    for n in order:
        for v in n.outputs:
            outside = [u for u in v.users if id(u) not in ids]
            if v in g.outputs or not outside:
                if v in g.outputs:
                    slots.append((v, None))
                continue
            if len(outside) > 1 and all(u.opdef.written(u) for u in outside):
                slots.extend((v, u) for u in outside)
            else:
                slots.append((v, None))
    return slots


def _stable_topological(nodes: list[Node], key: Callable[[Node], float],
                        unit: Callable[[Node], Node] = lambda n: n,
                        inputs: Callable[[Node], list[Value]] = lambda n: n.inputs) -> list[Node]:
    """``nodes`` sorted topologically, the smallest ``key`` first among those ready (so the
    given order wherever it is valid); ``unit`` maps a node to the one standing for it and
    ``inputs`` gives what a node reads (a fused group: the kernel, reading all its members')."""
    index = {id(n): n for n in nodes}
    needs: dict[int, set[int]] = {id(n): set() for n in nodes}
    users: dict[int, set[int]] = {id(n): set() for n in nodes}
    for n in nodes:
        for v in inputs(n):
            p = None if v.producer is None else unit(v.producer)
            if p is not None and p is not n and id(p) in index:
                needs[id(n)].add(id(p))
                users[id(p)].add(id(n))
    ready = [(key(n), k, n) for k, n in enumerate(nodes) if not needs[id(n)]]
    heapq.heapify(ready)
    at = {id(n): k for k, n in enumerate(nodes)}  # (ties: the given order)
    out = []
    while ready:
        n = heapq.heappop(ready)[2]
        out.append(n)
        for u in users[id(n)]:
            needs[u].discard(id(n))
            if not needs[u]:
                heapq.heappush(ready, (key(index[u]), at[u], index[u]))
    return out


def _order(g: Graph) -> None:
    """Re-sort the nodes topologically, keeping the original order wherever it is valid."""
    position = {id(n): i for i, n in enumerate(g.nodes)}
    g.nodes[:] = _stable_topological(g.nodes, lambda n: position[id(n)])


def _accesses(n: Node) -> tuple[set[int], set[int]]:
    """The memory ``n`` reads and the memory it writes (as ids of :func:`memory_of`)."""
    written = n.opdef.written(n)
    return ({id(memory_of(v)) for k, v in enumerate(n.inputs) if k not in written},
            {id(m) for m in written_memory(n)})


def _moved(window: list[Node], ids: set[int]) -> set[int]:
    """The nodes of ``window`` that fusing ``ids`` can move: the members and what reads them."""
    moved = set(ids)
    for n in window:
        if any(v.producer is not None and id(v.producer) in moved for v in n.inputs):
            moved.add(id(n))
    return moved


def _keeps_access_order(g: Graph, ids: set[int],
                        memo: Optional[dict[int, tuple[set[int], set[int]]]] = None) -> bool:
    """Whether running the nodes ``ids`` as one kernel placed after the last of them, the rest
    re-sorted as :func:`_order` does, keeps every write on the same side of each other read or
    write of the memory it writes. (Only nodes from the first member to the last can change
    places: the members and what reads them move later, to the kernel, and no further.)
    ``memo``: each node's :func:`_accesses` by id, kept while the graph does not change."""
    memo = {} if memo is None else memo

    def accesses(n: Node) -> tuple[set[int], set[int]]:
        hit = memo.get(id(n))
        if hit is None:
            hit = memo[id(n)] = _accesses(n)
        return hit
    first = last = None
    for i, n in enumerate(g.nodes):
        if id(n) in ids:
            first, last = (i if first is None else first), i
    assert first is not None and last is not None
    window = g.nodes[first:last + 1]
    writes = [n for n in window if id(n) not in ids and n.opdef.written(n)]
    if not writes:
        return True
    moved = _moved(window, ids)
    written = set().union(*(accesses(w)[1] for w in writes))
    if not any(id(w) in moved for w in writes) and \
            not any(set().union(*accesses(a)) & written for a in window if id(a) in moved):
        return True  # a write and what touches its memory keep their order when neither moves
    position = {id(n): i for i, n in enumerate(window)}
    members = [n for n in window if id(n) in ids]
    kernel = members[0]  # stands for every member
    key = {id(n): float(i) for i, n in enumerate(window)}
    key[id(kernel)] = len(window) - 0.5  # after the last member
    read = [v for m in members for v in m.inputs]
    after = {id(n): i for i, n in enumerate(_stable_topological(
        [n for n in window if id(n) not in ids or n is kernel], lambda n: key[id(n)],
        lambda n: kernel if id(n) in ids else n, lambda n: read if n is kernel else n.inputs))}
    new = {id(n): after[id(kernel) if id(n) in ids else id(n)] for n in window}
    touched = [(a, set().union(*accesses(a))) for a in window]
    for w in writes:
        mems = accesses(w)[1]
        for a, memory in touched:
            if a is not w and mems & memory and \
                    (position[id(a)] < position[id(w)]) != (new[id(a)] < new[id(w)]):
                return False
    return True


def _formats(formats: list[Format]) -> tuple[Format, ...]:
    """The results' format tags, or () when all are ND (the default, left out of dumps)."""
    return () if all(f == Format.ND for f in formats) else tuple(formats)


def _views_of_written(g: Graph) -> set[int]:
    """The free views of a tensor some node writes."""
    written = {id(m) for n in g.nodes for m in written_memory(n)}
    return {id(n) for n in g.nodes if written and n.opdef.is_free(n) and not n.opdef.written(n)
            and n.outputs and id(memory_of(n.outputs[0])) in written}


def _without_view_results(g: Graph, group: list[Node], views: set[int]) -> list[Node]:
    """``group`` less the views of a written tensor (``views``) that would be kernel results:
    a result is a copy taken where the kernel runs, which a reader of the view after the write
    would not see change. (Read inside the kernel only, a view stays a member.)"""
    outs = {id(v) for v in g.outputs}
    while True:
        ids = {id(n) for n in group}
        leaving = [n for n in group if id(n) in views and any(
            id(v) in outs or any(id(u) not in ids for u in v.users) for v in n.outputs)]
        if not leaving:
            return group
        group = [n for n in group if n not in leaving]


def _fuse_reductions(g: Graph, keep_big_inside: bool = False) -> dict[str, int]:
    taken: set[int] = set()
    views = _views_of_written(g)
    fused = absorbed = dead = 0
    alive = {id(n) for n in g.nodes}
    memo: dict = {}  # the nodes' accesses, kept until a fusion changes the graph
    for seed in list(g.nodes):
        if id(seed) in taken or seed.opdef.kind != "reduce" or not expandable(seed) \
                or seed.opdef.is_free(seed) or id(seed) not in alive:
            continue
        outs = {id(v) for v in g.outputs}
        by_id = {id(n): n for n in g.nodes}

        def kept(ids: set[int]) -> list[Node]:  # the members once views that would be results leave
            return _without_view_results(g, [by_id[i] for i in ids], views)

        def order_ok(ids: set[int]) -> bool:
            return _keeps_access_order(g, {id(n) for n in kept(ids)}, memo)

        def grow(blocked: set[int]) -> list[Node]:
            group = _grow(seed, taken | blocked, keep_big_inside, outs)
            if not order_ok({id(n) for n in group}):  # grown again, checking each join
                group = _grow(seed, taken | blocked, keep_big_inside, outs, order_ok)
            return kept({id(n) for n in group})
        try:  # a body that still does not type-check is left unfused (no fuzzed graph does)
            order, (externals, body, regs), _ = grown_apart_from_views(g, grow)
            ids = {id(n) for n in order}
            slots = _result_slots(g, order, ids)
            attrs = FusedReduceAttrs(body=tuple(body), results=tuple(regs[v.name] for v, _ in slots),
                                     out_shapes=tuple(v.shape for v, _ in slots),
                                     out_formats=_formats([v.type.format for v, _ in slots]))
            node = g.add_node("FusedReduce", externals, attrs, index=g.nodes.index(order[-1]) + 1,
                              source=seed.source)
        except L0Error:
            taken.add(id(seed))
            continue
        for (old, user), new in zip(slots, node.outputs):
            if user is None:
                g.replace_all_uses_with(old, new)
            else:  # this copy gets an output of its own (so that it can be redirected)
                user.inputs = [new if v is old else v for v in user.inputs]
                old.users = [u for u in old.users if u is not user]
                new.users.append(user)
        taken.update(ids)
        taken.add(id(node))
        fused += 1
        absorbed += len(order)
        dead += sweep_dead(g)  # the next group's order check sees the graph as it will run
        _order(g)
        alive = {id(n) for n in g.nodes}
        memo = {}
    dead += sweep_dead(g)
    return {"fused": fused, "absorbed": absorbed, "dead": dead}


fuse_reductions = FunctionPass("fuse-reductions", _fuse_reductions)
# for program graphs (opgraph.capture): large values stay inside the kernel that makes them
fuse_reductions_program = FunctionPass("fuse-reductions",
                                       lambda g: _fuse_reductions(g, keep_big_inside=True))
