"""SyncBatchNormBackwardElemt, the AI Vector kernel of aclnnBatchNormElemtBackward, defined once
by its vector steps; its numpy semantics, fusion and the native C kernel all come from them.

``gradInput = ((gradOut − meanDy) − (input − mean)·(invstd²·meanDyXmu))·invstd·weight``

    >>> import numpy as np
    >>> x = np.arange(4, dtype=np.float32)
    >>> one, zero = np.float32(1), np.float32(0)
    >>> elemt_backward(x, x, zero, one, one, zero, np.float32(0.1), arch=2201).tolist()
    [0.0, 0.8999999761581421, 1.7999999523162842, 2.700000047683716]
"""
from __future__ import annotations

import numpy as np

from opgraph.core.dtypes import DataType
from opgraph.core.opdef import Fidelity, L0Error, OpAttrs, require
from opgraph.core.rules import Rule
from .define import define_op
from .primitives import FusedAttrs, Instr

F32, F16, BF16 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16
# (T, T1) pairs the kernel registry allows (ops-nn sync_batch_norm_backward_elemt_def.cpp):
# data dtype, parameter dtype.
KERNEL_VARIANTS = {(F16, F16), (BF16, BF16), (F32, F32), (F16, F32)}
# Archs whose kernel opgraph models: DAV_2201 (910B/910_93; 910 shares its flavour), DAV_3510.
MODELLED_ARCHS = {1001: "dav2201", 2201: "dav2201", 3510: "dav3510"}
OP = "SyncBatchNormBackwardElemt"


class ElemtAttrs(OpAttrs):
    """SyncBatchNormBackwardElemt's attributes: ``arch``, the NpuArch whose kernel numerics apply
    (2201 and 1001: the eight in-order steps; 3510: the regbase DAG); any other is an L0Error."""

    arch: int  # NpuArch whose kernel numerics apply (2201, 1001 or 3510); always printed


def kernel_flavour(arch: int) -> str:
    """'dav2201' (eight in-order vector steps) or 'dav3510' (regbase DAG)."""
    try:
        return MODELLED_ARCHS[arch]
    except KeyError:
        raise L0Error(f"{OP} has no kernel for DAV_{arch}") from None


def _expand(emit, args, a: ElemtAttrs, ts) -> str:
    """The kernel's vector steps. T = dtype of gradOut/input, T1 = of the five parameters. On
    DAV_2201 T == T1 ∈ {f16, f32} computes in T (experimental op_kernel, the T == T1 branch);
    (bf16, bf16) and (f16, f32) compute in float and round back to T (RNE). DAV_3510 computes
    in float with its own order (arch35 kernel)."""
    T, T1 = ts[0].dtype, ts[2].dtype
    flavour = kernel_flavour(a.arch)
    cd = T if flavour == "dav2201" and T == T1 and T in (F16, F32) else F32
    go, x, mu, inv, w, md, mdx = [r if t.dtype == cd else emit("cast", [r], cd) for r, t in zip(args, ts)]
    if flavour == "dav2201":
        s1 = emit("sub", [go, md], cd)
        s2 = emit("sub", [x, mu], cd)
        m = emit("mul", [inv, inv], cd)
        m = emit("mul", [m, mdx], cd)
        s2 = emit("mul", [s2, m], cd)
        s1 = emit("sub", [s1, s2], cd)
        s1 = emit("mul", [s1, inv], cd)
        res = emit("mul", [s1, w], cd)
    else:
        sub1 = emit("sub", [go, md], cd)
        sub2 = emit("sub", [x, mu], cd)
        m1 = emit("mul", [inv, inv], cd)
        m2 = emit("mul", [mdx, m1], cd)
        m3 = emit("mul", [sub2, m2], cd)
        sub3 = emit("sub", [sub1, m3], cd)
        ww = emit("mul", [inv, w], cd)
        res = emit("mul", [sub3, ww], cd)
    return res if cd == T else emit("cast", [res], T)


def _infer(ts, a: ElemtAttrs):
    kernel_flavour(a.arch)
    shape = ts[0].shape
    for i, t in enumerate(ts):
        require(t.shape == shape, OP, f"input {i} has shape {list(t.shape)}, expected {list(shape)}")
    T, T1 = ts[0].dtype, ts[2].dtype
    require(ts[1].dtype == T, OP, "gradOut and input dtypes differ")
    require(all(t.dtype == T1 for t in ts[2:]), OP,
            "mean, invstd, weight, meanDy and meanDyXmu must share one dtype")
    require((T, T1) in KERNEL_VARIANTS, OP, f"no kernel variant for (T, T1) = ({T.short}, {T1.short})")
    return [ts[1].with_()]


# --- rewrites ---------------------------------------------------------------------------------
def _upcast_source(v):
    """``a`` when ``v = Cast(a: f16, to=f32)`` is used once, else None."""
    p = v.producer
    if p is not None and p.op == "Cast" and p.attrs.to == F32 and p.inputs[0].dtype == F16 \
            and len(v.users) == 1:
        return p.inputs[0]
    return None


def _mixed_variant_ok(n) -> bool:
    k = n.inputs[0].producer
    if n.attrs.to != F16 or k is None or k.op != OP or len(n.inputs[0].users) != 1:
        return False
    return (k.inputs[2].dtype == F32 and _upcast_source(k.inputs[0]) is not None
            and _upcast_source(k.inputs[1]) is not None)


def _to_mixed_variant(g, n) -> None:
    """Cast(f16→f32) ×2 → kernel(f32, f32) → Cast(f32→f16) becomes the (f16, f32) kernel: it
    computes in float32 and rounds once to f16 (RNE), the same bits."""
    k = n.inputs[0].producer
    ins = [_upcast_source(k.inputs[0]), _upcast_source(k.inputs[1])] + k.inputs[2:]
    new = g.add_node(k.op, ins, k.attrs, index=g.nodes.index(n), source=k.source)
    g.replace_all_uses_with(n.outputs[0], new.outputs[0])


def _affine_body(in_types) -> tuple[tuple[Instr, ...], str]:
    """out = gradOut·A + input·B + D per channel (A = invstd·weight, B = −invstd²·meanDyXmu·A,
    D = mean·invstd²·meanDyXmu·A − meanDy·A), in float32."""
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
    result = out if in_types[0].dtype == F32 else emit("cast", [out], in_types[0].dtype)
    return tuple(body), result  # the body after the cast emitted last


def _to_affine(g, n) -> None:
    """NOT bit-exact: each term is rounded a few times, so before the rounding to the output
    dtype ``|out − exact| ≲ 8·eps32·(|gradOut·A| + |input·B| + |mean·B| + |meanDy·A|)`` (D's two
    parts count apart: they may cancel); the relative error grows where the terms cancel, as
    where the mean is large against the spread. Where a per-channel term overflows float32
    (|mean·invstd³·meanDyXmu·weight| > 3.4e38) the result is inf or NaN."""
    body, result = _affine_body([v.type for v in n.inputs])
    out = n.outputs[0].type
    attrs = FusedAttrs(shape=out.shape, body=body, result=result, out_dtype=out.dtype,
                       out_format=out.format)
    new = g.add_node("FusedElementwise", n.inputs, attrs, index=g.nodes.index(n), source=n.source)
    g.replace_all_uses_with(n.outputs[0], new.outputs[0])


SyncBatchNormBackwardElemt = define_op(
    OP, attrs=ElemtAttrs, num_inputs=7, kind="elementwise", infer=_infer, expand=_expand,
    rewrites=(Rule("f16-f32-variant", "Cast", _mixed_variant_ok, _to_mixed_variant),),
    fast_math=(Rule("channel-affine", OP, lambda n: True, _to_affine),),
    fidelity=(Fidelity("bit-faithful", "910B kernel source (ops-nn experimental "
                       "sync_batch_norm_backward_elemt op_kernel, T == T1 branch)", (2201, 1001)),
              Fidelity("bit-faithful", "950 kernel source (ops-nn sync_batch_norm_backward_elemt "
                       "op_kernel/arch35)", (3510,))),
    doc="The element-wise SyncBatchNorm input gradient kernel (7 same-shape inputs).")


def elemt_backward(go: np.ndarray, x: np.ndarray, mean: np.ndarray, invstd: np.ndarray,
                   weight: np.ndarray, mdy: np.ndarray, mdyx: np.ndarray, *, arch: int = 2201) -> np.ndarray:
    """The kernel's numpy semantics on broadcastable arrays (what the op computes per element)."""
    ops = [np.asarray(a) for a in (go, x, mean, invstd, weight, mdy, mdyx)]
    shape = np.broadcast_shapes(*(a.shape for a in ops))
    full = [np.broadcast_to(a, shape) for a in ops]
    return SyncBatchNormBackwardElemt.compute(full, SyncBatchNormBackwardElemt.make_attrs(arch=arch))[0]
