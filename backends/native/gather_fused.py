"""SyncBatchNormGatherStatsFused (the 950's gather of the ranks' statistics) as one serial C
call: the numpy semantics of :func:`l0ops.syncbn._gather_fused`, instruction for instruction in
float32 C (every step rounded as numpy rounds it, sums over the ranks sequential as the kernel
makes them, 1/sqrt from a correctly rounded ``sqrtf``), the results rounded to their dtype as
numpy's ``astype`` rounds. On numpy the ~30 array calls of a call on a few ranks took ~20 µs;
here it is one C call. A program that is just this node on the caller's tensors runs it on
their addresses (:class:`DirectGather`).

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
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from l0ops.syncbn import FusedStatsAttrs
from opgraph.core.backend import Addressed, data_addresses
from opgraph.core.dtypes import DataType, dtype_of
from opgraph.core.ir import Node
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
    if (W > 255 && W > C && cores > 1) {  /* one core: one block, the sequential sum */
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
   results, C each: mean, invstd, running mean, running var (a running stat may be its own
   result: each channel's old value is read before its new one is stored) */
int opg_gather_fused(int64_t W, int64_t C, int64_t cores, float m, float eps, void *const *p)
{{
    const {tm} *const mean = (const {tm} *)p[0];
    const {ti} *const invstd = (const {ti} *)p[1];
    const float *const counts = (const float *)p[2];
    const {tr} *const rm = (const {tr} *)p[3];
    const {tv} *const rv = (const {tv} *)p[4];
    {to} *const o_mean = ({to} *)p[5], *const o_inv = ({to} *)p[6], *const o_rm = ({to} *)p[7],
         *const o_rv = ({to} *)p[8];
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
_POINTERS = build.PointerArray(9)
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
    fn = _call(mean.dtype, invstd.dtype, counts.dtype, rm.dtype, rv.dtype)
    W, C = mean.shape
    out = np.empty((4, 1, C), mean.dtype)
    _run(fn, a, W, C, [address(x) for x in (mean, invstd, counts, rm, rv, *out)])
    return list(out)


def _call(mean: np.dtype, invstd: np.dtype, counts: np.dtype, rm: np.dtype, rv: np.dtype) -> Any:
    """The compiled call for operands of these dtypes (its results in mean's dtype)."""
    if counts != np.float32:
        raise Unsupported("SyncBatchNormGatherStatsFused: counts other than float32")
    key = (mean, invstd, rm, rv)
    fn = _CALLS.get(key)
    if fn is None:
        fn = build.load(render(*(dtype_of(d) for d in key), dtype_of(mean)),
                        symbol="opg_gather_fused").fn
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        fn = _CALLS.setdefault(key, fn)
    return fn


def _run(fn: Any, a: FusedStatsAttrs, W: int, C: int, addresses: Sequence[int]) -> None:
    """The call on the operands' and the results' addresses, in :data:`BODY`'s order."""
    if fn(W, C, a.cores, a.momentum, a.eps, _POINTERS(*addresses)):
        raise MemoryError("SyncBatchNormGatherStatsFused: no memory for the sums")


class DirectGather:
    """A compiled program that is this node on the caller's tensors (or reshapes of them), its
    four results placed by the memory plan in the caller's tensors (each then squeezed and
    copied there by redirection): BatchNormGatherStatsWithCounts on the 950 at level 2. Each run
    is the node's C call on the bound tensors' addresses, the results written where the
    node-by-node run copies them, so the same bits without the interpreter (~13 nodes of
    views and placements). ``operands`` and ``dests``: the binding names the node reads and
    writes; ``outputs``: the graph's outputs as ``(value name, binding name)``; ``counts_cast``:
    the Cast node the counts go through first (a half-precision model's counts, as torch rounds
    them), evaluated with its own numpy semantics as the node-by-node run does."""

    def __init__(self, node: Node, operands: Sequence[str], dests: Sequence[str],
                 outputs: Sequence[tuple[str, str]], counts_cast: Optional[Node] = None):
        self.node, self.operands, self.dests = node, tuple(operands), tuple(dests)
        self.outputs, self.counts_cast = tuple(outputs), counts_cast
        self.fn: Any = None  # the C call, once :meth:`prepare` has checked the layouts

    def prepare(self, bindings: Mapping[str, Addressed]) -> bool:
        """Whether the bound tensors suit the C call as they are: every operand and result
        one run of elements of the node's dtype (reshaping them moves nothing) and the results
        writable; then the call is looked up (compiled) for their dtypes."""
        values = [*self.node.inputs, *self.node.outputs]
        views = [bindings[n].view() for n in (*self.operands, *self.dests)]
        views[2] = self._counts(bindings)
        if not all(x.flags.c_contiguous and x.dtype == v.dtype.np and x.size == v.type.numel
                   for x, v in zip(views, values)) or not all(x.flags.writeable for x in views[5:]):
            return False
        try:
            self.fn = _call(*(x.dtype for x in views[:5]))
        except Unsupported:
            return False
        return True

    def run(self, bindings: Mapping[str, Addressed]) -> None:
        """The C call on the bound tensors (prepared)."""
        W, C = self.node.inputs[0].shape
        addresses = data_addresses(bindings, (*self.operands, *self.dests))
        counts = self._counts(bindings) if self.counts_cast is not None else None
        if counts is not None:  # the cast's array, kept alive through the call
            addresses[2] = address(counts)
        _run(self.fn, self.node.attrs, W, C, addresses)

    def _counts(self, bindings: Mapping[str, Addressed]) -> np.ndarray:
        """The counts operand: the bound tensor, or its cast (a new contiguous array)."""
        counts = bindings[self.operands[2]].view()
        if self.counts_cast is None:
            return counts
        cast = self.counts_cast
        with np.errstate(all="ignore"):  # as the node-by-node run evaluates it
            return np.ascontiguousarray(cast.opdef.compute([counts], cast.attrs)[0])

    def graph_outputs(self, bindings: Mapping[str, Addressed]) -> dict[str, np.ndarray]:
        """The graph's outputs by value name, as views of the tensors they were written to."""
        return {name: bindings[dest].view() for name, dest in self.outputs}


__all__ = ["DirectGather", "render", "run_gather_fused"]
