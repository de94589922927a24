"""SyncBatchNormGatherStatsFused (the 950's gather of the ranks' statistics) as one serial C
call: the numpy semantics of :func:`l0ops.syncbn._gather_fused`, instruction for instruction in
float32 C (every step rounded as numpy rounds it, sums over the ranks sequential as the kernel
makes them, 1/sqrt from a correctly rounded ``sqrtf``), the results rounded to their dtype as
numpy's ``astype`` rounds. On numpy the ~30 array calls of a call on a few ranks took ~20 µs;
here it is one C call.

    >>> import numpy as np
    >>> from l0ops.syncbn import SyncBatchNormGatherStatsFused as G
    >>> xs = [np.float32([[2.0], [4.0]]), np.float32([[0.5], [0.5]]), np.float32([1, 3]),
    ...       np.float32([[0.0]]), np.float32([[1.0]])]
    >>> a = G.make_attrs(momentum=0.5, eps=0.0, cores=64)
    >>> got = run_gather_fused(a, xs)   # mean 3.5, Σ((mean − 3.5)² + 1/0.5² − eps)·count = 19
    >>> [float(o[0, 0]) for o in got]
    [3.5, 0.45883145928382874, 1.75, 3.6666667461395264]
    >>> all(np.array_equal(g, w) for g, w in zip(got, G.compute(xs, a)))   # numpy's semantics
    True
"""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

import numpy as np

from l0ops.syncbn import FusedStatsAttrs
from opgraph.core.dtypes import DataType, dtype_of
from . import build
from .build import address
from .c_text import C_TYPE, HELPERS, LOAD, STORE
from .unsupported import Unsupported

SUM_ROWS = r"""
/* l0ops.syncbn.sum_rows: the rows of t [W, C] (float32, row-major) added one after another
   from +0.0; with more than 255 rows and more rows than columns, per block of ceil(W / cores)
   rows, then the block sums the same way. 1 when out of memory. */
static int opg_sum_rows(const float *t, int64_t W, int64_t C, int64_t cores, float *out)
{
    if (W > 255 && W > C) {
        const int64_t step = (W + cores - 1) / cores, nb = (W + step - 1) / step;
        float *const blocks = (float *)malloc(sizeof(float) * nb * C);
        if (blocks == 0) return 1;
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t rows = W - b * step < step ? W - b * step : step;
            if (opg_sum_rows(t + b * step * C, rows, C, cores, blocks + b * C)) {
                free(blocks);
                return 1;
            }
        }
        const int failed = opg_sum_rows(blocks, nb, C, cores, out);
        free(blocks);
        return failed;
    }
    for (int64_t c = 0; c < C; ++c) out[c] = 0.0f;
    for (int64_t n = 0; n < W; ++n)
        for (int64_t c = 0; c < C; ++c) out[c] = out[c] + t[n * C + c];
    return 0;
}
"""

BODY = r"""
/* p: mean [W, C], invstd [W, C], counts [W], running mean [C], running var [C], then the
   results: 4 rows of C (mean, invstd, running mean, running var) */
int opg_gather_fused(int64_t W, int64_t C, int64_t cores, float m, float eps, void *const *p)
{{
    const {tm} *const mean = (const {tm} *)p[0];
    const {ti} *const invstd = (const {ti} *)p[1];
    const float *const counts = (const float *)p[2];
    const {tr} *const rm = (const {tr} *)p[3];
    const {tv} *const rv = (const {tv} *)p[4];
    {to} *const o_mean = ({to} *)p[5], *const o_inv = o_mean + C, *const o_rm = o_inv + C,
         *const o_rv = o_rm + C;
    float *const t = (float *)malloc(sizeof(float) * (W * C + 2 * C));
    if (t == 0) return 1;
    float *const mean_all = t + W * C, *const vs = mean_all + C;
    float cs;
    if (opg_sum_rows(counts, W, 1, cores, &cs)) {{ free(t); return 1; }}
    for (int64_t n = 0; n < W; ++n)
        for (int64_t c = 0; c < C; ++c) t[n * C + c] = ({ld_mean} * counts[n]) / cs;
    if (opg_sum_rows(t, W, C, cores, mean_all)) {{ free(t); return 1; }}
    for (int64_t n = 0; n < W; ++n)
        for (int64_t c = 0; c < C; ++c) {{
            const float r = 1.0f / {ld_inv};
            const float v = r * r + (-eps);
            const float d = {ld_mean} - mean_all[c];
            t[n * C + c] = (d * d + v) * counts[n];
        }}
    if (opg_sum_rows(t, W, C, cores, vs)) {{ free(t); return 1; }}
    const float one_m = 1.0f - m;
    for (int64_t c = 0; c < C; ++c) {{
        const float rv_new = (vs[c] / (cs - 1.0f)) * m + {ld_rv} * one_m;
        const float rm_new = {ld_rm} * one_m + mean_all[c] * m;
        const float inv = 1.0f / sqrtf(vs[c] / cs + eps);
        o_mean[c] = {st_mean};
        o_inv[c] = {st_inv};
        o_rm[c] = {st_rm};
        o_rv[c] = {st_rv};
    }}
    free(t);
    return 0;
}}
"""

_ARGTYPES = [ctypes.c_int64] * 3 + [ctypes.c_float] * 2 + [ctypes.c_void_p]
_POINTERS = build.PointerArray(6)
_CALLS: dict[tuple, Any] = {}  # numpy dtypes of mean, invstd, running mean, running var -> call


def render(tm: DataType, ti: DataType, tr: DataType, tv: DataType, to: DataType) -> str:
    """The C source for these dtypes of mean, invstd, running mean, running var and results."""
    if any(d not in LOAD for d in (tm, ti, tr, tv, to)):
        raise Unsupported("SyncBatchNormGatherStatsFused: operands of a dtype other than f32/f16/bf16")
    body = BODY.format(tm=C_TYPE[tm], ti=C_TYPE[ti], tr=C_TYPE[tr], tv=C_TYPE[tv], to=C_TYPE[to],
                       ld_mean=LOAD[tm].format("mean[n * C + c]"), ld_inv=LOAD[ti].format("invstd[n * C + c]"),
                       ld_rm=LOAD[tr].format("rm[c]"), ld_rv=LOAD[tv].format("rv[c]"),
                       **{f"st_{k}": STORE[to].format(v) for k, v in
                          (("mean", "mean_all[c]"), ("inv", "inv"), ("rm", "rm_new"), ("rv", "rv_new"))})
    return "\n".join(["#include <math.h>", "#include <stdlib.h>", HELPERS, SUM_ROWS, body])


def run_gather_fused(a: FusedStatsAttrs, args: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``(meanAll, invstdAll, runningMean', runningVar')``, each [1, C] in mean's dtype, as
    :func:`l0ops.syncbn._gather_fused` computes them (new arrays)."""
    mean, invstd, counts, rm, rv = (np.ascontiguousarray(x) for x in args)
    if counts.dtype != np.float32:
        raise Unsupported("SyncBatchNormGatherStatsFused: counts other than float32")
    key = (mean.dtype, invstd.dtype, rm.dtype, rv.dtype)
    fn = _CALLS.get(key)
    if fn is None:
        fn = build.load(render(*(dtype_of(d) for d in key), dtype_of(mean.dtype)),
                        symbol="opg_gather_fused").fn
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        fn = _CALLS.setdefault(key, fn)
    W, C = mean.shape
    out = np.empty((4, 1, C), mean.dtype)
    if fn(W, C, a.cores, a.momentum, a.eps, _POINTERS(*map(address, (mean, invstd, counts, rm, rv, out)))):
        raise MemoryError("SyncBatchNormGatherStatsFused: no memory for the sums")
    return list(out)


__all__ = ["render", "run_gather_fused"]
