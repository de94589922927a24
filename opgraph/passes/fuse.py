"""Level-2 fusion (bit-exact): the ops' own level-2 rewrites (e.g. kernel-variant cast folding),
elementwise fusion into FusedElementwise nodes built from each op's expansion (broadcasts become
stride-0 reads, the per-channel prologue is hoisted and computed once), and store fusion (the
kernel writes straight into the user's output).

    >>> import numpy as np, opgraph
    >>> from opgraph.aclnn import aclnnBatchNormElemtBackwardGetWorkspaceSize as ws
    >>> t = lambda a: opgraph.tensor(np.asarray(a, np.float32))
    >>> x, c = np.ones((2, 3, 4), np.float32), np.ones(3, np.float32)
    >>> st, size, ex = ws(t(x), t(x), t(c), t(c), t(c), t(c), t(c), t(c), t(x))
    >>> g = opgraph.passes.optimize(ex.graph, 2)
    >>> [n.op for n in g.nodes], size
    (['FusedElementwise'], 0)

Fusion needs nothing op-specific: an op is fusable when its definition has an ``expand``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from l0ops.expansion import BodyBuilder
from l0ops.fused import FusedAttrs, Instr
from l0ops.primitives import instr_shape
from opgraph.core.ir import Graph, Node, Value
from opgraph.core.memory import memory_of, writes_any
from opgraph.core.opdef import all_ops
from opgraph.core.passmanager import FunctionPass, RewritePass, sweep_dead
from opgraph.core.rules import Rule


def op_rewrites() -> RewritePass:
    """The bit-exact level-2 rules every registered op contributes (``OpDef.rewrites``)."""
    return RewritePass("op-rewrites", [r for op in all_ops().values() for r in op.rewrites])


def expandable(n: Node) -> bool:
    """Whether a fused kernel may take ``n`` in: it writes no user tensor and its op can be
    written as primitives here (:meth:`~opgraph.core.opdef.OpDef.can_expand`)."""
    return not n.opdef.written(n) and n.opdef.can_expand(n)


def _absorbable(n: Node) -> bool:
    """Into an elementwise kernel: expandable, only its first output used, and no reduction but
    one to a scalar (hoisted: computed once, outside the per-element loop)."""
    if not expandable(n) or any(v.users for v in n.outputs[1:]):
        return False
    return n.opdef.kind != "reduce" or n.outputs[0].type.rank == 0


def _full_view_of_input(n: Node, numel: int) -> bool:
    """Whether ``n`` views a graph input (through views only) as ``numel`` elements: a reshape
    of the data into the kernel's iteration space moves nothing, so it stays outside the kernel,
    which then reads the input through the view's layout (a per-element view inside a body is
    one more register to carry, and what the native backend does not render)."""
    while n.opdef.kind == "view" and n.outputs[0].type.numel == numel:
        if n.inputs[0].producer is None:
            return True
        n = n.inputs[0].producer
    return False


def viewed_broadcast(n: Node) -> bool:
    """A BroadcastTo a view reads: inside a kernel its expansion is its operand, unbroadcast,
    which a view of the broadcast shape would not fit (so it stays out of fused groups)."""
    return n.op == "BroadcastTo" and any(u.opdef.kind == "view" for u in n.outputs[0].users)


def moves_past_a_write(g: Graph, node: Node, to: int) -> bool:
    """Whether running ``node`` at position ``to`` (later than its own) would read a tensor
    that a node in between writes: it would see the new contents, not those it read."""
    return writes_any(g.nodes[g.nodes.index(node) + 1:to], {id(memory_of(v)) for v in node.inputs})


def _group(g: Graph, seed: Node, taken: set, blocked: "set[int] | None" = None) -> list[Node]:
    """The seed plus every absorbable producer all of whose users are already in the group
    (but a full-size view of a graph input, :func:`_full_view_of_input`, a producer whose
    reads would move past a write — the fused kernel runs where the seed is — and the nodes
    whose ids are in ``blocked``)."""
    seed_at = g.nodes.index(seed)
    group = {id(seed): seed}
    numel = seed.outputs[0].type.numel
    changed = True
    while changed:
        changed = False
        for n in list(group.values()):
            for v in n.inputs:
                p = v.producer
                if p is None or id(p) in group or id(p) in taken or not _absorbable(p):
                    continue
                if blocked and id(p) in blocked:
                    continue
                if _full_view_of_input(p, numel) or moves_past_a_write(g, p, seed_at):
                    continue
                if viewed_broadcast(p):
                    continue
                if all(id(u) in group for u in p.outputs[0].users):
                    group[id(p)] = p
                    changed = True
    return list(group.values())


def body_of(nodes: list[Node]) -> tuple[list[Value], list[Instr], dict[str, str]]:
    """Externals, primitive body and the register of every value for a group in graph order."""
    externals: list[Value] = []
    regs: dict[str, str] = {}
    builder = BodyBuilder()

    def reg(v: Value) -> str:
        if v.name not in regs:
            regs[v.name] = f"in{len(externals)}"
            externals.append(v)
        return regs[v.name]

    for n in nodes:
        args = [reg(v) for v in n.inputs]
        res = n.opdef.expand(builder.emit, args, n.attrs, [v.type for v in n.inputs])
        for v, r in zip(n.outputs, res if isinstance(res, tuple) else (res,)):
            regs[v.name] = r
    return externals, builder.body, regs


def register_shapes(body: Sequence[Instr], externals: Sequence[Value]) -> dict[str, tuple[int, ...]]:
    """The shape of every register of ``body`` reading ``externals`` (what
    :func:`l0ops.primitives.body_types` infers, without its checks: :func:`instr_shape`); an
    operation's register broadcasts its operands', so inside a body a broadcast value is only as
    large as what it broadcasts."""
    shapes = {f"in{k}": tuple(v.shape) for k, v in enumerate(externals)}
    for k, ins in enumerate(body):
        shapes[f"t{k}"] = instr_shape(ins, [shapes[r] for r in ins.args])
    return shapes


def narrow_viewed(order: list[Node], externals: Sequence[Value], body: Sequence[Instr],
                  regs: dict[str, str]) -> "Node | None":
    """The member (of a group, ``order``, whose body :func:`body_of` made) producing a value that
    a view in the body reads through a register smaller than the value — a broadcast not
    materialised (``Mul(BroadcastTo(x), …)`` is as large as ``x`` inside a body), which the view
    cannot reshape — or None. The view may be a member or inside a member's own body (a fused
    kernel's); the member nearest it is named. Computed outside the group, that value is read
    whole."""
    shapes = register_shapes(body, externals)
    values: dict[str, list[Value]] = {}  # a register -> the member values it holds
    for n in order:
        for v in n.outputs:
            values.setdefault(regs[v.name], []).append(v)
    for ins in body:
        if ins.op == "view" and math.prod(shapes[ins.args[0]]) != math.prod(ins.shape or ()):
            found = _narrow_member(ins.args[0], body, shapes, values)
            if found is not None:  # (else a later view may still name one)
                return found
    return None


def _narrow_member(reg: str, body: Sequence[Instr], shapes: dict[str, tuple[int, ...]],
                   values: dict[str, list[Value]]) -> "Node | None":
    """The producer of the member value nearest ``reg`` (``reg`` itself, then what it is
    computed from) whose register is smaller than the value."""
    queue, seen = [reg], {reg}
    while queue:
        r = queue.pop(0)
        for v in values.get(r, ()):
            if math.prod(shapes[r]) != v.type.numel:
                return v.producer
        if r.startswith("t"):
            for a in body[int(r[1:])].args:
                if a not in seen:
                    seen.add(a)
                    queue.append(a)
    return None


def grown_apart_from_views(g: Graph, grow: Callable[[set[int]], list[Node]]
                           ) -> tuple[list[Node], tuple, set[int]]:
    """The members ``grow(blocked)`` gives, in graph order, with their :func:`body_of` and the
    ids blocked: a member whose value a view in the group would read unbroadcast
    (:func:`narrow_viewed`) is blocked and the group grown again without it (a member blocked
    already, e.g. a seed ``grow`` always keeps, ends the search: the body stays as it is)."""
    blocked: set[int] = set()
    while True:
        members = {id(n) for n in grow(blocked)}
        order = [n for n in g.nodes if id(n) in members]
        made = body_of(order)
        narrow = narrow_viewed(order, *made)
        if narrow is None or id(narrow) in blocked:
            return order, made, blocked
        blocked.add(id(narrow))


def _fused_group(g: Graph, seed: Node, taken: set, left_out: set) -> "tuple[list[Node], tuple] | None":
    """The group rooted at ``seed`` in graph order with its :func:`body_of`, or None (fewer
    than two nodes); members left out (:func:`grown_apart_from_views`) are added to
    ``left_out``."""
    order, made, blocked = grown_apart_from_views(g, lambda blocked: _group(g, seed, taken, blocked))
    if len(order) < 2:
        return None
    left_out.update(blocked)
    return order, made


def _fuse(g: Graph) -> dict[str, int]:
    """Fuse maximal groups rooted at full-size expandable nodes (largest first). A node a group
    left out (:func:`_fused_group`) is a seed even though a fused kernel reads it."""
    taken: set = set()
    left_out: set[int] = set()
    fused = absorbed = 0
    seeds = [n for n in g.nodes if _absorbable(n) and n.outputs[0].type.rank > 0
             and n.opdef.kind in ("elementwise", "kernel")]
    for seed in sorted(reversed(seeds), key=lambda n: -n.outputs[0].type.numel):
        if id(seed) in taken or seed not in g.nodes:
            continue
        if id(seed) not in left_out and any(id(u) in taken for u in seed.outputs[0].users):
            continue
        found = _fused_group(g, seed, taken, left_out)
        if found is None:
            continue
        group, (externals, body, regs) = found
        result = regs[seed.outputs[0].name]
        out = seed.outputs[0].type
        attrs = FusedAttrs(shape=out.shape, body=tuple(body), result=result, out_dtype=out.dtype,
                           out_format=out.format)
        node = g.add_node("FusedElementwise", externals, attrs, index=g.nodes.index(seed),
                          source=seed.source)
        g.replace_all_uses_with(seed.outputs[0], node.outputs[0])
        taken.update(id(n) for n in group)
        taken.add(id(node))
        fused += 1
        absorbed += len(group)
    return {"fused": fused, "absorbed": absorbed, "dead": sweep_dead(g)}


def _store_ok(n: Node) -> bool:
    p = n.inputs[0].producer
    return (p is not None and p.op == "FusedElementwise" and not p.attrs.store
            and len(n.inputs[0].users) == 1  # (a copy between one-element shapes may reshape)
            and p.outputs[0].type.shape == n.inputs[1].type.shape)


def _fuse_store(g: Graph, n: Node) -> bool:
    """ViewCopy(fused, y) → the fused kernel stores into y directly (strided or not), where the
    copy runs; False (nothing done) when a node in between writes what the kernel reads."""
    p = n.inputs[0].producer
    if moves_past_a_write(g, p, g.nodes.index(n)):
        return False
    attrs = p.attrs.model_copy(update={"store": True})
    new = g.add_node("FusedElementwise", p.inputs + [n.inputs[1]], attrs, index=g.nodes.index(n),
                     source=p.source)
    g.replace_all_uses_with(n.outputs[0], new.outputs[0])
    g.remove_node(n)
    return True


fuse_elementwise = FunctionPass("fuse-elementwise", _fuse)
fuse_store = RewritePass("fuse-store", [Rule("store-into-output", "ViewCopy", _store_ok, _fuse_store)])
