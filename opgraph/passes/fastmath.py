"""Opt-in, NOT bit-exact: ``fast-math-channel-affine`` rewrites each SyncBatchNormBackwardElemt
into per-channel coefficients and one affine map per element,

    out = gradOut·A[c] + input·B[c] + D[c],  A = invstd·weight,  B = −invstd²·meanDyXmu·A,
    D = mean·invstd²·meanDyXmu·A − meanDy·A,

computed in float32. Error: each term is rounded a few times, so
``|out − exact| ≲ 4·eps32·(|gradOut·A| + |input·B| + |D|)`` — relative error grows where the
terms cancel (tested against float64). It never runs unless asked for (``fast_math=True``).
"""
from __future__ import annotations

from l0ops.fused import FusedAttrs, Instr
from opgraph.dtypes import DataType
from ..ir import Graph, Node
from .core import Rule, RewritePass

F32 = DataType.FLOAT


def _affine_body(in_types) -> tuple[tuple[Instr, ...], str]:
    body: list[Instr] = []

    def emit(op, args, dtype=F32, value=None) -> str:
        body.append(Instr(op=op, args=tuple(args), dtype=dtype, value=value))
        return f"t{len(body) - 1}"

    g, x, mu, inv, w, md, mdx = [f"in{k}" if t.dtype == F32 else emit("cast", [f"in{k}"])
                                 for k, t in enumerate(in_types)]
    a = emit("mul", [inv, w])
    q = emit("mul", [emit("mul", [inv, inv]), mdx])
    b0 = emit("mul", [q, a])
    b = emit("sub", [emit("fill", [], value=0.0), b0])
    d = emit("sub", [emit("mul", [mu, b0]), emit("mul", [md, a])])
    out = emit("add", [emit("add", [emit("mul", [g, a]), emit("mul", [x, b])]), d])
    T = in_types[0].dtype
    if T != F32:
        out = emit("cast", [out], T)
    return tuple(body), out


def _rewrite(g: Graph, n: Node) -> None:
    body, result = _affine_body([v.type for v in n.inputs])
    out = n.outputs[0].type
    attrs = FusedAttrs(shape=out.shape, body=body, result=result, out_dtype=out.dtype)
    new = g.add_node("FusedElementwise", n.inputs, attrs, index=g.nodes.index(n))
    g.replace_all_uses_with(n.outputs[0], new.outputs[0])


fast_math_channel_affine = RewritePass("fast-math-channel-affine", [
    Rule("channel-affine", "SyncBatchNormBackwardElemt", lambda n: True, _rewrite)])
fast_math_channel_affine.bit_exact = False
