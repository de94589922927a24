"""The explicit SIMD loops of the native element-wise kernels, as C statements for
:func:`.render.render`: float lanes (``opg_v``, 16 or 8 of them) over f16/bf16 data with the
reference's roundings, native fp16 lanes where the body is pure fp16 arithmetic, pairs of bf16
vectors (:func:`.kernel_plan.paired`), rows of a channels-innermost layout computed together,
the non-temporal loop for outputs larger than the caches, and the edges of a row (the streamed
loop's alignment peel and the tail past the last whole vector) as whole vectors of which only
the lanes due are stored (:func:`vector_edge`); short rows that follow one another run as one
run per claim (:func:`short_rows`, :func:`tiny_rows`).

    >>> import numpy as np
    >>> from l0ops.interpreter import Hoisted
    >>> from l0ops.primitives import FusedAttrs, Instr
    >>> from opgraph.core.dtypes import DataType as D
    >>> from .kernel_plan import plan
    >>> body = (Instr(op="cast", args=("in0",), dtype=D.FLOAT),
    ...         Instr(op="sub", args=("t0", "in1"), dtype=D.FLOAT),
    ...         Instr(op="cast", args=("t1",), dtype=D.BF16))
    >>> a = FusedAttrs(shape=(2, 8), body=body, result="t2", out_dtype=D.BF16)
    >>> p = plan(a, Hoisted(a, [np.ones((2, 8), "bfloat16"), np.ones((2, 1), np.float32)]))
    >>> any("opg_v_st2_bf16(&q2[j]" in line for line in vector_loop(p, scalar_h=True))
    True
"""
from __future__ import annotations

from typing import Callable

from opgraph.core.dtypes import DataType
from .c_text import C_TYPE, F16, F32, V_LOAD, V_NT, V_NT2, V_OP, V_ROUND, V_ST2, V_STORE, V_STORE_TO
from .kernel_plan import (Plan, needs_vector, paired, pure_half, quiet_bf16, rounded, scalar_body,
                          store_reads_top)


SHORT_ROW = 512  # rows up to this many elements run as one run per claim (short_rows)


def _simd_block(p: Plan, scalar_h: bool, width: str, vtype: str, load, set1: str,
                op, rnd, quiet: frozenset[int] = frozenset(), pair: str = "",
                start: str = "jv", end: str = "n") -> list[str]:
    """One explicit SIMD loop of ``width`` lanes from ``j = start`` while a vector fits before
    ``end``; ``load(dtype, ptr)``, ``op(name, args)`` and ``rnd(dtype, expr)`` spell the vector
    operations; live instructions in ``quiet`` round to bf16 without the NaN test (see
    :func:`quiet_bf16`). ``pair`` (a store of two vectors, ``{q}``, ``{lo}``, ``{hi}``): first a
    loop over pairs of vectors (:func:`paired`)."""
    nb, nh = len(p.big), len(p.hoisted)
    lines = ["{"]
    if scalar_h:
        lines += [f"const {vtype} vh{k} = {set1.format(f'h{k}')};" for k in range(nb, nb + nh)]
    lines.append(f"int64_t j = {start};")
    if pair:
        lines += _pair_loop(p, vtype, op, rnd, quiet, pair, scalar_h, end)
    lines.append(f"for (; j + {width} <= {end}; j += {width}) {{")
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
               scalar_h: bool, end: str) -> list[str]:
    """The loop over pairs of bf16 vectors (:func:`paired`) while a pair fits before ``end``:
    the per-channel operands as scalars ``vh<k>`` (``scalar_h``) or as vectors in the pairs' lane
    order, then :func:`_pair_statements`."""
    nb = len(p.big)
    lines = ["#if defined(OPG_PAIR)", f"for (; j + OPG_PW <= {end}; j += OPG_PW) {{"]
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
        lines.append(f"    const {vtype} {v(dst)} = {rounded(p, k, expr, rk)};")
    return lines


def rows_block(p: Plan, rows: int, streamed: bool = False) -> list[str]:
    """Explicit SIMD over ``rows`` rows at once (operand pointers ``q<k>_<row>``; the hoisted
    registers ``q<k>`` are the same in every row, so each of their vectors is loaded once for
    all of them): per row the statements of :func:`_simd_block`, in the same order.
    ``streamed``: the stores non-temporal (for rows of whole cache lines only: a row's end and
    the next row's start then never share a line)."""
    nb, nh = len(p.big), len(p.hoisted)
    hoisted = set(p.hoisted)
    store, store2 = (V_NT, V_NT2) if streamed else (V_STORE, V_ST2)
    lines = ["int64_t j = 0;"]
    if paired(p):  # pairs of vectors first, each per-channel pair loaded once for all the rows
        lines += ["#if defined(OPG_PAIR)", "for (; j + OPG_PW <= n; j += OPG_PW) {"] + _pair_hoisted(p)
        for i in range(rows):
            lines += _pair_statements(p, "opg_v", _v_op, _v_round, frozenset(), store2,
                                      f"_{i}", _pair_half)
        lines += ["}", "#endif"]
    lines.append("for (; j + OPG_W <= n; j += OPG_W) {")
    lines += [f"    const opg_v v_{r} = opg_v_ld_f32(&q{k}[j]);" for k, r in enumerate(p.hoisted, start=nb)]
    for i in range(rows):
        def v(r: str, i: int = i) -> str:
            return f"v_{r}" if r in hoisted else f"v_{r}_{i}"
        lines += [f"    const opg_v {v(r)} = {V_LOAD[d].format(f'q{k}_{i}')};" for k, (r, d) in enumerate(p.big)]
        lines += _vector_live(p, "opg_v", v, _v_op, _v_round)
        lines.append("    " + store[p.out_dtype].format(f"q{nb + nh}_{i}", v(p.result)))
    return lines + ["}", "jv = j;"]


def _quiet_or_not(block: Callable[[frozenset[int]], list[str]], p: Plan, scalar_h: bool) -> list[str]:
    """``block(quiet)`` for rows where :func:`quiet_bf16` applies (``quiet_row``), else
    ``block(frozenset())``; just the latter when no instruction qualifies."""
    quiet = quiet_bf16(p) if scalar_h else frozenset()
    if not quiet:
        return block(frozenset())
    return ["if (quiet_row)"] + block(quiet) + ["else"] + block(frozenset())


def vector_loop(p: Plan, scalar_h: bool) -> list[str]:
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


def stream_loop(p: Plan, load: Callable[[int, str], str]) -> list[str]:
    """Float lanes with non-temporal stores (``c->stream``: outputs larger than the caches) over
    the row's whole cache lines: a peel up to the first line boundary (:func:`_aligning_peel`),
    then the vector loops up to the last, ``jv`` left there for :func:`vector_loop` (ordinary
    stores) and the tail. A part of a line written non-temporally and the rest by ordinary
    stores (a row's end, and the next row's start) costs a partial write to memory: 3× the
    kernel's time on rows of 196 bf16 (14×14)."""
    q = f"q{len(p.big) + len(p.hoisted)}"
    peel = _aligning_peel(p, load) + [
        f"const int64_t nl = j + (int64_t)((((uint64_t)(n - j) * sizeof(*{q})) & ~(uint64_t)(OPG_LINE - 1)) / sizeof(*{q}));"]

    def streamed(quiet: frozenset[int]) -> list[str]:
        blk = _simd_block(p, True, "OPG_W", "opg_v", lambda d, x: V_LOAD[d].format(x),
                          "opg_v_set1({})", _v_op, _v_round, quiet,
                          V_NT2 if paired(p) else "", start="0", end="nl")
        blk.insert(-3, "    " + V_NT[p.out_dtype].format(q, f"v_{p.result}"))
        at = blk.index("int64_t j = 0;") + 1
        return blk[:at] + peel + blk[at:]
    return ["#if defined(OPG_VEC)", "if (c->stream) {"] + _quiet_or_not(streamed, p, True) + ["}", "#endif"]


def _aligning_peel(p: Plan, load: Callable[[int, str], str]) -> list[str]:
    """From ``j`` up to the first element of the output at a cache line boundary: whole vectors
    of which only the lanes before it are stored (:func:`vector_edge`), one element at a time
    where less than a vector is left, or all one at a time in a float32 body (whose scalar
    steps cost less than a vector's round trip through memory). Per-channel operands are scalars
    (``h<k>``)."""
    q = f"q{len(p.big) + len(p.hoisted)}"
    if not needs_vector(p):  # float32 throughout: its scalar steps cost less than the copy
        return ([f"for (; j < n && ((uintptr_t)&{q}[j] & (OPG_LINE - 1)); ++j) {{"]
                + ["    " + t for t in scalar_body(p, load)] + ["}"])
    return ([f"while (j < n && ((uintptr_t)&{q}[j] & (OPG_LINE - 1))) {{",
             "    if (j + OPG_W > n) {"] + ["        " + t for t in scalar_body(p, load)]
            + ["        ++j;", "        continue;", "    }",
               f"    int64_t a = (int64_t)((OPG_LINE - ((uintptr_t)&{q}[j] & (OPG_LINE - 1))) / sizeof(*{q}));",
               "    a = a < 1 ? 1 : a > OPG_W ? OPG_W : a;  /* an output not aligned to its element: 1 */",
               "    {"] + ["        " + t for t in vector_edge(p, True, "0", "a")]
            + ["    }", "    j += a;", "}"])


def vector_tail(p: Plan, scalar_h: bool, start: str) -> list[str]:
    """Elements ``start`` to ``n - 1`` of a row, when fewer than a vector are left past the
    vector loops but at least :func:`_tail_lanes`, as the last whole vector of the row,
    ``j = n - OPG_W``, of which only those lanes are stored (:func:`vector_edge`); ``start`` is
    then set to ``n``. The rest (rows shorter than a vector, and more than a vector left when no
    vector loop ran) is left to the scalar loop."""
    return ([f"if ({start} + {_tail_lanes(p)} <= n && n - {start} < OPG_W && n >= OPG_W) {{",
             "    const int64_t j = n - OPG_W;"]
            + ["    " + t for t in vector_edge(p, scalar_h, f"{start} - j", "OPG_W")]
            + [f"    {start} = n;", "}"])


def _tail_lanes(p: Plan) -> int:
    """The fewest lanes left for which a whole vector beats the scalar loop: 2 where the body
    loads, rounds or stores fp16 (a scalar fp16 rounding is a dozen integer steps), else 8
    (measured on rows of 7×7 to 31×31 maps, AVX-512)."""
    f16 = p.out_dtype == F16 or any(d == F16 for _, d in p.big) or any(i.dtype == F16 for _, i in p.live)
    return 2 if f16 else 8


def vector_edge(p: Plan, scalar_h: bool, first: str, end: str) -> list[str]:
    """One vector of float lanes computed at ``j`` (the full-size operands loaded from
    ``&q<k>[j]``; per-channel ones the scalars ``h<k>`` if ``scalar_h``, else loaded too) of which
    lanes ``first`` to ``end - 1`` are stored, through a local array: the lanes left out are
    neither written nor read back, so an output that is also an input stays correct (each lane
    reads only its own elements, and those not yet written), and no load passes the row's end
    (the caller keeps ``j + OPG_W <= n``). The roundings are the NaN-tested ones: right in any row."""
    nb, out = len(p.big), p.out_dtype
    lines = [f"const opg_v v_{r} = {V_LOAD[d].format(f'q{k}')};" for k, (r, d) in enumerate(p.big)]
    lines += [f"const opg_v v_{r} = {f'opg_v_set1(h{k})' if scalar_h else V_LOAD[F32].format(f'q{k}')};"
              for k, r in enumerate(p.hoisted, start=nb)]
    lines += [t.strip() for t in _vector_live(p, "opg_v", lambda r: f"v_{r}", _v_op, _v_round)]
    return lines + [f"{C_TYPE[out]} opg_lanes[OPG_W];", V_STORE_TO[out].format("opg_lanes", f"v_{p.result}"),
                    f"for (int64_t e = {first}; e < {end}; ++e) q{nb + len(p.hoisted)}[j + e] = opg_lanes[e];"]


def rows_follow(p: Plan, big_ops: list[int]) -> str:
    """C: the kernel's rows follow one another in every full-size operand and the output (each
    ``inner`` elements at stride 1), with per-channel scalars indexed by the row's channel
    (dim ``ndim - 2``): an NCHW tensor's ``[N, C, H·W]``, or ``[C, H·W]`` for one image."""
    nb, nh = len(p.big), len(p.hoisted)
    ok = [f"s{k}[ndim - 1] == 1 && s{k}[ndim - 2] == inner && (ndim == 2 || s{k}[0] == shape[1] * inner)"
          for k in big_ops]
    ok += [f"s{k}[ndim - 1] == 0 && s{k}[ndim - 2] == 1 && (ndim == 2 || s{k}[0] == 0)" for k in range(nb, nb + nh)]
    return "(ndim == 2 || ndim == 3) && " + " && ".join(f"({t})" for t in ok)


def tiny_table(p: Plan, big_ops: list[int], nops: int) -> list[str]:
    """``hx`` and its period ``hp`` (for ``opg_kernel``, before its items run; NULL and 0 where
    not needed or not allocated): where rows of at most a vector follow one another, each
    per-channel operand's values along one period of the data, then its first ``OPG_W`` again,
    so that the lanes of a vector from any element are one load (:func:`tiny_rows`):

    * an NCHW tensor's small maps (:func:`rows_follow`): a period of ``C`` rows, ``C·inner``
      floats, each channel's value repeated ``inner`` times;
    * channels innermost (a 2-d ``[N, C]`` input with fewer channels than four vectors' lanes,
      where the rows' own loop leaves a scalar tail a row): a period of one row, the ``C`` values
      in order ([100000, 20] bf16 0.77–0.81 → 0.27 ms, fp32 0.46 → 0.33 ms).

    Only where the data hold at least two tables' worth of elements: a tensor of a period or
    so (one image; [1, 2, 4]) costs less by rows than the table's malloc and filling (~0.2 µs of
    a 10 µs cached call at [1, 2, 4]; 8×64×3×3 bf16 takes 19 µs with the table, 34 by rows).
    Free it after the items. The ``nops`` operands' strides (``s<k>``) are declared here, in the
    vector build: nothing else in ``opg_kernel`` reads them (unused variables otherwise)."""
    nb, nh = len(p.big), len(p.hoisted)
    if not nh:
        return ["float *const hx = 0;", "const int64_t hp = 0;"]
    innermost = [f"s{k}[1] == 1 && s{k}[0] == inner" for k in big_ops]
    innermost += [f"s{k}[1] == 1 && s{k}[0] == 0" for k in range(nb, nb + nh)]
    lines = ["float *hx = 0;", "int64_t hp = 0;  /* the period */",
             "#if defined(OPG_VEC)", "int64_t per = 1;  /* elements per value */",
             " ".join(f"const int64_t *const s{k} = st + {k} * ndim;" for k in range(nops)),
             f"if (inner <= OPG_W && {rows_follow(p, big_ops)}) {{",
             "    hp = shape[ndim - 2] * inner;",
             "    per = inner;",
             "} else if (inner < 4 * OPG_W && ndim == 2 && " + " && ".join(f"({t})" for t in innermost) + ")",
             "    hp = inner;",
             "if (outer * inner < 2 * (hp + OPG_W)) hp = 0;  /* a table not worth its filling */",
             "if (hp) hx = (float *)malloc(sizeof(float) * " + str(nh) + " * (hp + OPG_W));",
             "for (int64_t e = 0; hx && e < hp + OPG_W; ++e) {",
             "    const int64_t at = e % hp / per;"]
    lines += [f"    hx[{i} * (hp + OPG_W) + e] = ((const float *)ptrs[{k}])[at];"
              for i, k in enumerate(range(nb, nb + nh))]
    return lines + ["}", "#endif"]


def tiny_rows(p: Plan, big_ops: list[int], decl: Callable[[int, str, str], str]) -> list[str]:
    """A claim's rows as one run where they are short and the table of :func:`tiny_table` was
    built (``c->hx``): run by row, a row of at most a vector would go one element at a time
    with the row's set-up (3×3 maps: 51× the floor in bf16, 185× in fp16; a 2-d [N, 10] input
    34× and 172×). A vector spans several rows; its per-channel lanes are one load from the
    table at the run's place in its period. See :func:`_one_run`."""
    return _one_run(p, big_ops, decl, tiny=True) if p.hoisted else []


def short_rows(p: Plan, big_ops: list[int], decl: Callable[[int, str, str], str]) -> list[str]:
    """A claim's rows as one run where they are longer than a vector, up to :data:`SHORT_ROW`
    elements (maps of 5×5 to 22×22 on AVX-512), and follow one another (:func:`rows_follow`):
    run by row, each would pay its set-up, a partial vector and a scalar tail. A vector holds
    the end of one row and the start of the next, its per-channel lanes split between the two
    rows' values (``opg_v_split``). (The table of :func:`tiny_rows` is slower on such rows: 0.26
    against 0.23 ms on 7×7 bf16, 0.37 against 0.19 fp32; on 4×4 it is faster, 0.28 against
    0.32.) See :func:`_one_run`."""
    return _one_run(p, big_ops, decl, tiny=False) if p.hoisted else []


def _one_run(p: Plan, big_ops: list[int], decl: Callable[[int, str, str], str], tiny: bool) -> list[str]:
    """The C of :func:`tiny_rows` (``tiny``) or :func:`short_rows`: the claim's rows as one run
    of ``L`` elements from ``b<k> + w_begin * inner``. Streamed (``c->stream``), the run's whole
    cache lines are stored non-temporally. The roundings are the NaN-tested ones.
    ``decl(k, name, value)`` declares operand ``k``'s pointer; ``big_ops`` are the full-size
    operands and the output."""
    nb, nh = len(p.big), len(p.hoisted)
    hoisted, q = range(nb, nb + nh), f"q{nb + nh}"
    if tiny:  # one element's per-channel values from the table too
        element = ["    const int64_t at = (w_begin * inner + j) % P;"]
        element += [f"    const float h{k} = hx{k}[at];" for k in hoisted]
    else:  # its channel by division
        element = ["    const int64_t cj = (w_begin + j / inner) % C;"]
        element += [f"    const float h{k} = b{k}[cj];" for k in hoisted]
    element += ["    " + t for t in scalar_body(p, lambda k, r: f"h{k}" if nb <= k < nb + nh else f"q{k}[j]")]
    when = "c->hx && nblk == 1" if tiny else \
        f"nblk == 1 && inner > OPG_W && inner <= {SHORT_ROW} && {rows_follow(p, big_ops)}"
    lines = ["#if defined(OPG_VEC)", f"if ({when}) {{",
             "    const int64_t L = (w_end - w_begin) * inner;",
             "    " + " ".join(decl(k, f"q{k}", f"b{k} + w_begin * inner") for k in big_ops)]
    if tiny:
        lines += ["    const int64_t P = c->hp;"]
        lines += [f"    const float *const hx{k} = c->hx + {i} * (P + OPG_W);" for i, k in enumerate(hoisted)]
    else:
        lines += ["    const int64_t C = shape[ndim - 2];"]
    lines += ["    int64_t j = 0, nl = 0;  /* non-temporal stores below nl: the run's whole lines */",
              "    if (c->stream) {",
              f"        for (; j < L && ((uintptr_t)&{q}[j] & (OPG_LINE - 1)); ++j) {{"]
    lines += ["    " + t for t in element] + ["        }"]
    lines += [f"        nl = j + (int64_t)((((uint64_t)(L - j) * sizeof(*{q})) & ~(uint64_t)(OPG_LINE - 1)) / sizeof(*{q}));",
              "    }"]
    if tiny:  # the place in the table's period, one load a per-channel vector
        lines += ["    int64_t o = (w_begin * inner + j) % P;"]
        per_channel = [f"        const opg_v v_{r} = opg_v_ld_f32(&hx{k}[o]);" for k, r in zip(hoisted, p.hoisted)]
        step = ["        o += OPG_W;", "        while (o >= P) o -= P;"]
    else:  # the rows' channels, each vector's lanes split where a row ends inside it
        lines += ["    int64_t ch = (w_begin + j / inner) % C, chn = ch + 1 == C ? 0 : ch + 1;",
                  "    int64_t left = inner - j % inner;  /* lanes left in row ch */"]
        lines += [f"    opg_v hc{k} = opg_v_set1(b{k}[ch]), hn{k} = opg_v_set1(b{k}[chn]);" for k in hoisted]
        per_channel = ["        const int whole = left >= OPG_W;"]
        per_channel += [f"        const opg_v v_{r} = whole ? hc{k} : opg_v_split(hc{k}, hn{k}, left);"
                        for k, r in zip(hoisted, p.hoisted)]
        step = ["        left -= OPG_W;",
                "        if (left <= 0) {  /* the next vector starts in row chn */",
                "            ch = chn;", "            chn = chn + 1 == C ? 0 : chn + 1;", "            left += inner;"]
        step += [f"            hc{k} = hn{k};" for k in hoisted]
        step += [f"            hn{k} = opg_v_set1(b{k}[chn]);" for k in hoisted] + ["        }"]
    lines += ["    for (; j + OPG_W <= L; j += OPG_W) {"]
    lines += [f"        const opg_v v_{r} = {V_LOAD[d].format(f'q{k}')};" for k, (r, d) in enumerate(p.big)]
    lines += per_channel
    lines += ["    " + t for t in _vector_live(p, "opg_v", lambda r: f"v_{r}", _v_op, _v_round)]
    lines += [f"        if (j + OPG_W <= nl) {V_NT[p.out_dtype].format(q, f'v_{p.result}')}",
              f"        else {V_STORE[p.out_dtype].format(q, f'v_{p.result}')}"] + step
    lines += ["    }", "    for (; j < L; ++j) {"] + element + ["    }"]
    return lines + ["    if (c->stream) _mm_sfence();", "    return;", "}", "#endif"]


__all__ = ["SHORT_ROW", "rows_block", "rows_follow", "short_rows", "stream_loop", "tiny_rows",
           "tiny_table", "vector_edge", "vector_loop", "vector_tail"]
