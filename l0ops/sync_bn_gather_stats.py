"""SyncBatchNormGatherStats: global batch statistics from per-rank sums — the kernel behind
aclnnSyncBatchNormGatherStats (ops-nn norm/sync_batch_norm_gather_stats). Inputs totalSum and
totalSquareSum [N,C] (T), sampleCount [N] (int32), running mean and var [C] (T); outputs
(batchMean, batchInvstd, runningMean', runningVar'), each [C] in T. Attribute ``arch`` picks
the kernel:

* **3510 (Ascend950)**, from the arch35 kernel source: Σcount exactly in int64, then
  ``n = float(Σcount)``, ``reci = 1/n``, ``k = n/(n − 1)·m`` (scalars in float32); per channel in
  float32: ``bm = S·reci``; ``rm' = rm·(1 − m) + bm·m``; ``var = Q·reci − bm·bm``;
  ``invstd = 1/sqrt(var + eps)``; ``rv' = var·k + rv·(1 − m)``. No guard: Σcount ≤ 1 gives
  inf/NaN. S and Q (the sums over N) follow the kernel's templates and AscendC
  ``ReduceSum<float, RA>`` (see :func:`sum_rows_950`).
* **2201 (Ascend910B / 910_93)**, from the experimental 910B kernel (which binary ships is
  open): ``n`` summed as float32 row by row; ``reci = 0`` when n == 0; ``k = n/(n − 1)·m`` only
  when n > 1, else m; ``rv' = rv·(1 − m) + var·k``; S and Q summed row by row in float32.

f16/bf16 data is widened exactly and the four results are rounded once (RINT) to T.

    >>> import numpy as np
    >>> s, q = np.float32([[2.0], [4.0]]), np.float32([[4.0], [12.0]])   # 2 ranks, 1 channel
    >>> out = SyncBatchNormGatherStats.compute(
    ...     [s, q, np.int32([2, 2]), np.float32([0.0]), np.float32([1.0])],
    ...     SyncBatchNormGatherStats.make_attrs(momentum=0.5, eps=0.0, arch=3510))
    >>> [float(o[0]) for o in out]              # mean 1.5, var 4 − 2.25 = 1.75, invstd, rm', rv'
    [1.5, 0.7559289932250977, 0.75, 1.6666667461395264]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from opgraph.core.dtypes import DataType
from opgraph.core.opdef import Fidelity, L0Error, OpAttrs, require
from .define import define_op

F32, F16, BF16, S32 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16, DataType.INT32
f32 = np.float32
OP = "SyncBatchNormGatherStats"
KERNEL_DTYPES = {3510: (F32, F16, BF16), 2201: (F32, F16)}
VL_F32 = 64          # floats per 256-byte vector register (arch35)
UB_RESERVED = 96     # bytes the full-load tiling keeps back


class GatherStatsAttrs(OpAttrs):
    """SyncBatchNormGatherStats's attributes: ``momentum``, the batch statistics' weight in the
    running update; ``eps``, added to the variance; ``arch``, the kernel's NpuArch (3510 or
    2201); ``cores`` and ``ub_size`` (bytes), what the 950 tiling splits C over and sizes for."""

    momentum: float
    eps: float
    arch: int
    cores: int = 64          # AIV cores the 950 tiling splits C over (the platform's)
    ub_size: int = 245760    # UB bytes the 950 tiling sizes its tiles for


# --- 950: which template, which C tiles -----------------------------------------------------
@dataclass(frozen=True)
class Plan950:
    """The arch35 tiling's choice: ``n_factor`` None for the n-full-load template, else the
    n-not-full-load template with blocks of ``n_factor`` rows (``basic`` blocks, the first
    ``folds`` of them absorbing block ``b + basic``, block ``folds`` absorbing ``tail`` rows);
    ``widths``: the C tiles the kernel reduces one at a time, in order."""

    n_factor: Optional[int]
    basic: int
    folds: int
    tail: int
    widths: tuple[int, ...]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _full_load_tile(n: int, c: int, size: int, cores: int, ub: int) -> Optional[int]:
    """cTileNum of DoOpTiling, or None when N rows of one tile do not fit (128-byte minimum)."""
    if size == 4:
        tile = ((ub - UB_RESERVED) // size - 3 * n) // (14 + 4 * n)
    else:
        tile = ((ub - UB_RESERVED) // size - 6 * n) // (16 + 8 * n)
    tile = tile // (32 // size) * (32 // size)
    if tile <= 0 or tile * size < 128:
        return None
    outer = _ceil(c, tile)
    if _ceil(outer, _ceil(outer, cores)) < cores // 2:  # few tiles: spread C over half the cores
        aligned = _ceil(_ceil(c, cores // 2) * size, 32) * 32 // size
        lowest = 32 // size
        if aligned < tile:
            tile = lowest if aligned < lowest < tile else aligned
    return tile


def _pow2_below(value: int) -> int:
    """FindNearestPower2: 0 for value ≤ 1, else the largest power of two below value."""
    return 0 if value <= 1 else 1 << ((value - 1).bit_length() - 1)


def plan_950(n: int, c: int, size: int, cores: int, ub: int) -> Plan950:
    """The arch35 tiling (sync_batch_norm_gather_stats_tiling_arch35.cpp) for N×C of a
    ``size``-byte T.

    >>> p = plan_950(8, 256, 4, 64, 245760)         # full load, C spread over 32 cores
    >>> p.n_factor, len(p.widths), set(p.widths)
    (None, 32, {8})
    >>> p = plan_950(1000, 64, 4, 64, 245760)       # 7 blocks of 128 rows + 104 onto 4 basic
    >>> p.n_factor, p.basic, p.folds, p.tail
    (128, 4, 3, 104)
    """
    tile = _full_load_tile(n, c, size, cores, ub)
    if tile is not None:
        outer = _ceil(c, tile)
        return Plan950(None, 0, 0, 0, (tile,) * (outer - 1) + (c - (outer - 1) * tile,))
    base = 128 // size
    per_core = max(base, _ceil(_ceil(c, cores), base) * base)
    blocks = _ceil(c, per_core)
    tile_base = min(512 // size if size == 4 else base, per_core)
    best = None
    for nt in (64, 128, 256, 512):
        total = _ceil(n, nt)
        basic = _pow2_below(total)
        caches = basic.bit_length() if basic else 1
        room = ub - 32 * 3 - 2 * nt * 4 - nt * 4 * 2 - (caches + 1) * 32
        per_c = (size * (4 * nt + caches + 2 + 8) if size == 4
                 else 2 * 3 * nt * size + nt * 4 + (caches + 2) * 4 + 4 * 2 * size)
        tile = room // per_c // tile_base * tile_base
        if (tile <= per_core and nt != 64) or tile <= 0:
            break
        best = (nt, basic, n // nt - basic, n % nt, tile)
    if best is None:
        raise L0Error(f"{OP}: tiling failed: the C axis cannot be tiled (N = {n}, UB {ub} bytes)")
    nt, basic, folds, tail, tile = best
    widths: list[int] = []
    for b in range(blocks):
        span = per_core if b < blocks - 1 else c - (blocks - 1) * per_core
        loops = _ceil(span, tile)
        widths += [tile] * (loops - 1) + [span - (loops - 1) * tile]
    return Plan950(nt, basic, folds, tail, tuple(widths))


# --- 950: the order of the float32 sums over N ---------------------------------------------
def _halve(a: np.ndarray) -> np.ndarray:
    """Fold a power-of-two number of rows in halves: row r += row r + M/2 until one is left."""
    while a.shape[0] > 1:
        m = a.shape[0] // 2
        a = a[:m] + a[m:]
    return a[0]


def ra_fold(x: np.ndarray, grouped: bool) -> np.ndarray:
    """AscendC ``ReduceSum<float, Pattern::Reduce::RA>`` (asc-devkit
    reduce_common_ra_reuse_align_3510_impl.h) of rows ``x`` [R, C]: the rows past the largest
    power of two M ≤ R are added onto the first ones, then M rows fold in halves. ``grouped``
    (the aligned tile is 33–64 floats wide: ReduceRALessThanVL) folds consecutive groups of 16
    rows first, each in halves, while 16 or more rows are left.

    >>> x = np.float32([[1e8], [1.0], [-1e8]])      # (r0 + r2) + r1, not (r0 + r1) + r2
    >>> float(ra_fold(x, False)[0])
    1.0
    """
    r = x.shape[0]
    m = 1 << (r.bit_length() - 1)
    a = x[:m].copy()
    a[: r - m] += x[m:]
    if grouped:
        while a.shape[0] >= 16:
            g = a.reshape(a.shape[0] // 16, 16, -1)
            for half in (8, 4, 2, 1):
                g = g[:, :half] + g[:, half: 2 * half]
            a = g[:, 0]
    return _halve(a)


def _tile_fold(rows: np.ndarray, grouped_cols: np.ndarray) -> np.ndarray:
    out = ra_fold(rows, False)
    if grouped_cols.any() and rows.shape[0] >= 32:  # below 32 rows both orders are the same
        out[grouped_cols] = ra_fold(rows[:, grouped_cols], True)
    return out


def sum_rows_950(x: np.ndarray, plan: Plan950, size: int) -> np.ndarray:
    """Σ over axis 0 of float32 [N, C] as the arch35 kernel sums it. Full load: one RA fold of
    all N rows per C tile. Not full load: block b (``n_factor`` rows) first adds block
    ``b + basic`` row by row (a partial block for b == folds), is RA-folded, and the ``basic``
    block results are combined pairwise ((b0 + b1) + (b2 + b3)) … (the kernel's binary cache).
    Each tile's RA fold takes the grouped path when its width aligned to 32 bytes of T is
    33–64 floats."""
    align = 32 // size
    grouped = np.concatenate([np.full(w, VL_F32 // 2 < _ceil(w, align) * align <= VL_F32)
                              for w in plan.widths])
    if plan.n_factor is None:
        return _tile_fold(x, grouped)
    nf, basic = plan.n_factor, plan.basic
    parts = []
    for b in range(basic):
        blk = x[b * nf: (b + 1) * nf].copy()
        extra = nf if b < plan.folds else (plan.tail if b == plan.folds else 0)
        blk[:extra] += x[(b + basic) * nf: (b + basic) * nf + extra]
        parts.append(_tile_fold(blk, grouped))
    acc = np.stack(parts)  # basic is a power of two: the binary cache pairs neighbours
    while acc.shape[0] > 1:
        acc = acc[0::2] + acc[1::2]
    return acc[0]


# --- the kernels ------------------------------------------------------------------------------
def _per_channel(s, q, rm, rv, reci, k, m, eps, one_m, arch: int) -> list[np.ndarray]:
    bm = s * reci
    rm_new = rm * one_m + bm * m
    var = q * reci - bm * bm
    inv = f32(1) / np.sqrt(var + eps)
    rv_new = var * k + rv * one_m if arch == 3510 else rv * one_m + var * k
    return [bm, inv, rm_new, rv_new]


def _compute(xs, a: GatherStatsAttrs) -> list[np.ndarray]:
    s, q, count, rm, rv = (np.asarray(x) for x in xs)
    dtype = s.dtype
    s32, q32, rm32, rv32 = (x.astype(np.float32) for x in (s, q, rm, rv))
    m, eps = f32(a.momentum), f32(a.eps)
    one_m = f32(1) - m
    with np.errstate(all="ignore"):
        if a.arch == 3510:
            n = f32(int(count.astype(np.int64).sum()))
            reci, k = f32(1) / n, n / (n - f32(1)) * m
            plan = plan_950(s.shape[0], s.shape[1], dtype.itemsize, a.cores, a.ub_size)
            S = sum_rows_950(s32, plan, dtype.itemsize)
            Q = sum_rows_950(q32, plan, dtype.itemsize)
        else:
            n = f32(0)
            for c in count:
                n = f32(n + f32(c))
            reci = f32(0) if n == 0 else f32(1) / n
            k = n / (n - f32(1)) * m if n > 1 else m
            S, Q = np.zeros(s.shape[1], np.float32), np.zeros(s.shape[1], np.float32)
            for row in range(s.shape[0]):
                S, Q = S + s32[row], Q + q32[row]
        outs = _per_channel(S, Q, rm32, rv32, reci, k, m, eps, one_m, a.arch)
    return [np.asarray(o, np.float32).astype(dtype) for o in outs]


def _infer(ts, a: GatherStatsAttrs):
    s, q, count, rm, rv = ts
    require(a.arch in KERNEL_DTYPES, OP, f"no kernel for DAV_{a.arch} (modelled: 3510, 2201)")
    require(a.cores >= 1, OP, f"cores must be at least 1, got {a.cores}")
    require(s.rank == 2 and q.shape == s.shape, OP, f"totalSum and totalSquareSum must be one [N,C], "
            f"got {s} and {q}")
    n, c = s.shape
    require(n > 0 and c > 0, OP, f"empty input {s}")
    require(count.shape == (n,) and count.dtype == S32, OP, f"sampleCount must be s32[{n}], got {count}")
    require(rm.shape == (c,) and rv.shape == (c,), OP, f"mean and variance must be [{c}], got {rm}, {rv}")
    require(len({t.dtype for t in (s, q, rm, rv)}) == 1 and s.dtype in KERNEL_DTYPES[a.arch], OP,
            f"totalSum, totalSquareSum, mean and variance must share one of "
            f"{', '.join(d.short for d in KERNEL_DTYPES[a.arch])}")
    if a.arch == 3510:
        plan_950(n, c, s.dtype.itemsize, a.cores, a.ub_size)  # the tiling runs in phase 1
    return [rm.with_(), rv.with_(), rm.with_(), rv.with_()]


SyncBatchNormGatherStats = define_op(
    OP, attrs=GatherStatsAttrs, num_inputs=5, kind="kernel", infer=_infer, compute=_compute,
    fidelity=(Fidelity("bit-faithful", "950 kernel source (ops-nn sync_batch_norm_gather_stats "
                       "arch35 n_full_load.h / n_not_full_load.h and its tiling): exact int64 "
                       "count sum, float32 steps in the kernel's order, the sums over N in the "
                       "order of AscendC ReduceSum<RA> as read in hicann/asc-devkit; sqrt and "
                       "the scalar divisions assumed correctly rounded", (3510,)),
              Fidelity("formula", "which 910B kernel ships is open (Q14): the experimental 910B "
                       "AscendC kernel's steps and guards (float count sum, reci = 0 for "
                       "Σcount = 0, unbiased factor only for Σcount > 1); sums over N row by row "
                       "in float32 (that kernel's order for some tilings only)", (2201,))),
    doc="(batchMean, batchInvstd, runningMean', runningVar') [C] from per-rank Σx [N,C], Σx² "
        "[N,C], counts [N] and the running statistics.")

__all__ = ["SyncBatchNormGatherStats", "Plan950", "plan_950", "ra_fold", "sum_rows_950"]
