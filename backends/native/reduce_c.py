"""C source of one FusedReduce pass: per-element instructions and the partial sums of
:mod:`l0ops.ordered` (blocks of 32768, 64 lanes, tree folds) in one sweep over the data.

The kernel ``int opg_kernel(K, R, nr, rshape, ptrs, koff, rstr, nblocks, out, run)`` takes
the reduced dims already collapsed (``rshape``, ``nr`` of them, row-major order = the summation
order), the big inputs and then the per-kept float32 registers in ``ptrs``, each big input's
element offset per kept index (``koff[i*K + k]``) and strides along the reduced dims
(``rstr[i*nr + d]``) and ``out`` (``S*K`` sums); it returns 1 if it cannot allocate its
``S*K*nblocks`` per-block sums, else 0.

Work items are (group of ``OPG_KG`` consecutive kept indices, block), shared out by the thread
team of :mod:`.team` (``run``; NULL or fewer than :data:`PARALLEL_MIN` elements: the caller
alone); each kept index has its own 64 lane accumulators, folded by its item, so the order
never depends on the threads or the grouping. An item takes each stretch of its block for
every index of its group in turn, so channel-major data is read several channels' rows at a
time (one index at a time, each of its N rows was a short stream 401 KB from the next; HISTORY).
Where every big input is contiguous along the innermost reduced dim the lanes are updated
``OPG_W`` at a time (AVX2: 8, AVX-512: 16), whole 64-lane chunks with the accumulators in
registers — lane ``l`` still adds its elements one after another, as the order requires. When
the kept indices are the contiguous ones (channels_last), items are (block, chunk of
``opg_kc`` kept indices) and run across them instead. The caller folds the blocks.

    >>> from l0ops.primitives import Instr
    >>> from opgraph.core.dtypes import DataType as D
    >>> src = render_pass([("in0", D.FLOAT16)], ["t3"],
    ...                   [("t4", Instr(op="sub", args=("in0", "t3"), dtype=D.FLOAT))], ["t4"])
    >>> "opg_v_sub(v_in0, v_t3)" in src and "opg_fold" in src
    True
"""
from __future__ import annotations

from typing import Sequence

from l0ops.ordered import BLOCK, LANES
from l0ops.primitives import Instr
from opgraph.core.dtypes import DataType
from .c_text import C_OP, C_TYPE, HELPERS, LOAD, ROUND, V_FOLD_COLS, V_HELPERS, V_LOAD, V_MLOAD, V_OP, V_ROUND
from .team import C_DECL

PARALLEL_MIN = 32768  # K * R below this: one thread
PARALLEL = f"run != 0 && K * R >= {PARALLEL_MIN}"  # (C) whether a kernel shares its items out


def share(body: str, ctx: str, work: str, parallel: str = PARALLEL) -> list[str]:
    """C running work items ``[0, work)`` of ``body`` on ``ctx``: on the team when
    ``parallel`` holds and there are two or more, else on the calling thread."""
    return [f"    if (!({parallel}) || {work} < 2) {body}((void *){ctx}, 0, {work});",
            f"    else run({body}, (void *){ctx}, {work}, 1);"]

FOLD = f"""#include <stdlib.h>
#define OPG_LANES {LANES}
#define OPG_BLOCK {BLOCK}
#define OPG_KC 64  /* kept indices per work item of a channels_last pass, or all of them */
#define OPG_KC_MAX 256  /* up to this many (128 for less data): a row read by one item, not two */
#define OPG_KC_LARGE (8 << 20)  /* bytes of data from which a chunk takes up to OPG_KC_MAX */
static inline int64_t opg_kc(int64_t K, int64_t R, int64_t bytes) {{
    const int64_t most = R * K * bytes >= OPG_KC_LARGE ? OPG_KC_MAX : 128;
    return K > OPG_KC && K <= most ? (K + 15) / 16 * 16 : OPG_KC;
}}
static inline int64_t opg_nkc(int64_t K, int64_t R, int64_t bytes) {{  /* chunks: items and kernel */
    return (K + opg_kc(K, R, bytes) - 1) / opg_kc(K, R, bytes);
}}
/* lane groups per (block, kept chunk) of a channels_last pass run in parallel: 2 when there is
   one such item (a [6272, 64] input is one block, one chunk), or fewer than 8 over several
   blocks, the last of which is shorter (32x64x56x56: blocks of 32768, 32768, 32768 and 2048
   rows, two threads taking two each), else 1 */
#define OPG_LANE_GROUPS(items, nblocks) ((items) >= 8 || ((items) >= 2 && (nblocks) == 1) ? 1 : 2)
#define OPG_KG 16  /* kept indices a work item of a channel-major pass takes in lockstep, at most */
/* the group a kernel of at most cap indices uses for K of them: the largest of cap, cap/2, ...
   that leaves four groups' worth (so that a few indices still make several items), else 1 */
static inline int64_t opg_group(int64_t K, int64_t cap) {{
    int64_t g = cap;
    while (g > 1 && K < 4 * g) g /= 2;
    return g;
}}
#define OPG_PAIR_KG 8  /* at most this many kept indices at a time in a blocked pair, */
#define OPG_PAIR_BYTES (512 * 1024)  /* whose data fit this many bytes: still cached for pass b */
static inline int64_t opg_pair_group(int64_t K, int64_t R, int64_t bytes) {{
    int64_t g = OPG_PAIR_BYTES / (R * bytes > 0 ? R * bytes : 1);
    return opg_group(K, g < 1 ? 1 : g > OPG_PAIR_KG ? OPG_PAIR_KG : g);
}}
/* the lanes a block of len rows adds into, rounded up to 16 (no vector reads a lane left unset):
   only these are cleared (at R = 1, 2048 channels, clearing all 64 was most of a pass) */
static inline int64_t opg_lanes_used(int64_t len) {{
    return len < OPG_LANES ? (len + 15) / 16 * 16 : OPG_LANES;
}}
/* l0ops.ordered's tree: with n = ceil(m/2), a[j] += a[j + n] for j < m - n; m = n; ... */
static void opg_fold(float *a, int64_t m, int64_t stride) {{
    while (m > 1) {{
        const int64_t n = (m + 1) / 2;
        for (int64_t j = 0; j < m - n; ++j) a[j * stride] += a[(j + n) * stride];
        m = n;
    }}
}}
/* opg_fold of 64 lanes (64-byte aligned) in vector registers: halves added while they are
   whole vectors, then within one by shuffles, each lane added to the one n below it as the
   tree adds a[j + n] to a[j] (BatchNormStats at 32x2048x7x7 0.91-0.93x the scalar fold's time;
   not inlined: inlined, the item's loop at 2048x64x3x3 ran 1.03-1.04x slower) */
static __attribute__((noinline)) float opg_fold64(const float *a) {{
#if defined(__AVX512F__)
    __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(a), _mm512_load_ps(a + 32)),
                             _mm512_add_ps(_mm512_load_ps(a + 16), _mm512_load_ps(a + 48)));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xEE));   /* lanes 8-15 onto 0-7 */
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x55));   /* 4-7 onto 0-3 */
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xEE));         /* 2-3 onto 0-1 */
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x55));         /* 1 onto 0 */
    return _mm512_cvtss_f32(v);
#elif defined(OPG_VEC)
    __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(_mm256_load_ps(a), _mm256_load_ps(a + 32)),
                                           _mm256_add_ps(_mm256_load_ps(a + 16), _mm256_load_ps(a + 48))),
                             _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(a + 8), _mm256_load_ps(a + 40)),
                                           _mm256_add_ps(_mm256_load_ps(a + 24), _mm256_load_ps(a + 56))));
    v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x11)); /* lanes 4-7 onto 0-3 */
    v = _mm256_add_ps(v, _mm256_permute_ps(v, 0xEE));         /* 2-3 onto 0-1 */
    v = _mm256_add_ps(v, _mm256_permute_ps(v, 0x55));         /* 1 onto 0 */
    return _mm256_cvtss_f32(v);
#else
    float b[{LANES}];
    for (int j = 0; j < {LANES}; ++j) b[j] = a[j];
    opg_fold(b, {LANES}, 1);
    return b[0];
#endif
}}
/* S*K sums into out from their blocks; with per_block = OPG_LANES each block's lanes were left
   unfolded by lane-group items (channels_last passes): folded first, in place (j <= 64 j) */
static inline void opg_fold_blocks(float *blocks, int64_t S, int64_t K, int64_t R, int64_t nblocks,
                                   int64_t per_block, float *out) {{
    for (int64_t j = 0; per_block > 1 && j < S * K * nblocks; ++j) {{
        const int64_t len = R - j % nblocks * OPG_BLOCK;
        opg_fold(blocks + j * OPG_LANES, len < OPG_BLOCK ? (len < OPG_LANES ? len : OPG_LANES) : OPG_LANES, 1);
        blocks[j] = blocks[j * OPG_LANES];
    }}
    for (int64_t sk = 0; sk < S * K; ++sk) {{
        opg_fold(blocks + sk * nblocks, nblocks, 1);
        out[sk] = blocks[sk * nblocks];
    }}
}}
"""


def _scalar(big, live, sums, load, acc: str = "acc[{}][l]", pre: Sequence[str] = ()) -> list[str]:
    """Statements for one element at lane ``l``: ``load(i)`` reads big input ``i``; ``acc``
    spells sum ``s``'s accumulator; ``pre`` statements come first."""
    out = list(pre) + [f"const float r_{r} = {LOAD[d].format(load(i))};" for i, (r, d) in enumerate(big)]
    for dst, ins in live:
        args = [f"r_{x}" for x in ins.args]
        expr = args[0] if ins.op == "cast" else f" {C_OP[ins.op]} ".join(args)
        out.append(f"const float r_{dst} = {ROUND[ins.dtype].format(expr)};")
    out += [f"{acc.format(s)} += r_{x};" for s, x in enumerate(sums)]
    return out


def _v_live(live) -> list[str]:
    """The live instructions as vector statements on registers ``v_<name>``, each rounded to
    its dtype."""
    out = []
    for dst, ins in live:
        args = [f"v_{x}" for x in ins.args]
        expr = args[0] if ins.op == "cast" else f"{V_OP[ins.op]}({', '.join(args)})"
        out.append(f"const opg_v v_{dst} = {V_ROUND[ins.dtype].format(expr)};")
    return out


def _vector(big, live, sums, acc: str = "acc[{}][l]", pre: Sequence[str] = ()) -> list[str]:
    """Statements for ``OPG_W`` consecutive elements ``q<i>[j...]``, added to ``OPG_W``
    consecutive accumulators from ``acc`` (lanes ``l...``, or kept indices ``j...``)."""
    out = list(pre) + [f"const opg_v v_{r} = {V_LOAD[d].format(f'q{i}')};" for i, (r, d) in enumerate(big)]
    out += _v_live(live)
    out += [f"opg_v_st_f32(&{acc.format(s)}, opg_v_add(opg_v_ld_f32(&{acc.format(s)}), v_{x}));"
            for s, x in enumerate(sums)]
    return out


def _masked(big, live, sums, at: str, acc: str, pre: Sequence[str] = ()) -> list[str]:
    """:func:`_vector` over the lanes in mask ``m`` only (``OPG_MASKED``): elements from
    ``q<i>[at]`` on, added to the accumulators ``acc`` spells for sum ``s`` (a whole vector of
    them); lanes outside ``m`` are neither loaded nor added; ``pre`` statements come first. A
    row's lanes up to an aligned one and its last lanes (rows of 49: 30 of the 49 elements one
    at a time), or the last of fewer than a vector's kept indices of a channels_last row, so go
    without scalar steps, whose stores a vector load of the same lanes must wait for."""
    out = list(pre) + [f"const opg_v v_{r} = {V_MLOAD[d].format(f'&q{i}[{at}]')};" for i, (r, d) in enumerate(big)]
    out += _v_live(live)
    return out + [f"opg_v_st_f32(&{acc.format(s)}, opg_v_madd(opg_v_ld_f32(&{acc.format(s)}), m, v_{x}));"
                  for s, x in enumerate(sums)]


def elem_bytes(big: Sequence[tuple[str, DataType]]) -> int:
    """The bytes one reduced element reads: an element of every big input."""
    return sum(d.np.itemsize for _, d in big)  # a reduced element's bytes, every big input


def render_cols_items(big: Sequence[tuple[str, DataType]], kept: Sequence[str],
                      live: Sequence[tuple[str, Instr]], sums: Sequence[str], eb: int) -> list[str]:
    """The work items of a pass whose kept indices are contiguous in every big input (and the
    reduced dims strided: channels_last): item (block, chunk of ``opg_kc`` kept indices)
    walks the block's rows in order; each row adds ``OPG_W`` kept indices at a time to their own
    lane ``l`` (lanes are per kept index, so each still adds its elements one after another). A
    chunk is 64 kept indices, or all of them up to 128 (256 from 8 MB of data: ``opg_kc``), so
    that one item reads a row, not two its halves (HISTORY)."""
    nb, S = len(big), len(sums)
    pad = " " * 16
    kept_s = [f"const float r_{r} = g{j}[j];" for j, r in enumerate(kept)]
    kept_v = [f"const opg_v v_{r} = opg_v_ld_f32(&g{j}[j]);" for j, r in enumerate(kept)]
    L = [f"    const int64_t kc = opg_kc(K, R, {eb}), nkc = opg_nkc(K, R, {eb});",
         "    const int64_t ng = c->ng > 1 ? c->ng : 1;",
         "    const int64_t lg = OPG_LANES / ng;",
         "    for (int64_t w = w_begin; w < w_end; ++w) {",
         "        const int64_t blk = w / (nkc * ng), k0 = (w / ng % nkc) * kc, l0 = w % ng * lg;",
         "        const int64_t kn = K - k0 < kc ? K - k0 : kc;",
         f"        float accbuf[{S} * OPG_LANES * OPG_KC_MAX] __attribute__((aligned(64)));",
         "        float (*const acc)[OPG_LANES][kc] = (float (*)[OPG_LANES][kc])accbuf;",
         "        const int64_t r1 = (blk + 1) * OPG_BLOCK < R ? (blk + 1) * OPG_BLOCK : R;",
         "        const int64_t used = opg_lanes_used(r1 - blk * OPG_BLOCK);",
         f"        for (int s = 0; s < {S}; ++s) for (int64_t l = 0; l < used; ++l)",
         "            for (int e = 0; e < kc; ++e) acc[s][l][e] = -0.0f;"]
    L += [f"        const float *const g{j} = h{j} + k0;" for j in range(len(kept))]
    L += ["        int64_t r = blk * OPG_BLOCK;",
          "        while (r < r1) {",
          "            int64_t rest = r / inner;",
          "            const int64_t t0 = r % inner;",
          "            int64_t " + ", ".join(f"p{i} = koff[{i} * K + k0]" for i in range(nb)) + ";",
          "            for (int64_t d = nr - 2; d >= 0; --d) {",
          "                const int64_t idx = rest % rshape[d];",
          "                rest /= rshape[d];",
          "                " + " ".join(f"p{i} += idx * rstr[{i} * nr + d];" for i in range(nb)),
          "            }",
          "            const int64_t run = inner - t0 < r1 - r ? inner - t0 : r1 - r;"]
    L += [f"            const int64_t s{i} = rstr[{i} * nr + nr - 1];" for i in range(nb)]
    L += ["            for (int64_t t = 0; t < run;) {  /* the rows of this item's lanes */",
          "                const int64_t off = (r + t - l0) & (OPG_LANES - 1);",
          "                if (off >= lg) {  /* another group's lane: on to this group's next */",
          "                    t += OPG_LANES - off;",
          "                    continue;",
          "                }",
          "                const int64_t end = run - t < lg - off ? run : t + lg - off;",
          "                for (; t < end; ++t) {",
          "                const int64_t l = (r + t) & (OPG_LANES - 1);"]
    L += [f"                const {C_TYPE[d]} *const q{i} = b{i} + p{i} + (t0 + t) * s{i};"
          for i, (_, d) in enumerate(big)]
    L += ["                int64_t j = 0;", "#if defined(OPG_VEC)",
          "                for (; j + OPG_W <= kn; j += OPG_W) {"]
    L += [pad + "    " + x for x in _vector(big, live, sums, "acc[{}][l][j]", kept_v)]
    L += ["                }", "#endif", "#if defined(OPG_MASKED)",
          "                if (j < kn) {  /* the last kept indices (fewer than a vector's lanes): one masked vector */",
          "                    const opg_m m = opg_m_range(0, kn - j);"]
    kept_m = [f"const opg_v v_{r} = opg_v_mld_f32(m, &g{j}[j]);" for j, r in enumerate(kept)]
    L += [pad + "    " + x for x in _masked(big, live, sums, "j", "acc[{}][l][j]", kept_m)]
    L += ["                    j = kn;", "                }", "#endif", "                for (; j < kn; ++j) {"]
    L += [pad + "    " + x for x in _scalar(big, live, sums, lambda i: f"q{i}[j]", "acc[{}][l][j]", kept_s)]
    L += ["                }", "                }", "            }", "            r += run;", "        }",
          "        const int64_t len = r1 - blk * OPG_BLOCK, m = len < OPG_LANES ? len : OPG_LANES;",
          f"        for (int s = 0; ng == 1 && s < {S}; ++s)  /* all kept indices' lanes at once: one"
          " at a time, strided, they took half of BatchNormStats on a [64, 16384] input */",
          "            opg_fold_cols(&acc[s][0][0], m, kc);",
          f"        for (int s = 0; s < {S}; ++s) for (int64_t e = 0; e < kn; ++e) {{",
          "            float *const to = c->blocks + ((s * K + k0 + e) * nblocks + blk) * (ng > 1 ? OPG_LANES : 1);",
          "            if (ng > 1) {  /* the group's lanes: the kernel folds them */",
          "                for (int64_t l = l0; l < l0 + lg && l < used; ++l) to[l] = acc[s][l][e];",
          "                continue;",
          "            }",
          "            *to = acc[s][0][e];",
          "        }",
          "    }", "}", ""]
    return L


def _chunks(big, live, sums) -> list[str]:
    """Whole 64-lane chunks from any lane ``l`` that is a multiple of ``OPG_W`` (a row of 784
    starts at lane 16 after one of 784): the lane accumulators held in registers, register
    ``u`` holding lanes ``(l + u·OPG_W) mod 64``, which element ``j + u·OPG_W`` of every
    chunk adds to. The loops that fill and empty them are unrolled too: as loops they kept the
    registers on the stack, each row's copy waiting on the stores before it (HISTORY)."""
    S = len(sums)
    body = [f"const opg_v v_{r} = {V_LOAD[d].format(f'(q{i} + u * OPG_W)')};" for i, (r, d) in enumerate(big)]
    body += _v_live(live)
    body += [f"va[{s}][u] = opg_v_add(va[{s}][u], v_{x});" for s, x in enumerate(sums)]
    return ["if (j + OPG_LANES <= run) {  /* l is a multiple of OPG_W here */",
            f"    opg_v va[{S}][OPG_LANES / OPG_W];  /* in registers: every loop over it unrolled */",
            "    #pragma GCC unroll 16",
            f"    for (int s = 0; s < {S}; ++s) {{",
            "        #pragma GCC unroll 16",
            "        for (int u = 0; u < OPG_LANES / OPG_W; ++u)",
            "            va[s][u] = opg_v_ld_f32(&acc[s][(l + u * OPG_W) & (OPG_LANES - 1)]);",
            "    }",
            "    for (; j + OPG_LANES <= run; j += OPG_LANES) {",
            "        #pragma GCC unroll 16",
            "        for (int u = 0; u < OPG_LANES / OPG_W; ++u) {"]     + ["            " + b for b in body] + [
            "        }", "    }",
            "    #pragma GCC unroll 16",
            f"    for (int s = 0; s < {S}; ++s) {{",
            "        #pragma GCC unroll 16",
            "        for (int u = 0; u < OPG_LANES / OPG_W; ++u)",
            "            opg_v_st_f32(&acc[s][(l + u * OPG_W) & (OPG_LANES - 1)], va[s][u]);",
            "    }",
            "}"]


def render_pass(big: Sequence[tuple[str, DataType]], kept: Sequence[str],
                live: Sequence[tuple[str, Instr]], sums: Sequence[str], cols: bool = False) -> str:
    """C for one pass over ``big`` (register, dtype) computing the ``live`` instructions and
    adding the registers ``sums`` into their lanes; ``kept`` registers are per-kept-index
    float32 values (``ptrs[len(big) + j][k]``). ``cols``: every big input's kept indices are
    contiguous (``koff[i*K + k] = koff[i*K] + k``); the items run across them (channels_last)."""
    if cols:
        eb = elem_bytes(big)
        return _finish(HEADER + render_item_head("opg_items", big, kept) + render_cols_items(big, kept, live, sums, eb),
                       len(sums), f"opg_nkc(K, R, {eb}) * nblocks", lane_groups=True)
    return _finish(HEADER + render_items("opg_items", big, kept, live, sums), len(sums),
                   "((K + opg_group(K, OPG_KG) - 1) / opg_group(K, OPG_KG)) * nblocks")


HEADER = [HELPERS, V_HELPERS, V_FOLD_COLS, C_DECL, FOLD,
           "struct opg_rctx { int64_t K, R, nr, nblocks; const int64_t *rshape, *koff, *rstr;",
           "                  void *const *ptrs; float *blocks;",
           "                  int64_t ng;  /* lane groups (channels_last passes; 0: 1) */",
           "                  int64_t group; };  /* kept indices a work item takes (blocked pairs) */", ""]


def render_item_head(name: str, big: Sequence[tuple[str, DataType]], kept: Sequence[str]) -> list[str]:
    """The opening of work-item function ``name``: the context's fields and operand pointers."""
    nb = len(big)
    L = [f"static void {name}(void *vctx, int64_t w_begin, int64_t w_end)", "{",
         "    const struct opg_rctx *const c = (const struct opg_rctx *)vctx;",
         "    const int64_t K = c->K, R = c->R, nr = c->nr, nblocks = c->nblocks;",
         "    const int64_t *const rshape = c->rshape, *const koff = c->koff, *const rstr = c->rstr;"]
    L += [f"    const {C_TYPE[d]} *const b{i} = (const {C_TYPE[d]} *)c->ptrs[{i}];"
          for i, (_, d) in enumerate(big)]
    L += [f"    const float *const h{j} = (const float *)c->ptrs[{nb + j}];" for j in range(len(kept))]
    L += ["    const int64_t inner = rshape[nr - 1];",
          "    const int dense = " + " && ".join([f"rstr[{i} * nr + nr - 1] == 1" for i in range(nb)]
                                              or ["1"]) + ";"]
    return L


def render_items(name: str, big: Sequence[tuple[str, DataType]], kept: Sequence[str],
           live: Sequence[tuple[str, Instr]], sums: Sequence[str], cap: str = "OPG_KG",
           group: str = "") -> list[str]:
    """Work-item function ``name`` of a pass whose items are (group of ``opg_group(K, cap)``
    consecutive kept indices, block), group major: items ``[g * nblocks, (g + 1) * nblocks)``
    are group ``g``'s blocks. Each stretch of a block's reduced elements is taken for every
    kept index of the group in turn, each into its own lane accumulators (the same additions in
    the same order as one index at a time): channel-major data is then read a run of the
    group's rows at a time (N rows of 784 elements a channel, 401 KB apart in a 32×64×56×56
    tensor, read one channel at a time cost a short stream per row). The group is the largest
    of ``cap``, its half, ... that leaves 4 groups' worth of kept indices (``opg_group``), so
    that a few channels still make several items."""
    nb, S = len(big), len(sums)
    pad = " " * 20
    L = render_item_head(name, big, kept)
    L += [f"    const int64_t group = {group or f'opg_group(K, {cap})'};",
          "    for (int64_t w = w_begin; w < w_end; ++w) {",
          "        const int64_t k0 = (w / nblocks) * group, blk = w % nblocks;",
          "        const int64_t kn = K - k0 < group ? K - k0 : group;",
          f"        float accs[{cap}][{S}][OPG_LANES] __attribute__((aligned(64)));",
          "        const int64_t r1 = (blk + 1) * OPG_BLOCK < R ? (blk + 1) * OPG_BLOCK : R;",
          "        const int64_t len = r1 - blk * OPG_BLOCK, used = opg_lanes_used(len);",
          f"        for (int64_t g = 0; g < kn; ++g) for (int s = 0; s < {S}; ++s)",
          "            for (int64_t l = 0; l < used; ++l) accs[g][s][l] = -0.0f;",
          "        int64_t r = blk * OPG_BLOCK;",
          "        while (r < r1) {",
          "            int64_t rest = r / inner;",
          "            const int64_t t0 = r % inner;",
          "            int64_t " + ", ".join([f"o{i} = 0" for i in range(nb)] or ["unused = 0"]) + ";",
          "            for (int64_t d = nr - 2; d >= 0; --d) {",
          "                const int64_t idx = rest % rshape[d];",
          "                rest /= rshape[d];",
          "                " + " ".join(f"o{i} += idx * rstr[{i} * nr + d];" for i in range(nb)),
          "            }",
          "            const int64_t run = inner - t0 < r1 - r ? inner - t0 : r1 - r;",
          "            for (int64_t g = 0; g < kn; ++g) {",
          "                const int64_t k = k0 + g;",
          "                float (*const acc)[OPG_LANES] = accs[g];"]
    L += [f"                const float r_{r} = h{j}[k];" for j, r in enumerate(kept)]
    L += ["#if defined(OPG_VEC)"]
    L += [f"                const opg_v v_{r} = opg_v_set1(r_{r});" for r in kept]
    L += ["#endif"]
    L += [f"                const int64_t p{i} = koff[{i} * K + k] + o{i};" for i in range(nb)]
    L += ["                int64_t j = 0, l = r & (OPG_LANES - 1);",
          "                if (dense) {"]
    L += [f"                    const {C_TYPE[d]} *const q{i} = b{i} + p{i} + t0;" for i, (_, d) in enumerate(big)]
    scalar_dense = _scalar(big, live, sums, lambda i: f"q{i}[j]")
    L += ["#if defined(OPG_MASKED)",
          "                    if (l & (OPG_W - 1)) {  /* up to an aligned lane: one masked vector */",
          "                        const int64_t a = l & (OPG_W - 1), k = OPG_W - a < run ? OPG_W - a : run;",
          "                        const opg_m m = opg_m_range(a, a + k);"]
    L += [pad + "    " + s for s in _masked(big, live, sums, "j - a", "acc[{}][l - a]")]
    L += ["                        j += k;", "                        l = (l + k) & (OPG_LANES - 1);", "                    }",
          "#endif", "#if defined(OPG_VEC)",
          "                    for (; j < run && (l & (OPG_W - 1)); ++j, l = (l + 1) & (OPG_LANES - 1)) {"]
    L += [pad + "    " + s for s in scalar_dense]
    L += ["                    }"]
    L += [pad + s for s in _chunks(big, live, sums)]
    L += ["                    for (; j + OPG_W <= run; j += OPG_W, l = (l + OPG_W) & (OPG_LANES - 1)) {"]
    L += [pad + "    " + s for s in _vector(big, live, sums)]
    L += ["                    }", "#endif", "#if defined(OPG_MASKED)",
          "                    if (j < run) {  /* the last lanes: one masked vector from an aligned lane */",
          "                        const opg_m m = opg_m_range(0, run - j);"]
    L += [pad + "    " + s for s in _masked(big, live, sums, "j", "acc[{}][l]")]
    L += ["                        j = run;", "                    }", "#endif",
          "                    for (; j < run; ++j, l = (l + 1) & (OPG_LANES - 1)) {"]
    L += [pad + "    " + s for s in scalar_dense]
    L += ["                    }", "                } else {"]
    L += [f"                    const int64_t s{i} = rstr[{i} * nr + nr - 1];" for i in range(nb)]
    L += ["                    for (; j < run; ++j, l = (l + 1) & (OPG_LANES - 1)) {"]
    L += [pad + "    " + s for s in _scalar(big, live, sums, lambda i: f"b{i}[p{i} + (t0 + j) * s{i}]")]
    L += ["                    }", "                }", "            }", "            r += run;", "        }",
          f"        for (int64_t g = 0; g < kn; ++g) for (int s = 0; s < {S}; ++s) {{",
          "            float *const to = &c->blocks[(s * K + k0 + g) * nblocks + blk];",
          "            if (len < OPG_LANES) {",
          "                opg_fold(accs[g][s], len, 1);",
          "                *to = accs[g][s][0];",
          "            } else *to = opg_fold64(accs[g][s]);",
          "        }",
          "    }", "}", ""]
    return L


def _finish(L: list[str], S: int, work: str, lane_groups: bool = False) -> str:
    """The entry point after the work items: share them out, fold the blocks. ``lane_groups``:
    run in parallel, the ``work`` items are each split into ``OPG_LANE_GROUPS`` groups of
    lanes, which leave every block's lanes unfolded (64 per block): folded here first, by the
    same tree."""
    ng = f"{PARALLEL} ? OPG_LANE_GROUPS(items, nblocks) : 1" if lane_groups else "1"
    L = L + ["int opg_kernel(int64_t K, int64_t R, int64_t nr, const int64_t *rshape,",
          "               void *const *ptrs, const int64_t *koff, const int64_t *rstr,",
          "               int64_t nblocks, float *out, opg_run run)", "{",
          f"    const int64_t items = {work}, ng = {ng}, work = items * ng;",
          "    const int64_t per_block = ng > 1 ? OPG_LANES : 1;",
          f"    float *const blocks = (float *)malloc(sizeof(float) * {S} * K * nblocks * per_block);",
          "    if (blocks == 0) return 1;",
          "    const struct opg_rctx c = {K, R, nr, nblocks, rshape, koff, rstr, ptrs, blocks, ng};",
          *share("opg_items", "&c", "work"),
          f"    opg_fold_blocks(blocks, {S}, K, R, nblocks, per_block, out);",
          "    free(blocks);",
          "    return 0;",
          "}", ""]
    return "\n".join(L)


__all__ = ["HEADER", "PARALLEL", "elem_bytes", "render_cols_items", "render_item_head",
           "render_items", "render_pass", "share"]
