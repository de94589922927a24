"""C source of two FusedReduce passes run as one call, the second needing the first's sums
(batch_norm_stats: the mean, then the squared differences from it): channel-major data a group
of kept indices at a time, so that pass b still finds the group's data in this core's cache
(:func:`render_blocked`), or channels_last data pass after pass (:func:`render_cols_pair`).
Each pass's items, blocks and folds are those of :func:`.reduce_c.render_pass`, so the bits are
the two passes' run one after the other.

    >>> from l0ops.primitives import Instr
    >>> from opgraph.core.dtypes import DataType as D
    >>> a = ([("in0", D.FLOAT)], [], [], ["in0"])
    >>> b = ([("in0", D.FLOAT)], ["t1"], [("t2", Instr(op="sub", args=("in0", "t1"), dtype=D.FLOAT))], ["t2"])
    >>> src = render_blocked(a, b, [("t0", D.FLOAT)], [("t1", "r_t0 * 0.5f", D.FLOAT)], [(0, "t1")])
    >>> "opg_items_a" in src and "opg_items_b" in src and "opg_pair_group" in src
    True
"""
from __future__ import annotations

from typing import Sequence

from opgraph.core.dtypes import DataType
from .c_text import ROUND
from .reduce_c import (HEADER, PARALLEL, elem_bytes, render_cols_items, render_item_head,
                       render_items, share)


def render_blocked(a: tuple, b: tuple, a_regs: Sequence[tuple[str, DataType]],
                   between: Sequence[tuple[str, str, DataType]], derived: Sequence[tuple[int, str]]) -> str:
    """C for two passes run a group of kept indices at a time: pass ``a`` over the group's blocks
    (its indices in lockstep, as :func:`render_pass`'s items take them), their sums folded, the
    per-index instructions ``between`` (``(register, C expression over r_<register>,
    dtype)``, rounded to the dtype), then pass ``b`` over the same blocks while they are still in
    this core's cache: up to ``OPG_PAIR_KG`` indices whose data fit ``OPG_PAIR_BYTES``
    (``opg_pair_group``; one at a time for long rows — a channel of 32×64×56×56 fp32 is 401 KB —
    and halved, as ``opg_group``, until 4 groups' worth remain; HISTORY). ``a`` and ``b`` are
    :func:`render_pass`'s ``(big, kept, live, sums)``; ``a_regs`` names the registers pass a's
    sums become (rounded to their dtype);
    ``derived`` lists ``(j, register)``: pass b's kept register ``j`` is computed here. Each
    block's sum and each fold are those of the two passes run one after the other, so the bits
    are too. Entry: ``int opg_kernel(K, R, nblocks, nr_a, rshape_a, ptrs_a, koff_a, rstr_a,
    out_a, nr_b, rshape_b, ptrs_b, koff_b, rstr_b, out_b, run)``."""
    SA, SB, nbb = len(a[3]), len(b[3]), len(b[0])
    eb = max(elem_bytes(a[0]), elem_bytes(b[0]))
    L = HEADER + render_items("opg_items_a", *a, "OPG_PAIR_KG", "c->group") + \
        render_items("opg_items_b", *b, "OPG_PAIR_KG", "c->group")
    L += ["struct opg_bctx { struct opg_rctx a, b; float *out_a, *out_b; };", "",
          "static void opg_fold_out(const struct opg_rctx *r, int S, int64_t k, float *out)", "{",
          "    for (int s = 0; s < S; ++s) {",
          "        float *const bl = r->blocks + (s * r->K + k) * r->nblocks;",
          "        opg_fold(bl, r->nblocks, 1);",
          "        out[s * r->K + k] = bl[0];",
          "    }", "}", "",
          "static void opg_channels(void *vctx, int64_t g0, int64_t g1)", "{",
          "    const struct opg_bctx *const c = (const struct opg_bctx *)vctx;",
          "    const int64_t K = c->a.K, nb = c->a.nblocks, G = c->a.group;"]
    L += [f"    float *const d{j} = (float *)c->b.ptrs[{nbb + j}];" for j, _ in derived]
    L += ["    for (int64_t gi = g0; gi < g1; ++gi) {  /* G kept indices at a time */",
          "        const int64_t k0 = gi * G, k1 = k0 + G < K ? k0 + G : K;",
          "        opg_items_a((void *)&c->a, gi * nb, (gi + 1) * nb);",
          "        for (int64_t k = k0; k < k1; ++k) {",
          f"            opg_fold_out(&c->a, {SA}, k, c->out_a);"]
    L += [f"            const float r_{r} = {ROUND[d].format(f'c->out_a[{s} * K + k]')};"
          for s, (r, d) in enumerate(a_regs)]
    L += [f"            const float r_{r} = {ROUND[d].format(expr)};" for r, expr, d in between]
    L += [f"            d{j}[k] = r_{r};" for j, r in derived]
    L += ["        }",
          "        opg_items_b((void *)&c->b, gi * nb, (gi + 1) * nb);",
          f"        for (int64_t k = k0; k < k1; ++k) opg_fold_out(&c->b, {SB}, k, c->out_b);",
          "    }", "}", "",
          "int opg_kernel(int64_t K, int64_t R, int64_t nblocks,",
          "               int64_t nr_a, const int64_t *rshape_a, void *const *ptrs_a,",
          "               const int64_t *koff_a, const int64_t *rstr_a, float *out_a,",
          "               int64_t nr_b, const int64_t *rshape_b, void *const *ptrs_b,",
          "               const int64_t *koff_b, const int64_t *rstr_b, float *out_b, opg_run run)", "{",
          f"    float *const blocks = (float *)malloc(sizeof(float) * {SA + SB} * K * nblocks);",
          "    if (blocks == 0) return 1;",
          f"    const int64_t G = opg_pair_group(K, R, {eb});",
          "    const struct opg_bctx c = {",
          "        {K, R, nr_a, nblocks, rshape_a, koff_a, rstr_a, ptrs_a, blocks, 0, G},",
          f"        {{K, R, nr_b, nblocks, rshape_b, koff_b, rstr_b, ptrs_b, blocks + {SA} * K * nblocks, 0, G}},",
          "        out_a, out_b};",
          *share("opg_channels", "&c", "(K + G - 1) / G"),
          "    free(blocks);",
          "    return 0;",
          "}", ""]
    return "\n".join(L)


def render_cols_pair(a: tuple, b: tuple, a_regs: Sequence[tuple[str, DataType]],
                     between: Sequence[tuple[str, str, DataType]], derived: Sequence[tuple[int, str]]) -> str:
    """:func:`render_blocked` for two channels_last passes (``cols``): pass ``a``'s items over
    all the data, its sums folded, the instructions ``between`` for every kept index, then pass
    ``b``'s items — one C call with the entry of :func:`render_blocked`, so no Python runs
    between the passes. Each pass's items, lane groups and folds are those of
    :func:`render_pass`'s ``cols`` kernel, so the bits are too."""
    SA, SB, nbb = len(a[3]), len(b[3]), len(b[0])
    eb = max(elem_bytes(a[0]), elem_bytes(b[0]))  # one chunk size for both passes' items
    L = HEADER + render_item_head("opg_items_a", *a[:2]) + render_cols_items(*a, eb)
    L += render_item_head("opg_items_b", *b[:2]) + render_cols_items(*b, eb)
    L += ["int opg_kernel(int64_t K, int64_t R, int64_t nblocks,",
          "               int64_t nr_a, const int64_t *rshape_a, void *const *ptrs_a,",
          "               const int64_t *koff_a, const int64_t *rstr_a, float *out_a,",
          "               int64_t nr_b, const int64_t *rshape_b, void *const *ptrs_b,",
          "               const int64_t *koff_b, const int64_t *rstr_b, float *out_b, opg_run run)", "{",
          f"    const int par = {PARALLEL};",
          f"    const int64_t items = opg_nkc(K, R, {eb}) * nblocks;",
          "    const int64_t ng = par ? OPG_LANE_GROUPS(items, nblocks) : 1, work = items * ng;",
          "    const int64_t per_block = ng > 1 ? OPG_LANES : 1, size = K * nblocks * per_block;",
          f"    float *const blocks = (float *)malloc(sizeof(float) * {SA + SB} * size);",
          "    if (blocks == 0) return 1;",
          "    const struct opg_rctx ca = {K, R, nr_a, nblocks, rshape_a, koff_a, rstr_a, ptrs_a, blocks, ng};",
          f"    const struct opg_rctx cb = {{K, R, nr_b, nblocks, rshape_b, koff_b, rstr_b, ptrs_b, blocks + {SA} * size, ng}};",
          *share("opg_items_a", "&ca", "work", "par"),
          f"    opg_fold_blocks(ca.blocks, {SA}, K, R, nblocks, per_block, out_a);"]
    L += [f"    float *const d{j} = (float *)ptrs_b[{nbb + j}];" for j, _ in derived]
    L += ["    for (int64_t k = 0; k < K; ++k) {"]
    L += [f"        const float r_{r} = {ROUND[d].format(f'out_a[{s} * K + k]')};"
          for s, (r, d) in enumerate(a_regs)]
    L += [f"        const float r_{r} = {ROUND[d].format(expr)};" for r, expr, d in between]
    L += [f"        d{j}[k] = r_{r};" for j, r in derived]
    L += ["    }",
          *share("opg_items_b", "&cb", "work", "par"),
          f"    opg_fold_blocks(cb.blocks, {SB}, K, R, nblocks, per_block, out_b);",
          "    free(blocks);",
          "    return 0;",
          "}", ""]
    return "\n".join(L)


__all__ = ["render_blocked", "render_cols_pair"]
