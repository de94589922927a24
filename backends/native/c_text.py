"""The C text the native kernels share: the scalar helpers (:data:`HELPERS`: f16/bf16 loads,
stores and round-to-nearest-even), the SIMD helpers (:data:`V_HELPERS`: one API over AVX-512 or
AVX2 + F16C) and how each spells a load, store, rounding or operation per dtype.

    >>> LOAD[F16].format("p[0]"), V_OP["mul"]
    ('opg_ld_f16(p[0])', 'opg_v_mul')
"""
from __future__ import annotations

from opgraph.core.dtypes import DataType

F32, F16, BF16 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16
FLOATS = (F32, F16, BF16)
C_TYPE = {F32: "float", F16: "uint16_t", BF16: "uint16_t"}
LOAD = {F32: "{}", F16: "opg_ld_f16({})", BF16: "opg_ld_bf16({})"}
STORE = {F32: "{}", F16: "opg_st_f16({})", BF16: "opg_st_bf16({})"}
ROUND = {F32: "{}", F16: "opg_rnd_f16({})", BF16: "opg_rnd_bf16({})"}
C_OP = {"add": "+", "sub": "-", "mul": "*", "div": "/"}

HELPERS = r"""#include <stdint.h>
#include <string.h>

static inline float opg_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t opg_u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* Branch-free so that loops vectorise. NaNs come out quiet with their top payload bits. */

/* bfloat16: the top half of a float; float -> bf16 rounds to nearest even */
static inline float opg_ld_bf16(uint16_t h) { return opg_f((uint32_t)h << 16); }
static inline uint16_t opg_st_bf16(float f) {
    uint32_t u = opg_u(f), r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x0040u : r);
}
static inline float opg_rnd_bf16(float f) { return opg_ld_bf16(opg_st_bf16(f)); }
/* 1 for a NaN with payload bits in its low half (the bf16 rounding bias could carry out of it) */
static inline int opg_low_nan(float f) {
    const uint32_t u = opg_u(f);
    return (u & 0x7FFFFFFFu) > 0x7F800000u && (u & 0xFFFFu) != 0;
}

/* IEEE binary16 held in float. opg_rnd_f16 rounds to the nearest half (ties to even): 11
   significant bits for |f| >= 2^-14, a multiple of 2^-24 below (the +0.5f sum rounds there),
   infinity from 65520 up. */
static inline float opg_rnd_f16(float f) {
    uint32_t u = opg_u(f), sign = u & 0x80000000u, a = u & 0x7FFFFFFFu;
    uint32_t nrm = (a + 0xFFFu + ((a >> 13) & 1u)) & 0xFFFFE000u;
    nrm = nrm >= 0x47800000u ? 0x7F800000u : nrm;
    uint32_t sub = opg_u((opg_f(a) + 0.5f) - 0.5f);
    uint32_t r = a < 0x38800000u ? sub : nrm;
    r = a > 0x7F800000u ? (a & 0xFFFFE000u) | 0x00400000u : r;
    return opg_f(sign | r);
}
static inline float opg_ld_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7FFFu;
    uint32_t nrm = (em << 13) + 0x38000000u;                /* exponent bias 15 -> 127 */
    nrm = em >= 0x7C00u ? nrm + 0x38000000u : nrm;          /* inf / NaN: exponent 255 */
    /* subnormal: (1 + m/1024) * 2^-14 - 2^-14 = m * 2^-24, exact */
    uint32_t sub = opg_u(opg_f((em << 13) + 0x38800000u) - 6.103515625e-05f);
    return opg_f(sign | (em < 0x0400u ? sub : nrm));
}
static inline uint16_t opg_st_f16(float f) {
    uint32_t u = opg_u(opg_rnd_f16(f)), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    uint32_t nrm = (a - 0x38000000u) >> 13;                 /* exact: low 13 bits are zero */
    nrm = a >= 0x7F800000u ? 0x7C00u | ((a >> 13) & 0x3FFu) : nrm;
    uint32_t sub = opg_u(opg_f(a) + 0.5f) - 0x3F000000u;    /* exact: a multiple of 2^-24 */
    return (uint16_t)(sign | (a < 0x38800000u ? sub : nrm));
}
"""


# --- explicit SIMD loop for f16 / bf16 bodies (gcc does not vectorise half conversions) --------
# One API over AVX-512 (16 lanes) or AVX2 + F16C (8 lanes): opg_v, OPG_W, opg_v_<op>.
V_OP = {"add": "opg_v_add", "sub": "opg_v_sub", "mul": "opg_v_mul", "div": "opg_v_div"}
V_LOAD = {F32: "opg_v_ld_f32(&{}[j])", F16: "opg_v_ld_f16(&{}[j])", BF16: "opg_v_ld_bf16(&{}[j])"}
V_ROUND = {F32: "{}", F16: "opg_v_rnd_f16({})", BF16: "opg_v_rnd_bf16({})"}
V_STORE = {F32: "opg_v_st_f32(&{}[j], {});", F16: "opg_v_st_f16(&{}[j], {});",
           BF16: "opg_v_st_bf16(&{}[j], {});"}
V_NT = {F32: "opg_v_nt_f32(&{}[j], {});", F16: "opg_v_nt_f16(&{}[j], {});",
        BF16: "opg_v_nt_bf16(&{}[j], {});"}
# a vector of the lanes in mask m (OPG_MASKED: AVX-512) loaded from a pointer
V_MLOAD = {F32: "opg_v_mld_f32(m, {})", F16: "opg_v_mld_f16(m, {})", BF16: "opg_v_mld_bf16(m, {})"}
# a vector stored to a pointer (the edges of a row go through a local array, simd.vector_edge)
V_STORE_TO = {F32: "opg_v_st_f32({}, {});", F16: "opg_v_st_f16({}, {});", BF16: "opg_v_st_bf16({}, {});"}
# a pair of bf16 vectors stored at once (render.paired): plain, non-temporal
V_ST2 = "opg_v_st2_bf16(&{q}[j], {lo}, {hi});"
V_NT2 = "opg_v_nt2_bf16(&{q}[j], {lo}, {hi});"

V_HELPERS = r"""/* vcvtps2ph rounds to nearest even (imm 0) and keeps a NaN's top payload bits, quieted, like
   opg_rnd_f16; the bf16 rounding below is opg_st_bf16 on every lane. Stores take registers that
   already hold values of the output dtype (a body's result has the output dtype), so the bf16
   store only drops the low half, and a rounding only the store reads need not clear it
   (opg_v_rnd_bf16_top). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define OPG_VEC 1
#define OPG_W 16
typedef __m512 opg_v;
#define opg_v_add _mm512_add_ps
#define opg_v_sub _mm512_sub_ps
#define opg_v_mul _mm512_mul_ps
#define opg_v_div _mm512_div_ps
#define opg_v_sqrt _mm512_sqrt_ps
#define opg_v_set1 _mm512_set1_ps
#define opg_v_ld_f32 _mm512_loadu_ps
#define opg_v_st_f32 _mm512_storeu_ps
static inline opg_v opg_v_rnd_f16(opg_v x) { return _mm512_cvtph_ps(_mm512_cvtps_ph(x, 0)); }
static inline opg_v opg_v_ld_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void opg_v_st_f16(uint16_t *p, opg_v x) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(x, 0)); }
static inline opg_v opg_v_rnd_bf16_qtop(opg_v x) {  /* RNE bf16 bits in the high half, low half not cleared */
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb));
}
static inline opg_v opg_v_rnd_bf16_top(opg_v x) {  /* opg_v_rnd_bf16_qtop; a NaN quieted, truncated */
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    const __m512i q = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, _mm512_castps_si512(opg_v_rnd_bf16_qtop(x)), q));
}
static inline opg_v opg_v_bf16_clear(opg_v x) {  /* the low half cleared: a bf16 value */
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline opg_v opg_v_split(opg_v a, opg_v b, int64_t k) {  /* lanes below k from a, the rest from b */
    return _mm512_mask_blend_ps((__mmask16)(0xFFFFu << k), a, b);
}
#if defined(__AVX512BW__) && defined(__AVX512VL__)  /* lanes [lo, hi) only: loads that do not fault past them */
#define OPG_MASKED 1
typedef __mmask16 opg_m;
static inline opg_m opg_m_range(int64_t lo, int64_t hi) { return (opg_m)(((1u << hi) - 1u) & ~((1u << lo) - 1u)); }
static inline opg_v opg_v_mld_f32(opg_m m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
static inline opg_v opg_v_mld_f16(opg_m m, const uint16_t *p) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
static inline opg_v opg_v_mld_bf16(opg_m m, const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline opg_v opg_v_madd(opg_v a, opg_m m, opg_v b) { return _mm512_mask_add_ps(a, m, a, b); }  /* a + b in m */
#endif
static inline opg_v opg_v_ld_bf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline void opg_v_st_bf16(uint16_t *p, opg_v x) {  /* x already holds bf16 values */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}
static inline void opg_v_nt_f32(float *p, opg_v x) { _mm512_stream_ps(p, x); }
static inline void opg_v_nt_f16(uint16_t *p, opg_v x) { _mm256_stream_si256((__m256i *)p, _mm512_cvtps_ph(x, 0)); }
static inline void opg_v_nt_bf16(uint16_t *p, opg_v x) {
    _mm256_stream_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}
#if defined(__AVX512BW__)  /* pairs of bf16 vectors: as on AVX2 below, four 128-bit lanes */
#define OPG_PAIR 1
typedef __m512i opg_vi;
static inline opg_vi opg_vi_ld(const uint16_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline opg_v opg_v_lo_bf16(opg_vi w) { return _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), w)); }
static inline opg_v opg_v_hi_bf16(opg_vi w) { return _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), w)); }
static inline opg_vi opg_vi_bf16(opg_v lo, opg_v hi) {  /* the high halves of lo's and hi's lanes, in order */
    return _mm512_packus_epi32(_mm512_srli_epi32(_mm512_castps_si512(lo), 16), _mm512_srli_epi32(_mm512_castps_si512(hi), 16));
}
static inline void opg_v_st2_bf16(uint16_t *p, opg_v lo, opg_v hi) { _mm512_storeu_si512((void *)p, opg_vi_bf16(lo, hi)); }
static inline void opg_v_nt2_bf16(uint16_t *p, opg_v lo, opg_v hi) { _mm512_stream_si512((void *)p, opg_vi_bf16(lo, hi)); }
static inline opg_v opg_v_lo_f32(const float *p) {  /* p[0..3], p[8..11], p[16..19], p[24..27] */
    return _mm512_shuffle_f32x4(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16), 0x88);
}
static inline opg_v opg_v_hi_f32(const float *p) {  /* p[4..7], p[12..15], p[20..23], p[28..31] */
    return _mm512_shuffle_f32x4(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16), 0xDD);
}
#endif
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define OPG_VEC 1
#define OPG_W 8
typedef __m256 opg_v;
#define opg_v_add _mm256_add_ps
#define opg_v_sub _mm256_sub_ps
#define opg_v_mul _mm256_mul_ps
#define opg_v_div _mm256_div_ps
#define opg_v_sqrt _mm256_sqrt_ps
#define opg_v_set1 _mm256_set1_ps
#define opg_v_ld_f32 _mm256_loadu_ps
#define opg_v_st_f32 _mm256_storeu_ps
static inline opg_v opg_v_rnd_f16(opg_v x) { return _mm256_cvtph_ps(_mm256_cvtps_ph(x, 0)); }
static inline opg_v opg_v_ld_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void opg_v_st_f16(uint16_t *p, opg_v x) { _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(x, 0)); }
static inline opg_v opg_v_rnd_bf16_qtop(opg_v x) {  /* RNE bf16 bits in the high half, low half not cleared */
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb));
}
static inline opg_v opg_v_rnd_bf16_top(opg_v x) {  /* opg_v_rnd_bf16_qtop; a NaN quieted, truncated */
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 q = _mm256_or_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)));
    return _mm256_blendv_ps(opg_v_rnd_bf16_qtop(x), q, nan);
}
static inline opg_v opg_v_bf16_clear(opg_v x) {  /* the low half cleared: a bf16 value */
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline opg_v opg_v_split(opg_v a, opg_v b, int64_t k) {  /* lanes below k from a, the rest from b */
    const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(below));
}
/* pairs of bf16 vectors (OPG_PAIR): one load of 2 * OPG_W elements widened into two vectors whose
   lanes interleave by 128-bit lane (elements 0-3 and 8-11, then 4-7 and 12-15), and packed back
   in order by packus, which also works per 128-bit lane: for element-wise bodies whose other
   operands are the same in every lane or loaded in that order (opg_v_lo_f32), where lane order
   changes nothing. AVX-512 has the same per-lane unpack and pack (AVX512BW, above). */
#define OPG_PAIR 1
typedef __m256i opg_vi;
static inline opg_vi opg_vi_ld(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline opg_v opg_v_lo_bf16(opg_vi w) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w)); }
static inline opg_v opg_v_hi_bf16(opg_vi w) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w)); }
static inline opg_vi opg_vi_bf16(opg_v lo, opg_v hi) {  /* the high halves of lo's and hi's lanes, in order */
    return _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(lo), 16), _mm256_srli_epi32(_mm256_castps_si256(hi), 16));
}
static inline void opg_v_st2_bf16(uint16_t *p, opg_v lo, opg_v hi) { _mm256_storeu_si256((__m256i *)p, opg_vi_bf16(lo, hi)); }
static inline void opg_v_nt2_bf16(uint16_t *p, opg_v lo, opg_v hi) { _mm256_stream_si256((__m256i *)p, opg_vi_bf16(lo, hi)); }
static inline opg_v opg_v_lo_f32(const float *p) {  /* p[0..3], p[8..11]: the lane order of opg_v_lo_bf16 */
    return _mm256_permute2f128_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), 0x20);
}
static inline opg_v opg_v_hi_f32(const float *p) {  /* p[4..7], p[12..15]: that of opg_v_hi_bf16 */
    return _mm256_permute2f128_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), 0x31);
}
static inline opg_v opg_v_ld_bf16(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline void opg_v_st_bf16(uint16_t *p, opg_v x) {
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(x), 16);  /* x holds bf16 values */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
/* non-temporal stores (the address is aligned to a whole vector of the output) */
static inline void opg_v_nt_f32(float *p, opg_v x) { _mm256_stream_ps(p, x); }
static inline void opg_v_nt_f16(uint16_t *p, opg_v x) { _mm_stream_si128((__m128i *)p, _mm256_cvtps_ph(x, 0)); }
static inline void opg_v_nt_bf16(uint16_t *p, opg_v x) {
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
    _mm_stream_si128((__m128i *)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8)));
}
#endif
#if defined(OPG_VEC)  /* both branches: the cleared and the NaN-free rounding, the pair width */
static inline opg_v opg_v_rnd_bf16(opg_v x) { return opg_v_bf16_clear(opg_v_rnd_bf16_top(x)); }
static inline opg_v opg_v_rnd_bf16_q(opg_v x) {  /* opg_v_rnd_bf16 where no NaN carries low bits */
    return opg_v_bf16_clear(opg_v_rnd_bf16_qtop(x));
}
#if defined(OPG_PAIR)
#define OPG_PW (2 * OPG_W)
#else
#define OPG_PW OPG_W
#endif
/* bytes of a cache line: non-temporal stores write whole ones (a part of a line left in a
   write-combining buffer, its rest written by ordinary stores, costs a partial write) */
#define OPG_LINE 64
#endif
"""


# the lane tree of l0ops.ordered (n = ceil(m/2), a[j] += a[j + n]) on every column of a
# [m][kc] block at once (kc a multiple of 16), a vector of columns at a time where OPG_VEC is
# defined (after V_HELPERS): a channels_last pass's lanes, or the serial call's sums over at most
# 64 elements, folded for all their kept indices together
V_FOLD_COLS = r"""static inline void opg_fold_cols(float *a, int64_t m, int64_t kc) {
    while (m > 1) {
        const int64_t n = (m + 1) / 2;
        for (int64_t j = 0; j < m - n; ++j) {
            float *const x = a + j * kc;
            const float *const y = a + (j + n) * kc;
#if defined(OPG_VEC)
            for (int64_t e = 0; e < kc; e += OPG_W) opg_v_st_f32(x + e, opg_v_add(opg_v_ld_f32(x + e), opg_v_ld_f32(y + e)));
#else
            for (int64_t e = 0; e < kc; ++e) x[e] += y[e];
#endif
        }
        m = n;
    }
}
"""

__all__ = ["BF16", "C_OP", "C_TYPE", "F16", "F32", "FLOATS", "HELPERS", "LOAD", "ROUND", "STORE",
           "V_FOLD_COLS", "V_HELPERS", "V_LOAD", "V_MLOAD", "V_NT", "V_NT2", "V_OP", "V_ROUND", "V_ST2",
           "V_STORE", "V_STORE_TO"]
