"""FusedReduce: one kernel that computes reductions together with the elementwise work around
them — a body of primitives (:mod:`l0ops.primitives`) whose ``sum`` instructions reduce to
keepdims shapes — and returns several results. Level-2 fusion builds it from ops' expansions
(ReduceSum, ReduceVar, Mul, casts, the per-channel epilogue ...); its bits are those of the ops
it fuses, because the instructions and the summation order (:mod:`l0ops.ordered`) are theirs.

    >>> import numpy as np
    >>> from opgraph.core.dtypes import DataType as D
    >>> body = (Instr(op="mul", args=("in0", "in1"), dtype=D.FLOAT),
    ...         Instr(op="sum", args=("t0",), dtype=D.FLOAT, shape=(1, 2)),
    ...         Instr(op="sum", args=("in0",), dtype=D.FLOAT, shape=(1, 2)))
    >>> a = FusedReduceAttrs(body=body, results=("t1", "t2"), out_shapes=((2,), (2,)))
    >>> x = np.float32([[1, 2], [3, 4]])
    >>> [r.tolist() for r in FusedReduce.compute([x, x], a)]
    [[10.0, 20.0], [4.0, 6.0]]
"""
from __future__ import annotations

import math

import numpy as np

from opgraph.core.dtypes import Format
from opgraph.core.opdef import Fidelity, OpAttrs, require
from opgraph.core.types import TensorType, broadcast_shape
from .define import define_op
from .expansion import array_types, evaluate_body
from .primitives import Instr, body_types

__all__ = ["FusedReduce", "FusedReduceAttrs", "Instr", "as_output"]


class FusedReduceAttrs(OpAttrs):
    """FusedReduce's attributes: ``body``, the primitive instructions (registers ``in<k>`` are the
    operands); ``results``, the registers returned, one per output; ``out_shapes``, each
    result's output shape (a view or a broadcast of it); ``out_formats``, their format tags
    (empty: all ND)."""

    body: tuple[Instr, ...]
    results: tuple[str, ...]
    out_shapes: tuple[tuple[int, ...], ...]  # each result is viewed as this shape
    out_formats: tuple[Format, ...] = ()  # the format tags of the values replaced (none: ND)


def _infer(ts, a: FusedReduceAttrs):
    regs = body_types(a.body, ts)
    require(len(a.results) == len(a.out_shapes), "FusedReduce", "one output shape per result")
    require(len(a.out_formats) in (0, len(a.results)), "FusedReduce", "one format per result")
    formats = a.out_formats or (Format.ND,) * len(a.results)
    out = []
    for r, shape, form in zip(a.results, a.out_shapes, formats):
        require(r in regs, "FusedReduce", f"result register {r} is undefined")
        d, s = regs[r]
        require(math.prod(s) == math.prod(shape) or _broadcasts(s, shape), "FusedReduce",
                f"result {r} ({list(s)}) can be neither viewed nor broadcast as {list(shape)}")
        out.append(TensorType(tuple(shape), d, form))
    return out


def _broadcasts(src, shape) -> bool:
    try:
        return broadcast_shape(tuple(src), tuple(shape)) == tuple(shape)
    except ValueError:
        return False


def as_output(v: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A result register as its output: reshaped (a view of [1,C,1,1] as [C]) or broadcast."""
    return v.reshape(shape) if v.size == math.prod(shape) else np.array(np.broadcast_to(v, shape))


def _compute(xs, a: FusedReduceAttrs):
    values = evaluate_body(a.body, a.results, xs, array_types(xs))
    return [as_output(v, shape) for v, shape in zip(values, a.out_shapes)]


def _inline(emit, args, a: FusedReduceAttrs, ts):
    """Expansion: inline the body into a larger one; each result viewed as its output shape."""
    regs = {f"in{k}": r for k, r in enumerate(args)}
    types = body_types(a.body, ts)
    for k, ins in enumerate(a.body):
        regs[f"t{k}"] = emit(ins.op, [regs[r] for r in ins.args], ins.dtype,
                             shape=ins.shape, value=ins.value, over=ins.over)
    out = []
    for r, shape in zip(a.results, a.out_shapes):
        d, s = types[r]
        same = tuple(s) == tuple(shape) or math.prod(s) != math.prod(shape)  # broadcasts implicitly
        out.append(regs[r] if same else emit("view", [regs[r]], d, shape=shape))
    return tuple(out)


def body_lines(a: FusedReduceAttrs) -> list[str]:
    """The body as the dump prints it: one line per instruction, then ``return <results>``."""
    return [i.render(f"t{k}") for k, i in enumerate(a.body)] + ["return " + ", ".join(a.results)]


FusedReduce = define_op(
    "FusedReduce", attrs=FusedReduceAttrs, kind="kernel", infer=_infer, compute=_compute,
    expand=_inline, format_body=body_lines,
    fidelity=(Fidelity("bit-faithful", "the bits of the ops it fuses (the same primitives and "
                       "summation order)"),),
    doc="A fused kernel of reductions and the elementwise work around them; several results.")
