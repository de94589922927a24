"""Render the per-element part of a FusedElementwise body as one C kernel.

:func:`plan` splits a body with :class:`l0ops.interpreter.Hoisted` (the per-channel part is evaluated
once in numpy) and checks that the rest is float arithmetic the kernel supports; :func:`render`
turns the plan into C source. The kernel makes one pass over the data:

* registers hold ``float``; f16/bf16 loads widen exactly; every f16 / bf16 instruction is
  computed in float and rounded to its dtype (RNE) right after, like the numpy reference;
* operands are the ``big`` full-size inputs (f32 / f16 / bf16 at any element strides), the
  hoisted registers the live instructions read (float32, stride 0 on broadcast dims) and the
  output (any element strides);
* the iteration space is collapsed by the caller (in the output's memory order); work items
  are (outer index, block of the innermost dim), shared out by the persistent thread team of
  :mod:`.team` (serial below :data:`PARALLEL_MIN` elements), with SIMD inner loops when the
  innermost strides are 1 (data) and 0 or 1 (hoisted registers), and a generic strided loop
  otherwise; a 2-d loop whose hoisted registers are vectors along its rows (the channels
  innermost: a [N, C] input, channels_last) takes :data:`ROWS` rows at a time; bf16 data run
  over pairs of vectors (:func:`paired`).

    >>> import numpy as np
    >>> from l0ops.interpreter import Hoisted
    >>> from l0ops.primitives import FusedAttrs, Instr
    >>> from opgraph.core.dtypes import DataType as D
    >>> body = (Instr(op="sub", args=("in0", "in1"), dtype=D.FLOAT16),
    ...         Instr(op="mul", args=("t0", "t0"), dtype=D.FLOAT16))
    >>> a = FusedAttrs(shape=(2, 2), body=body, result="t1", out_dtype=D.FLOAT16)
    >>> p = plan(a, Hoisted(a, [np.ones((2, 2), np.float16), np.ones((2, 1), np.float16)]))
    >>> [name for name, _ in p.big], p.hoisted
    (['in0'], ('in1',))
    >>> src = render(p)   # t0 rounded to fp16; t1 rounded by the fp16 store itself
    >>> "opg_rnd_f16(r_in0 - r_in1)" in src, "r_t1 = r_t0 * r_t0;" in src
    (True, True)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from l0ops.interpreter import Hoisted
from l0ops.primitives import FusedAttrs, Instr
from opgraph.core.dtypes import DataType
from .c_text import (BF16, C_OP, C_TYPE, F16, F32, FLOATS, HELPERS, LOAD, ROUND, STORE, V_HELPERS,
                     V_LOAD, V_NT, V_NT2, V_OP, V_ROUND, V_ST2, V_STORE)
from .team import C_DECL
from .unsupported import Unsupported

BLOCK = 8192          # elements of the innermost dim per work item
PARALLEL_MIN = 32768  # below this many elements the kernel runs on one thread
GRAIN = 16384         # elements per claim of a parallel kernel (see :mod:`.team`)
STREAM_BYTES = 8 << 20  # outputs this large are written with non-temporal (streaming) stores
ROWS = 4              # rows of a 2-d layout with per-channel vectors computed together


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


def _rounded(p: Plan, k: int, expr: str, rnd: Callable[[DataType, str], str]) -> str:
    """Live instruction ``k``'s value: ``rnd(dtype, expr)``, or ``expr`` where the store rounds."""
    return expr if k == len(p.live) - 1 and store_rounds(p) else rnd(p.live[k][1].dtype, expr)


def _body(p: Plan, load: Callable[[int, str], str]) -> list[str]:
    """Statements computing one element; ``load(operand index, register)`` reads an operand."""
    lines = []
    for k, (r, d) in enumerate(p.big):
        lines.append(f"const float r_{r} = {LOAD[d].format(load(k, r))};")
    for k, r in enumerate(p.hoisted, start=len(p.big)):
        lines.append(f"const float r_{r} = {load(k, r)};")
    for k, (dst, ins) in enumerate(p.live):
        args = [f"r_{r}" for r in ins.args]
        expr = args[0] if ins.op == "cast" else f" {C_OP[ins.op]} ".join(args)
        value = _rounded(p, k, expr, lambda d, e: ROUND[d].format(e))
        lines.append(f"const float r_{dst} = {value};  /* {ins.render(dst)} */")
    out = load(len(p.big) + len(p.hoisted), "")
    lines.append(f"{out} = {STORE[p.out_dtype].format('r_' + p.result)};")
    return lines


def _loop(p: Plan, load: Callable[[int, str], str], pre: list[str], simd: bool,
          vector: "list[str] | None" = None) -> list[str]:
    """The inner loop over ``j < n`` (inside the work-item loop), preceded by ``pre``; an
    optional explicit ``vector`` loop runs first and leaves ``j`` where the scalar loop starts."""
    pad = " " * 12
    lines = [pad + s for s in pre]
    lines.append(pad + "int64_t jv = 0;")
    if vector:
        lines += [pad + s for s in vector]
    if simd:
        lines.append(pad + "#pragma omp simd")
    lines.append(pad + "for (int64_t j = jv; j < n; ++j) {")
    lines += [pad + "    " + s for s in _body(p, load)]
    lines.append(pad + "}")
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


def _simd_block(p: Plan, scalar_h: bool, width: str, vtype: str, load, set1: str,
                op, rnd, quiet: frozenset[int] = frozenset(), pair: str = "") -> list[str]:
    """One explicit SIMD loop of ``width`` lanes; ``load(dtype, ptr)``, ``op(name, args)`` and
    ``rnd(dtype, expr)`` spell the vector operations; live instructions in ``quiet`` round to
    bf16 without the NaN test (see :func:`quiet_bf16`). ``pair`` (a store of two vectors,
    ``{q}``, ``{lo}``, ``{hi}``): first a loop over pairs of vectors (:func:`paired`)."""
    nb, nh = len(p.big), len(p.hoisted)
    lines = ["{"]
    if scalar_h:
        lines += [f"const {vtype} vh{k} = {set1.format(f'h{k}')};" for k in range(nb, nb + nh)]
    lines.append("int64_t j = 0;")
    if pair:
        lines += _pair_loop(p, vtype, op, rnd, quiet, pair, scalar_h)
    lines.append(f"for (; j + {width} <= n; j += {width}) {{")
    for k, (r, d) in enumerate(p.big):
        lines.append(f"    const {vtype} v_{r} = {load(d, f'q{k}')};")
    for k, r in enumerate(p.hoisted, start=nb):
        lines.append(f"    const {vtype} v_{r} = {f'vh{k}' if scalar_h else load(F32, f'q{k}')};")
    lines += _vector_live(p, vtype, lambda r: f"v_{r}", op, rnd, quiet)
    return lines + ["}", "jv = j;", "}"]


def _v_op(name: str, args: list[str]) -> str:
    """Operation ``name`` on float-lane vectors ``args``, spelt in C."""
    return f"{V_OP[name]}({', '.join(args)})"


def _v_round(dtype: DataType, expr: str) -> str:
    """Float-lane vector ``expr`` rounded to ``dtype``, spelt in C."""
    return V_ROUND[dtype].format(expr)


def _pair_loop(p: Plan, vtype: str, op, rnd, quiet: frozenset[int], store: str,
               scalar_h: bool) -> list[str]:
    """The loop over pairs of bf16 vectors (:func:`paired`): the per-channel operands as scalars
    ``vh<k>`` (``scalar_h``) or as vectors in the pairs' lane order, then
    :func:`_pair_statements`."""
    nb = len(p.big)
    lines = ["#if defined(OPG_PAIR)", "for (; j + OPG_PW <= n; j += OPG_PW) {"]
    if not scalar_h:
        lines += _pair_hoisted(p)
    scalars = {r: f"vh{k}" for k, r in enumerate(p.hoisted, start=nb)}
    lines += _pair_statements(p, vtype, op, rnd, quiet, store, "",
                              (lambda r, h: scalars[r]) if scalar_h else _pair_half)
    return lines + ["}", "#endif"]


def _pair_hoisted(p: Plan) -> list[str]:
    """Each per-channel vector as two vectors in a pair's lane order (``v_<r>_a``, ``v_<r>_b``)."""
    nb = len(p.big)
    return [f"    const opg_v v_{r}_a = opg_v_lo_f32(&q{k}[j]), v_{r}_b = opg_v_hi_f32(&q{k}[j]);"
            for k, r in enumerate(p.hoisted, start=nb)]


def _pair_half(r: str, half: str) -> str:
    """Per-channel register ``r``'s vector for pair half ``half`` (see :func:`_pair_hoisted`)."""
    return f"v_{r}_{half}"


def _pair_statements(p: Plan, vtype: str, op, rnd, quiet: frozenset[int], store: str, row: str,
                     per_channel: Callable[[str, str], str]) -> list[str]:
    """One pair of vectors of one row (operand pointers ``q<k><row>``): each full-size input
    loaded once as two vectors (suffixes ``_a``, ``_b``), the live instructions for each, one
    store of both; per-channel register ``r`` in half ``h`` is ``per_channel(r, h)``."""
    nb, nh = len(p.big), len(p.hoisted)
    hoisted = set(p.hoisted)
    lines = []
    for k, (r, _) in enumerate(p.big):
        lines.append(f"    const opg_vi w_{r}{row} = opg_vi_ld(&q{k}{row}[j]);")
        lines.append(f"    const {vtype} v_{r}{row}_a = opg_v_lo_bf16(w_{r}{row}), "
                     f"v_{r}{row}_b = opg_v_hi_bf16(w_{r}{row});")
    for half in "ab":
        def v(r: str, h: str = half) -> str:
            return per_channel(r, h) if r in hoisted else f"v_{r}{row}_{h}"
        lines += _vector_live(p, vtype, v, op, rnd, quiet)
    return lines + ["    " + store.format(q=f"q{nb + nh}{row}", lo=f"v_{p.result}{row}_a",
                                         hi=f"v_{p.result}{row}_b")]


def _vector_live(p: Plan, vtype: str, v: Callable[[str], str], op, rnd,
                 quiet: frozenset[int] = frozenset()) -> list[str]:
    """The live instructions as vector statements (inside a SIMD loop), register ``r`` spelt
    ``v(r)``; ``op``, ``rnd`` and ``quiet`` as for :func:`_simd_block`. A bf16 result only the
    store reads keeps its low half (:func:`store_reads_top`)."""
    lines, top = [], store_reads_top(p)
    for k, (dst, ins) in enumerate(p.live):
        args = [v(r) for r in ins.args]
        expr = args[0] if ins.op == "cast" else op(ins.op, args)
        rk = (lambda d, e: f"opg_v_rnd_bf16_q({e})") if k in quiet else rnd
        if top and k == len(p.live) - 1:
            rk = (lambda d, e: f"opg_v_rnd_bf16_qtop({e})") if k in quiet else \
                (lambda d, e: f"opg_v_rnd_bf16_top({e})")
        lines.append(f"    const {vtype} {v(dst)} = {_rounded(p, k, expr, rk)};")
    return lines


def _rows_block(p: Plan, rows: int) -> list[str]:
    """Explicit SIMD over ``rows`` rows at once (operand pointers ``q<k>_<row>``; the hoisted
    registers ``q<k>`` are the same in every row, so each of their vectors is loaded once for
    all of them): per row the statements of :func:`_simd_block`, in the same order."""
    nb, nh = len(p.big), len(p.hoisted)
    hoisted = set(p.hoisted)
    lines = ["int64_t j = 0;"]
    if paired(p):  # pairs of vectors first, each per-channel pair loaded once for all the rows
        lines += ["#if defined(OPG_PAIR)", "for (; j + OPG_PW <= n; j += OPG_PW) {"] + _pair_hoisted(p)
        for i in range(rows):
            lines += _pair_statements(p, "opg_v", _v_op, _v_round, frozenset(), V_ST2,
                                      f"_{i}", _pair_half)
        lines += ["}", "#endif"]
    lines.append("for (; j + OPG_W <= n; j += OPG_W) {")
    lines += [f"    const opg_v v_{r} = opg_v_ld_f32(&q{k}[j]);" for k, r in enumerate(p.hoisted, start=nb)]
    for i in range(rows):
        def v(r: str, i: int = i) -> str:
            return f"v_{r}" if r in hoisted else f"v_{r}_{i}"
        lines += [f"    const opg_v {v(r)} = {V_LOAD[d].format(f'q{k}_{i}')};" for k, (r, d) in enumerate(p.big)]
        lines += _vector_live(p, "opg_v", v, _v_op, _v_round)
        lines.append("    " + V_STORE[p.out_dtype].format(f"q{nb + nh}_{i}", v(p.result)))
    return lines + ["}", "jv = j;"]


def _quiet_or_not(block: Callable[[frozenset[int]], list[str]], p: Plan, scalar_h: bool) -> list[str]:
    """``block(quiet)`` for rows where :func:`quiet_bf16` applies (``quiet_row``), else
    ``block(frozenset())``; just the latter when no instruction qualifies."""
    quiet = quiet_bf16(p) if scalar_h else frozenset()
    if not quiet:
        return block(frozenset())
    return ["if (quiet_row)"] + block(quiet) + ["else"] + block(frozenset())


def _vector_loop(p: Plan, scalar_h: bool) -> list[str]:
    """Explicit SIMD for f16/bf16 bodies: native AVX-512 FP16 arithmetic (32 lanes) for pure-f16
    bodies with per-channel scalars, else float lanes (16 or 8) with the same roundings."""
    nb, nh = len(p.big), len(p.hoisted)
    store_f = V_STORE[p.out_dtype].format(f"q{nb + nh}", f"v_{p.result}")

    def float_lanes(quiet: frozenset[int]) -> list[str]:
        flt = _simd_block(p, scalar_h, "OPG_W", "opg_v", lambda d, q: V_LOAD[d].format(q),
                          "opg_v_set1({})", _v_op, _v_round, quiet,
                          V_ST2 if paired(p) else "")
        flt.insert(-3, "    " + store_f)
        return flt
    flt = _quiet_or_not(float_lanes, p, scalar_h)
    lines = []
    if scalar_h and pure_half(p):
        half = _simd_block(p, scalar_h, "32", "__m512h", lambda d, q: f"_mm512_loadu_ph(&{q}[j])",
                           "_mm512_set1_ph((_Float16){})",
                           lambda o, a: f"_mm512_{o}_ph({', '.join(a)})", lambda d, e: e)
        half.insert(-3, f"    _mm512_storeu_ph(&q{nb + nh}[j], v_{p.result});")
        lines += ["#if defined(__AVX512FP16__)"] + half + ["#elif defined(OPG_VEC)"]
    else:
        lines.append("#if defined(OPG_VEC)")
    return lines + flt + ["#endif"]


def _stream_loop(p: Plan, load: Callable[[int, str], str]) -> list[str]:
    """Float lanes with non-temporal stores (``c->stream``: outputs larger than the caches): a
    scalar peel up to the output's vector alignment, the vector loop, ``jv`` left for the tail."""
    nb, nh = len(p.big), len(p.hoisted)
    q = f"q{nb + nh}"
    width = "OPG_PW" if paired(p) else "OPG_W"  # a pair's store is as aligned as the pair
    peel = [f"for (; j < n && ((uintptr_t)&{q}[j] & ({width} * sizeof(*{q}) - 1)); ++j) {{"]
    peel += ["    " + t for t in _body(p, load)] + ["}"]

    def streamed(quiet: frozenset[int]) -> list[str]:
        blk = _simd_block(p, True, "OPG_W", "opg_v", lambda d, x: V_LOAD[d].format(x),
                          "opg_v_set1({})", _v_op, _v_round, quiet,
                          V_NT2 if paired(p) else "")
        blk.insert(-3, "    " + V_NT[p.out_dtype].format(q, f"v_{p.result}"))
        at = blk.index("int64_t j = 0;") + 1
        return blk[:at] + peel + blk[at:]
    return ["#if defined(OPG_VEC)", "if (c->stream) {"] + _quiet_or_not(streamed, p, True) + ["}", "#endif"]


@functools.lru_cache(maxsize=256)
def render(p: Plan) -> str:
    """C source of ``void opg_kernel(ndim, shape, ptrs, strides, block, run)`` for plan ``p``.

    ``ptrs`` lists big inputs, hoisted registers, then the output; ``strides[k*ndim + d]`` is the
    element stride of operand ``k`` in dim ``d`` (0 where broadcast). Work items are (outer index,
    ``block`` of the innermost dim); with ``run`` (:func:`.team.runner`, may be NULL) and at least
    :data:`PARALLEL_MIN` elements they are shared out in claims of about :data:`GRAIN` elements.
    """
    nb, nh = len(p.big), len(p.hoisted)
    nops = nb + nh + 1
    ctypes_ = [C_TYPE[d] for _, d in p.big] + ["float"] * nh + [C_TYPE[p.out_dtype]]
    out = [HELPERS, V_HELPERS, C_DECL, f"/* {len(p.live)} live instructions; result {p.result}: "
                                       f"{p.out_dtype.short} */",
           "struct opg_ctx { int64_t ndim, nblk, block, stream; const int64_t *shape, *st; void *const *ptrs; };",
           "",
           "static void opg_items(void *vctx, int64_t w_begin, int64_t w_end)", "{",
           "    const struct opg_ctx *const c = (const struct opg_ctx *)vctx;",
           "    const int64_t ndim = c->ndim, nblk = c->nblk, block = c->block;",
           "    const int64_t *const shape = c->shape, *const st = c->st;",
           "    void *const *const ptrs = c->ptrs;",
           "    const int64_t inner = shape[ndim - 1];"]
    for k, t in enumerate(ctypes_):
        const = "" if k == nops - 1 else "const "
        out.append(f"    {const}{t} *const b{k} = ({const}{t} *)ptrs[{k}];")
        out.append(f"    const int64_t *const s{k} = st + {k} * ndim;")
    big_ops = [k for k in range(nops) if not nb <= k < nb + nh]  # the data inputs and the output
    dense = [f"s{k}[ndim - 1] == 1" for k in big_ops]
    bcast = [f"s{k}[ndim - 1] == 0" for k in range(nb, nb + nh)]
    vec = [f"s{k}[ndim - 1] == 1" for k in range(nb, nb + nh)]
    out.append(f"    const int scalar_h = {' && '.join(dense + bcast)};")
    out.append(f"    const int vector_h = {' && '.join(dense + vec)};")
    # rows of a 2-d layout with per-channel vectors (BatchNorm1d's [N, C]): a row is a few
    # vectors of work, so nothing but the rows' pointers per item, and ROWS rows at a time
    # sharing each load of a per-channel vector (the loads, not the arithmetic, bound this loop)
    def decl(k: int, name: str, value: str) -> str:  # operand k's pointer (the output's writable)
        return f"{'' if k == nops - 1 else 'const '}{ctypes_[k]} *const {name} = {value};"

    def row(k: int, suffix: str, index: str) -> str:  # operand k's pointer in row ``index``
        return decl(k, f"q{k}{suffix}", f"b{k} + {index} * s{k}[0]")
    hoisted_rows = " && ".join(f"s{k}[0] == 0" for k in range(nb, nb + nh)) or "1"
    out += [f"    if (ndim == 2 && nblk == 1 && vector_h && {hoisted_rows}) {{",
            "        const int64_t n = inner;",
            "        int64_t w = w_begin;",
            "#if defined(OPG_VEC)",
            f"        for (; w + {ROWS} <= w_end; w += {ROWS}) {{",
            "            " + " ".join(row(k, f"_{i}", f"(w + {i})") for i in range(ROWS) for k in big_ops),
            "            " + " ".join(f"const float *const q{k} = b{k};" for k in range(nb, nb + nh)),
            "            int64_t jv = 0;",
            "            {"]
    out += ["                " + s for s in _rows_block(p, ROWS)]
    out += ["            }"]
    for i in range(ROWS):  # each row's tail past the last whole vector
        out += ["            {", "                " + " ".join(
            decl(k, f"q{k}", f"q{k}_{i}") for k in big_ops)]
        out += ["                for (int64_t j = jv; j < n; ++j) {"]
        out += ["                    " + s for s in _body(p, lambda k, r: f"q{k}[j]")]
        out += ["                }", "            }"]
    out += ["        }", "#endif",
            "        for (; w < w_end; ++w) {",
            "            " + " ".join(row(k, "", "w") for k in range(nops))]
    out += _loop(p, lambda k, r: f"q{k}[j]", [], simd=True,
                 vector=_vector_loop(p, False) if needs_vector(p) else None)
    out += ["        }", "        return;", "    }"]
    # the row of item w_begin by division once; later rows by an odometer (a 64-bit division
    # costs ~40 cycles, and a row of a 2-d layout can be a few vectors of work)
    out += ["    int64_t idx[ndim], blk = w_begin % nblk;  /* ndim >= 1 */",
            f"    int64_t {', '.join(f'g{k} = 0' for k in range(nops))};",
            "    {",
            "        int64_t rem = w_begin / nblk;",
            "        for (int64_t d = ndim - 2; d >= 0; --d) {",
            "            idx[d] = rem % shape[d];",
            "            rem /= shape[d];",
            "            " + " ".join(f"g{k} += idx[d] * s{k}[d];" for k in range(nops)),
            "        }",
            "    }",
            "    for (int64_t w = w_begin; w < w_end; ++w) {",
            "        const int64_t j0 = blk * block;",
            "        const int64_t n = inner - j0 < block ? inner - j0 : block;",
            f"        const int64_t {', '.join(f'f{k} = g{k} + j0 * s{k}[ndim - 1]' for k in range(nops))};"]
    out.append("        " + " ".join(decl(k, f"q{k}", f"b{k} + f{k}") for k in range(nops)))
    scalar_pre = [f"const float h{k} = q{k}[0];" for k in range(nb, nb + nh)]
    if quiet_bf16(p):
        dirty = " | ".join(f"opg_low_nan(h{k})" for k in range(nb, nb + nh)) or "0"
        scalar_pre.append(f"const int quiet_row = !({dirty});  /* see quiet_bf16 */")

    def dense_load(scalar: bool) -> Callable[[int, str], str]:
        return lambda k, r: f"h{k}" if scalar and nb <= k < nb + nh else f"q{k}[j]"

    vec = needs_vector(p)
    out.append("        if (scalar_h) {")
    stream = _stream_loop(p, dense_load(True))
    normal = _vector_loop(p, True) if vec else []
    out += _loop(p, dense_load(True), scalar_pre, simd=True,
                 vector=stream[:-1] + (["else"] if normal else []) + normal + stream[-1:])
    out.append("        } else if (vector_h) {")
    out += _loop(p, dense_load(False), [], simd=True, vector=_vector_loop(p, False) if vec else None)
    out.append("        } else {")
    strided = [f"const int64_t i{k} = s{k}[ndim - 1];" for k in range(nops)]
    out += _loop(p, lambda k, r: f"q{k}[j * i{k}]", strided, simd=False)
    out += ["        }",
            "        if (++blk == nblk) {  /* the next row: carry through the outer dims */",
            "            blk = 0;",
            "            for (int64_t d = ndim - 2; d >= 0; --d) {",
            "                " + " ".join(f"g{k} += s{k}[d];" for k in range(nops)),
            "                if (++idx[d] < shape[d]) break;",
            "                idx[d] = 0;",
            "                " + " ".join(f"g{k} -= shape[d] * s{k}[d];" for k in range(nops)),
            "            }",
            "        }",
            "    }",
            "#if defined(OPG_VEC)",
            "    if (c->stream) _mm_sfence();  /* order the non-temporal stores before returning */",
            "#endif", "}", "",
            "void opg_kernel(int64_t ndim, const int64_t *shape, void *const *ptrs,",
            "                const int64_t *st, int64_t block, opg_run run)", "{",
            "    const int64_t inner = shape[ndim - 1];",
            "    int64_t outer = 1;",
            "    for (int64_t d = 0; d + 1 < ndim; ++d) outer *= shape[d];",
            "    const int64_t nblk = (inner + block - 1) / block, work = outer * nblk;",
            f"    const int64_t stream = outer * inner * (int64_t)sizeof({C_TYPE[p.out_dtype]}) >= {STREAM_BYTES};",
            "    const struct opg_ctx c = {ndim, nblk, block, stream, shape, st, ptrs};",
            f"    if (run == 0 || work < 2 || outer * inner < {PARALLEL_MIN}) {{",
            "        opg_items((void *)&c, 0, work);",
            "        return;",
            "    }",
            "    const int64_t item = inner < block ? inner : block;",
            f"    run(opg_items, (void *)&c, work, item >= {GRAIN} ? 1 : {GRAIN} / item);",
            "}", ""]
    return "\n".join(out)

