"""Level-2 fusion (bit-exact): kernel-variant cast folding, elementwise fusion into one
FusedElementwise node (broadcasts become stride-0 reads, the per-channel prologue is hoisted and
computed once), and store fusion (the kernel writes straight into the user's output).

    >>> import numpy as np, opgraph
    >>> from opgraph.aclnn import aclnnBatchNormElemtBackwardGetWorkspaceSize as ws
    >>> t = lambda a: opgraph.tensor(np.asarray(a, np.float32))
    >>> x, c = np.ones((2, 3, 4), np.float32), np.ones(3, np.float32)
    >>> st, size, ex = ws(t(x), t(x), t(c), t(c), t(c), t(c), t(c), t(c), t(x))
    >>> g = opgraph.passes.optimize(ex.graph, 2)
    >>> [n.op for n in g.nodes], size
    (['FusedElementwise'], 0)
"""
from __future__ import annotations

from typing import Optional

from l0ops.fused import FusedAttrs, Instr
from l0ops.registry import get_op
from opgraph.dtypes import DataType
from ..ir import Graph, Node, Value
from .core import FunctionPass, Rule, RewritePass, sweep_dead

F16, F32 = DataType.FLOAT16, DataType.FLOAT
ALIASES = {"BroadcastTo", "Contiguous"}  # absorbed as stride-0 / strided reads


def _upcast_source(v: Value) -> Optional[Value]:
    """``a`` when ``v = Cast(a: f16, to=f32)`` is used once, else None."""
    p = v.producer
    if p is not None and p.op == "Cast" and p.attrs.to == F32 and p.inputs[0].dtype == F16 \
            and len(v.users) == 1:
        return p.inputs[0]
    return None


def _mixed_variant_ok(n: Node) -> bool:
    k = n.inputs[0].producer
    if n.attrs.to != F16 or k is None or k.op != "SyncBatchNormBackwardElemt" or len(n.inputs[0].users) != 1:
        return False
    return (k.inputs[2].dtype == F32 and _upcast_source(k.inputs[0]) is not None
            and _upcast_source(k.inputs[1]) is not None)


def _to_mixed_variant(g: Graph, n: Node) -> None:
    """Cast(f16→f32) ×2 → kernel(f32, f32) → Cast(f32→f16) becomes the (f16, f32) kernel: it
    computes in float32 and rounds once to f16 (RNE), the same bits."""
    k = n.inputs[0].producer
    ins = [_upcast_source(k.inputs[0]), _upcast_source(k.inputs[1])] + k.inputs[2:]
    new = g.add_node(k.op, ins, k.attrs, index=g.nodes.index(n))
    g.replace_all_uses_with(n.outputs[0], new.outputs[0])


kernel_variants = RewritePass("cast-fold-kernel-variant", [
    Rule("f16-f32-variant", "Cast", _mixed_variant_ok, _to_mixed_variant)])


def _absorbable(n: Node) -> bool:
    if n.opdef.written(n) or len(n.outputs) != 1:
        return False
    if n.op in ALIASES or n.op in ("UnsqueezeNd", "Fill"):
        return True
    if n.op == "ReduceSum":
        return not n.attrs.keepdims and len(n.attrs.axes) == n.inputs[0].type.rank
    return "expand" in n.opdef.extra


def _group(seed: Node, taken: set) -> list[Node]:
    """The seed plus every absorbable producer all of whose users are already in the group."""
    group = {id(seed): seed}
    changed = True
    while changed:
        changed = False
        for n in list(group.values()):
            for v in n.inputs:
                p = v.producer
                if p is None or id(p) in group or id(p) in taken or not _absorbable(p):
                    continue
                if all(id(u) in group for u in p.outputs[0].users):
                    group[id(p)] = p
                    changed = True
    return list(group.values())


def _body(nodes: list[Node], result: Value) -> tuple[list[Value], list[Instr], str]:
    """Externals, primitive body and result register for a group in graph order."""
    externals: list[Value] = []
    regs: dict[str, str] = {}
    body: list[Instr] = []

    def reg(v: Value) -> str:
        if v.name not in regs:
            regs[v.name] = f"in{len(externals)}"
            externals.append(v)
        return regs[v.name]

    def emit(op, args, dtype, shape=None, value=None) -> str:
        body.append(Instr(op=op, args=tuple(args), dtype=dtype, shape=shape, value=value))
        return f"t{len(body) - 1}"

    for n in nodes:
        out = n.outputs[0]
        args = [reg(v) for v in n.inputs]
        if n.op in ALIASES:
            regs[out.name] = args[0]
        elif n.op == "UnsqueezeNd":
            regs[out.name] = emit("view", args, out.dtype, shape=out.shape)
        elif n.op == "Fill":
            regs[out.name] = emit("fill", [], out.dtype, shape=out.shape, value=n.attrs.value)
        elif n.op == "ReduceSum":
            regs[out.name] = emit("sum", args, out.dtype)
        else:
            regs[out.name] = n.opdef.extra["expand"](emit, args, n.attrs, [v.type for v in n.inputs])
    return externals, body, regs[result.name]


def _fuse(g: Graph) -> dict[str, int]:
    """Fuse maximal groups rooted at full-size elementwise nodes (largest first)."""
    taken: set = set()
    fused = absorbed = 0
    seeds = [n for n in g.nodes if "expand" in n.opdef.extra and n.outputs[0].type.rank > 0]
    for seed in sorted(reversed(seeds), key=lambda n: -n.outputs[0].type.numel):
        if id(seed) in taken or seed not in g.nodes:
            continue
        if any(id(u) in taken for u in seed.outputs[0].users):
            continue
        group = _group(seed, taken)
        if len(group) < 2:
            continue
        order = [n for n in g.nodes if any(n is m for m in group)]
        externals, body, result = _body(order, seed.outputs[0])
        out = seed.outputs[0].type
        attrs = FusedAttrs(shape=out.shape, body=tuple(body), result=result, out_dtype=out.dtype)
        node = g.add_node("FusedElementwise", externals, attrs, index=g.nodes.index(seed))
        g.replace_all_uses_with(seed.outputs[0], node.outputs[0])
        taken.update(id(n) for n in group)
        taken.add(id(node))
        fused += 1
        absorbed += len(group)
    return {"fused": fused, "absorbed": absorbed, "dead": sweep_dead(g)}


def _store_ok(n: Node) -> bool:
    p = n.inputs[0].producer
    return (p is not None and p.op == "FusedElementwise" and not p.attrs.store
            and len(n.inputs[0].users) == 1)


def _fuse_store(g: Graph, n: Node) -> None:
    """ViewCopy(fused, y) → the fused kernel stores into y directly (strided or not)."""
    p = n.inputs[0].producer
    attrs = p.attrs.model_copy(update={"store": True})
    new = g.add_node("FusedElementwise", p.inputs + [n.inputs[1]], attrs, index=g.nodes.index(n))
    g.replace_all_uses_with(n.outputs[0], new.outputs[0])
    g.remove_node(n)


fuse_elementwise = FunctionPass("fuse-elementwise", _fuse)
fuse_store = RewritePass("fuse-store", [Rule("store-into-output", "ViewCopy", _store_ok, _fuse_store)])

LEVEL2 = [kernel_variants, fuse_elementwise, fuse_store]
assert get_op("FusedElementwise")
