"""Render the per-element part of a FusedElementwise body as one C kernel.

:func:`plan` (:mod:`.kernel_plan`) splits a body with :class:`l0ops.interpreter.Hoisted` (the
per-channel part is evaluated once in numpy) and checks that the rest is float arithmetic the
kernel supports; :func:`render` turns the plan into C source, its explicit SIMD loops spelt by
:mod:`.simd`. The kernel makes one pass over the data:

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
  innermost: a [N, C] input, channels_last) takes :data:`ROWS` rows at a time, and short rows
  that follow one another in memory run as one run per claim (:func:`.simd.short_rows`,
  :func:`.simd.tiny_rows`); bf16 data run over pairs of vectors (:func:`paired`); outputs of
  :data:`STREAM_BYTES` and more are stored non-temporally over whole cache lines.

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
from typing import Callable

from .c_text import C_TYPE, HELPERS, V_HELPERS
from .kernel_plan import Plan, needs_vector, paired, plan, quiet_bf16, scalar_body, store_reads_top
from .simd import rows_block, short_rows, stream_loop, tiny_rows, tiny_table, vector_loop, vector_tail
from .team import C_DECL

BLOCK = 8192          # elements of the innermost dim per work item
PARALLEL_MIN = 32768  # below this many elements the kernel runs on one thread
GRAIN = 16384         # elements per claim of a parallel kernel (see :mod:`.team`)
STREAM_BYTES = 8 << 20  # outputs this large are written with non-temporal (streaming) stores
ROWS = 4              # rows of a 2-d layout with per-channel vectors computed together


def _loop(p: Plan, load: Callable[[int, str], str], pre: list[str], simd: bool,
          vector: "list[str] | None" = None, scalar_h: bool = True) -> list[str]:
    """The inner loop over ``j < n`` (inside the work-item loop), preceded by ``pre``; an
    optional explicit ``vector`` loop runs first and leaves ``j`` where the rest starts: for
    f16/bf16 data the row's last vector, of which the lanes left are stored
    (:func:`.simd.vector_tail`; per-channel operands scalars if ``scalar_h``), else (and in rows
    shorter than a vector) the scalar loop."""
    pad = " " * 12
    lines = [pad + s for s in pre]
    lines.append(pad + "int64_t jv = 0;")
    if vector:
        lines += [pad + s for s in vector]
    if vector and needs_vector(p):  # a float32 body's scalar steps cost less than the copy
        lines += [pad + s for s in ["#if defined(OPG_VEC)"] + vector_tail(p, scalar_h, "jv") + ["#endif"]]
    if simd:  # (guarded: a compile without -fopenmp would warn of an unknown pragma)
        lines += [pad + "#if defined(_OPENMP)", pad + "#pragma omp simd", pad + "#endif"]
    lines.append(pad + "for (int64_t j = jv; j < n; ++j) {")
    lines += [pad + "    " + s for s in scalar_body(p, load)]
    lines.append(pad + "}")
    return lines


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
           "#include <stdlib.h>",
           "struct opg_ctx { int64_t ndim, nblk, block, stream; const int64_t *shape, *st; void *const *ptrs;",
           "                 const float *hx; int64_t hp; };  /* simd.tiny_table */",
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
    # rows of at most a vector (3×3 maps; a 2-d input of few channels): a claim's rows as one run
    out += ["    " + s for s in tiny_rows(p, big_ops, decl)]
    o = nops - 1  # the output
    out += [f"    if (ndim == 2 && nblk == 1 && vector_h && {hoisted_rows}) {{",
            "        const int64_t n = inner;",
            "        int64_t w = w_begin;",
            "#if defined(OPG_VEC)",
            f"        const size_t row_bytes = (size_t)s{o}[0] * sizeof(*b{o}), n_bytes = (size_t)n * sizeof(*b{o});",
            f"        const int lines = c->stream && row_bytes % OPG_LINE == 0 && n_bytes % OPG_LINE == 0"
            f" && ((uintptr_t)b{o} & (OPG_LINE - 1)) == 0;",
            f"        for (; w + {ROWS} <= w_end; w += {ROWS}) {{",
            "            " + " ".join(row(k, f"_{i}", f"(w + {i})") for i in range(ROWS) for k in big_ops),
            "            " + " ".join(f"const float *const q{k} = b{k};" for k in range(nb, nb + nh)),
            "            int64_t jv = 0;",
            "            if (lines) {  /* streamed, every row whole cache lines: non-temporal stores */"]
    out += ["                " + s for s in rows_block(p, ROWS, streamed=True)]
    out += ["            } else {"]
    out += ["                " + s for s in rows_block(p, ROWS)]
    out += ["            }"]
    for i in range(ROWS):  # each row's tail past the last whole vector
        out += ["            {", "                " + " ".join(
            decl(k, f"q{k}", f"q{k}_{i}") for k in big_ops), "                int64_t jt = jv;"]
        out += ["                " + s for s in (vector_tail(p, False, "jt") if needs_vector(p) else [])]
        out += ["                for (int64_t j = jt; j < n; ++j) {"]
        out += ["                    " + s for s in scalar_body(p, lambda k, r: f"q{k}[j]")]
        out += ["                }", "            }"]
    out += ["        }", "#endif",
            "        for (; w < w_end; ++w) {",
            "            " + " ".join(row(k, "", "w") for k in range(nops))]
    out += _loop(p, lambda k, r: f"q{k}[j]", [], simd=True,
                 vector=vector_loop(p, False) if needs_vector(p) else None, scalar_h=False)
    out += ["        }",
            "#if defined(OPG_VEC)",
            "        if (lines) _mm_sfence();  /* the rows' non-temporal stores */",
            "#endif",
            "        return;", "    }"]
    # longer rows, up to simd.SHORT_ROW elements, one after another (an NCHW tensor's small
    # maps): a claim's rows as one run, a vector's per-channel lanes split where a row ends
    out += ["    " + s for s in short_rows(p, big_ops, decl)]
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
    if quiet_bf16(p):  # (read by the vector loops only)
        dirty = " | ".join(f"opg_low_nan(h{k})" for k in range(nb, nb + nh)) or "0"
        scalar_pre += ["#if defined(OPG_VEC)", f"const int quiet_row = !({dirty});  /* see quiet_bf16 */",
                       "#endif"]

    def dense_load(scalar: bool) -> Callable[[int, str], str]:
        return lambda k, r: f"h{k}" if scalar and nb <= k < nb + nh else f"q{k}[j]"

    vec = needs_vector(p)
    out.append("        if (scalar_h) {")
    stream = stream_loop(p, dense_load(True))
    normal = vector_loop(p, True) if vec else []
    out += _loop(p, dense_load(True), scalar_pre, simd=True,
                 vector=stream + normal)  # after the streamed whole lines, the rest of the row
    out.append("        } else if (vector_h) {")
    out += _loop(p, dense_load(False), [], simd=True, vector=vector_loop(p, False) if vec else None,
                 scalar_h=False)
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
            f"    const int64_t stream = outer * inner * (int64_t)sizeof({C_TYPE[p.out_dtype]}) >= {STREAM_BYTES};"]
    out += ["    " + s for s in tiny_table(p, big_ops, nops)]
    out += ["    const struct opg_ctx c = {ndim, nblk, block, stream, shape, st, ptrs, hx, hp};",
            f"    if (run == 0 || work < 2 || outer * inner < {PARALLEL_MIN})",
            "        opg_items((void *)&c, 0, work);",
            "    else {",
            "        const int64_t item = inner < block ? inner : block;",
            f"        run(opg_items, (void *)&c, work, item >= {GRAIN} ? 1 : {GRAIN} / item);",
            "    }",
            "    free(hx);",
            "}", ""]
    return "\n".join(out)


# the plan and its predicates live in .kernel_plan, the SIMD loops in .simd; the plan's names are
# kept here, where the kernels' callers and tests look for them
__all__ = ["BLOCK", "GRAIN", "PARALLEL_MIN", "Plan", "ROWS", "STREAM_BYTES", "paired", "plan",
           "quiet_bf16", "render", "store_reads_top"]
