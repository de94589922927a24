"""What a fused element-wise kernel computes, and the facts about it the C renderers go by.

:func:`plan` splits a FusedElementwise body with :class:`l0ops.interpreter.Hoisted` (the
per-channel part is evaluated once in numpy) into a :class:`Plan` and checks that the rest is
float arithmetic a kernel supports. The predicates (:func:`store_rounds`,
:func:`store_reads_top`, :func:`paired`, :func:`needs_vector`, :func:`pure_half`,
:func:`quiet_bf16`) decide which loops and roundings :mod:`.render` and :mod:`.simd` emit;
:func:`scalar_body` spells one element in C.

    >>> import numpy as np
    >>> from l0ops.interpreter import Hoisted
    >>> from l0ops.primitives import FusedAttrs, Instr
    >>> from opgraph.core.dtypes import DataType as D
    >>> body = (Instr(op="cast", args=("in0",), dtype=D.FLOAT),
    ...         Instr(op="mul", args=("t0", "in1"), dtype=D.FLOAT),
    ...         Instr(op="cast", args=("t1",), dtype=D.BF16))
    >>> a = FusedAttrs(shape=(2, 8), body=body, result="t2", out_dtype=D.BF16)
    >>> p = plan(a, Hoisted(a, [np.ones((2, 8), "bfloat16"), np.ones((2, 1), np.float32)]))
    >>> [name for name, _ in p.big], p.hoisted, paired(p), store_reads_top(p)
    (['in0'], ('in1',), True, True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from l0ops.interpreter import Hoisted
from l0ops.primitives import FusedAttrs, Instr
from opgraph.core.dtypes import DataType
from .c_text import BF16, C_OP, F16, FLOATS, LOAD, ROUND, STORE, V_OP
from .unsupported import Unsupported


@dataclass(frozen=True)
class Plan:
    """What a kernel computes: operands in call order, then the per-element instructions.

    ``big``: (register, dtype) of full-size inputs read at their own strides; ``hoisted``:
    per-channel registers passed as float32 arrays; ``live``: (register, instruction).
    """

    big: tuple[tuple[str, DataType], ...]
    hoisted: tuple[str, ...]
    live: tuple[tuple[str, Instr], ...]
    result: str
    out_dtype: DataType


def plan(a: FusedAttrs, h: Hoisted) -> Plan:
    """The kernel plan of body ``a`` split by ``h``; raises :class:`Unsupported` with a reason."""
    if a.result in h.values:
        raise Unsupported("the result does not vary over the iteration space")
    if a.out_dtype not in FLOATS:
        raise Unsupported(f"output dtype {a.out_dtype.short}")
    used: list[str] = []
    for dst, ins in h.live:
        if ins.op not in C_OP and ins.op != "cast":
            raise Unsupported(f"{ins.render(dst)}: {ins.op} per element")
        if ins.dtype not in FLOATS:
            raise Unsupported(f"{ins.render(dst)}: {ins.dtype.short} register")
        for r in ins.args:
            if h.types[r][0] not in FLOATS:
                raise Unsupported(f"{ins.render(dst)}: operand {r} is {h.types[r][0].short}")
            if r not in used and (r in h.big or r in h.values):
                used.append(r)
    if a.result in h.big and a.result not in used:
        used.append(a.result)
    big = tuple((r, h.types[r][0]) for r in sorted(h.big, key=_reg_order) if r in used)
    if any(d not in FLOATS for _, d in big):
        raise Unsupported("a full-size input is not f32/f16/bf16")
    hoisted = tuple(r for r in used if r in h.values)
    return Plan(big, hoisted, tuple(h.live), a.result, a.out_dtype)


def _reg_order(name: str) -> tuple[str, int]:
    return name[:2], int(name.lstrip("int"))


def _stored_result(p: Plan, dtype: DataType) -> bool:
    """Whether the last instruction makes the ``dtype`` result that only a ``dtype`` store reads."""
    return (bool(p.live) and p.live[-1][0] == p.result and p.live[-1][1].dtype == dtype
            and p.out_dtype == dtype)


def store_rounds(p: Plan) -> bool:
    """True when the last instruction makes the f16 result and only the store reads it: the f16
    store rounds to nearest even itself (``opg_st_f16``, ``vcvtps2ph``), so that instruction's
    own rounding round trip is left out (rounding twice to fp16 gives the same bits)."""
    return _stored_result(p, F16)


def store_reads_top(p: Plan) -> bool:
    """True when the last instruction makes the bf16 result and only the store reads it: a
    vector bf16 store keeps just the high half of each lane, so that rounding need not clear the
    low half (``opg_v_rnd_bf16_top``)."""
    return _stored_result(p, BF16)


def paired(p: Plan) -> bool:
    """True when the full-size inputs and the output are all bf16: a SIMD loop can then widen
    ``2 * OPG_W`` elements from one load into two vectors of interleaved lanes and pack them
    back in order (``opg_v_lo_bf16``, ``opg_vi_bf16``: no shifts to place each half, no
    cross-lane permute), which no element-wise instruction notices as long as the per-channel
    operands are in the same lane order: scalars, or vectors loaded so (``opg_v_lo_f32``)."""
    return p.out_dtype == BF16 and bool(p.big) and all(d == BF16 for _, d in p.big)


def rounded(p: Plan, k: int, expr: str, rnd: Callable[[DataType, str], str]) -> str:
    """Live instruction ``k``'s value: ``rnd(dtype, expr)``, or ``expr`` where the store rounds."""
    return expr if k == len(p.live) - 1 and store_rounds(p) else rnd(p.live[k][1].dtype, expr)


def scalar_body(p: Plan, load: Callable[[int, str], str]) -> list[str]:
    """Statements computing one element; ``load(operand index, register)`` reads an operand."""
    lines = []
    for k, (r, d) in enumerate(p.big):
        lines.append(f"const float r_{r} = {LOAD[d].format(load(k, r))};")
    for k, r in enumerate(p.hoisted, start=len(p.big)):
        lines.append(f"const float r_{r} = {load(k, r)};")
    for k, (dst, ins) in enumerate(p.live):
        args = [f"r_{r}" for r in ins.args]
        expr = args[0] if ins.op == "cast" else f" {C_OP[ins.op]} ".join(args)
        value = rounded(p, k, expr, lambda d, e: ROUND[d].format(e))
        lines.append(f"const float r_{dst} = {value};  /* {ins.render(dst)} */")
    out = load(len(p.big) + len(p.hoisted), "")
    lines.append(f"{out} = {STORE[p.out_dtype].format('r_' + p.result)};")
    return lines


def needs_vector(p: Plan) -> bool:
    """True when the body loads, rounds or stores f16/bf16 (then the explicit loop pays off)."""
    narrow = (F16, BF16)
    return (p.out_dtype in narrow or any(d in narrow for _, d in p.big)
            or any(ins.dtype in narrow for _, ins in p.live))


def pure_half(p: Plan) -> bool:
    """Every load, instruction and the store are f16 arithmetic: native fp16 SIMD applies (an
    IEEE fp16 op equals the float op rounded to fp16, since float carries 24 >= 2·11+2 bits)."""
    return (p.out_dtype == F16 and all(d == F16 for _, d in p.big)
            and all(ins.op in V_OP and ins.dtype == F16 for _, ins in p.live))


def quiet_bf16(p: Plan) -> frozenset[int]:
    """Live instructions whose bf16 rounding may skip the NaN test (``opg_v_rnd_bf16_q``) in a
    row whose per-channel scalars hold no NaN with low payload bits (``opg_low_nan``).

    With bf16 full-size inputs only and no f16 instruction, every NaN in such a row has a zero
    low half (bf16 loads, arithmetic's default NaN, payloads those pass on), and arithmetic
    quiets it; adding the rounding bias then cannot carry out of the low half, so the plain RNE
    formula gives the NaN-tested rounding's bits. Arithmetic instructions and casts of their
    results qualify (a cast of a load could hold a signalling NaN, which the test quiets)."""
    if any(d != BF16 for _, d in p.big) or any(ins.dtype == F16 for _, ins in p.live):
        return frozenset()
    made = {dst for dst, ins in p.live if ins.op in C_OP}
    return frozenset(k for k, (_, ins) in enumerate(p.live) if ins.dtype == BF16 and (
        ins.op in C_OP or (ins.op == "cast" and ins.args[0] in made)))


__all__ = ["Plan", "needs_vector", "paired", "plan", "pure_half", "quiet_bf16", "rounded",
           "scalar_body", "store_reads_top", "store_rounds"]
