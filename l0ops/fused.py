"""FusedElementwise: one kernel that runs a body of primitives (:mod:`l0ops.primitives`) over an
iteration space, reading broadcast inputs by stride (no materialised broadcasts) and optionally
storing straight into a user tensor. Level-2 fusion builds these; backends render or interpret
them.

    >>> import numpy as np
    >>> from opgraph.core.dtypes import DataType as D
    >>> body = (Instr(op="sub", args=("in0", "in1"), dtype=D.FLOAT16),)
    >>> a = FusedAttrs(shape=(2, 2), body=body, result="t0", out_dtype=D.FLOAT16)
    >>> FusedElementwise.compute([np.float16([[1, 2], [3, 4]]), np.float16([[1], [1]])], a)[0].tolist()
    [[0.0, 1.0], [2.0, 3.0]]
"""
from __future__ import annotations

import numpy as np

from opgraph.core.opdef import Fidelity, require
from opgraph.core.types import TensorType
from .define import define_op
from .interpreter import run_fused
from .primitives import FusedAttrs, Instr, body_lines, reg_types

__all__ = ["FusedAttrs", "FusedElementwise", "Instr", "stores_in_place"]


def _infer(ts, a: FusedAttrs):
    ins = ts[:-1] if a.store else ts
    regs = reg_types(a, ins)
    require(regs[a.result][0] == a.out_dtype, "FusedElementwise", "result dtype differs from out_dtype")
    if a.store:
        dst = ts[-1]
        require(dst.shape == a.shape and dst.dtype == a.out_dtype, "FusedElementwise",
                f"store destination {dst} does not match {a.out_dtype.short}{list(a.shape)}")
        return [dst]
    return [TensorType(a.shape, a.out_dtype, a.out_format)]


def stores_in_place(dst: np.ndarray) -> bool:
    """Whether a storing body computes straight into its destination ``dst`` (writable and
    C-contiguous), rather than into a new array then copied into it.

        >>> stores_in_place(np.zeros((2, 3))), stores_in_place(np.zeros((2, 3)).T)
        (True, False)
    """
    return dst.flags.writeable and dst.flags.c_contiguous


def _compute(xs, a: FusedAttrs):
    if a.store:
        dst = xs[-1]
        if stores_in_place(dst):
            run_fused(a, xs[:-1], out=dst)
        else:
            dst[...] = run_fused(a, xs[:-1])
        return [dst]
    return [run_fused(a, xs)]


def _inline(emit, args, a: FusedAttrs, in_types) -> str:
    """Expansion: inline the (non-storing) body into a larger one."""
    regs = {f"in{k}": r for k, r in enumerate(args)}
    for k, ins in enumerate(a.body):
        regs[f"t{k}"] = emit(ins.op, [regs[r] for r in ins.args], ins.dtype,
                             shape=ins.shape, value=ins.value, over=ins.over)
    return regs[a.result]


FusedElementwise = define_op(
    "FusedElementwise", attrs=FusedAttrs, kind="kernel", infer=_infer, compute=_compute,
    expand=_inline, format_body=body_lines,
    writes_fn=lambda node: (len(node.inputs) - 1,) if node.attrs.store else (),
    fidelity=(Fidelity("bit-faithful", "the bits of the ops it fuses (every default pass keeps "
                       "them)"),),
    doc="A fused elementwise kernel: primitive body, stride-0 broadcast reads, optional store.")
