"""The SyncBatchNorm statistics kernels: SyncBatchNormGatherStatsWithCounts and
SyncBNTrainingUpdate (910B, prebuilt — formulas of their public TBE copies),
SyncBatchNormGatherStatsFused (950, kernel source) and SyncBatchNormBackwardReduce (950 DAG and
the 910B experimental kernel). Every step rounds to float32; where the source fixes a summation
order (the 950 fused kernel: sequential over ranks) it is followed, else the order of
:mod:`l0ops.ordered`.

    >>> import numpy as np
    >>> s, x, m, i = (np.float32([v]) for v in (2.0, 5.0, 1.0, 0.5))
    >>> [o.tolist() for o in SyncBatchNormBackwardReduce.compute([s, x, m, i],
    ...                                                          SyncBatchNormBackwardReduce.make_attrs())]
    [[3.0], [1.5]]
"""
from __future__ import annotations

import math

import numpy as np

from opgraph.core.dtypes import DataType
from opgraph.core.opdef import Fidelity, OpAttrs, require
from .define import define_op
from .primitives import as_f32

F32 = DataType.FLOAT
f32 = np.float32


class MomentumEpsAttrs(OpAttrs):
    """SyncBatchNormGatherStatsWithCounts's attributes: ``momentum``, the batch variance's weight
    in the running variance; ``epsilon``, added to the variance (subtracted back from each
    rank's 1/invstd²)."""

    momentum: float
    epsilon: float


def _f(xs) -> list[np.ndarray]:
    return [np.asarray(x).astype(np.float32) for x in xs]


# --- 910B ---------------------------------------------------------------------------------------
def _gather_with_counts(emit, args, a: MomentumEpsAttrs, ts):
    """vs = Σ_W ((1/invstd)² − eps + (mean − meanAll)²)·count; invstd = 1/sqrt(vs/countSum + eps);
    runningVar = rv·(1 − m) + (vs/(countSum − 1))·m — each step a float32 primitive, so one
    definition serves numpy, fusion and the native kernels."""
    mean, invstd, count, mean_all, count_sum, rv = args
    W, C = ts[0].shape
    fill = lambda v: emit("fill", [], F32, value=as_f32(v))
    r = emit("div", [fill(1.0), invstd], F32)
    v = emit("add", [emit("mul", [r, r], F32), fill(-as_f32(a.epsilon))], F32)
    d = emit("sub", [mean, mean_all], F32)
    t = emit("mul", [emit("add", [v, emit("mul", [d, d], F32)], F32), count], F32)
    vs = emit("sum", [t], F32, shape=(1, C), over=(W, C))
    std = emit("sqrt", [emit("add", [emit("div", [vs, count_sum], F32), fill(a.epsilon)], F32)], F32)
    inv = emit("div", [fill(1.0), std], F32)
    unbiased = emit("div", [vs, emit("add", [count_sum, fill(-1.0)], F32)], F32)
    m = f32(as_f32(a.momentum))
    rv_new = emit("add", [emit("mul", [rv, fill(f32(1) - m)], F32), emit("mul", [unbiased, fill(m)], F32)], F32)
    return emit("view", [inv], F32, shape=(C,)), rv_new


def _gather_with_counts_infer(ts, a):
    mean, invstd, count, mean_all, count_sum, rv = ts
    W, C = mean.shape if mean.rank == 2 else (None, None)
    require(mean.rank == 2 and all(t.shape == (W, C) for t in (invstd, count, mean_all)),
            "SyncBatchNormGatherStatsWithCounts", "mean, invstd, countB, meanAllB must be [W,C]")
    require(count_sum.shape == (1, C) and rv.shape == (1, C), "SyncBatchNormGatherStatsWithCounts",
            "countSum and runningVar must be [1,C]")
    require(all(t.dtype == F32 for t in ts), "SyncBatchNormGatherStatsWithCounts", "inputs are float32")
    return [invstd.with_(shape=(C,)), rv.with_()]


SyncBatchNormGatherStatsWithCounts = define_op(
    "SyncBatchNormGatherStatsWithCounts", attrs=MomentumEpsAttrs, num_inputs=6, kind="kernel",
    infer=_gather_with_counts_infer, expand=_gather_with_counts,
    fidelity=(Fidelity("formula", "no public 910B source (prebuilt); the op order of a public TBE "
                       "copy, 1/x and sqrt correctly rounded, the sum over ranks in opgraph's "
                       "order", (2201, 1001)),),
    doc="(invstd [C], runningVar [1,C]) from per-rank mean/invstd/count and the global mean.")


class MomentumAttrs(OpAttrs):
    """SyncBNTrainingUpdate's attributes: ``momentum``, the batch mean's weight m in
    mean·m + (rm − rm·m)."""

    momentum: float


def _update(emit, args, a: MomentumAttrs, ts) -> str:
    """mean·m + (rm − rm·m), each step in float32."""
    mean, rm = args
    m = emit("fill", [], F32, value=as_f32(a.momentum))
    return emit("add", [emit("mul", [mean, m], F32), emit("sub", [rm, emit("mul", [rm, m], F32)], F32)], F32)


def _update_infer(ts, a):
    require(ts[0].shape == ts[1].shape and all(t.dtype == F32 for t in ts), "SyncBNTrainingUpdate",
            "mean and runningMean must be float32 of one shape")
    return [ts[0].with_()]


SyncBNTrainingUpdate = define_op(
    "SyncBNTrainingUpdate", attrs=MomentumAttrs, num_inputs=2, infer=_update_infer, expand=_update,
    fidelity=(Fidelity("formula", "910B kernel prebuilt: the order of its public TBE copy and of "
                       "the 950 DAG (sync_bn_training_update_dag.h)"),),
    doc="The running-mean update mean·m + (rm − rm·m).")


# --- 950 ----------------------------------------------------------------------------------------
class FusedStatsAttrs(OpAttrs):
    """SyncBatchNormGatherStatsFused's attributes: ``momentum``, the batch statistics' weight in
    the running ones; ``eps``, added to the variance; ``cores``, the AIV cores (≥ 1) the sums
    over ranks are split by (only when W > 255 and W > C)."""

    momentum: float
    eps: float
    cores: int  # the AIV core count the kernel's row split follows (the platform's)


def sum_rows(t: np.ndarray, cores: int) -> np.ndarray:
    """Σ over axis 0 of [W, C] float32 as the 950 fused kernel does: sequentially from 0; with
    more than 255 ranks and more ranks than channels, per block of ceil(W/cores) rows, then
    the block sums in order."""
    W, C = t.shape
    if W > 255 and W > C and cores > 1:  # (one core: one block, the sequential sum)
        step = math.ceil(W / cores)
        return sum_rows(np.stack([sum_rows(t[b:b + step], cores) for b in range(0, W, step)]), cores)
    acc = np.zeros(C, np.float32)
    for n in range(W):
        acc = acc + t[n]
    return acc


def _gather_fused(xs, a: FusedStatsAttrs) -> list[np.ndarray]:
    """ops-nn sync_batch_norm_gather_stats_fused op_kernel (_common.h): all steps in float32,
    divisions correctly rounded, no guards for Σcount ≤ 1. Σcount is exact for whole-number
    counts below 2**24 (what the op takes); the kernel's own order for it (64-count chunks
    spread over cores, then per-core slots) is not modelled for fractional counts."""
    dtype = np.asarray(xs[0]).dtype
    mean, invstd, counts, rm, rv = _f(xs)
    eps, m = f32(a.eps), f32(a.momentum)
    cnt = counts.reshape(-1, 1)
    cs = sum_rows(counts.reshape(-1, 1), a.cores)[0]  # exact for integer counts below 2**24
    mean_all = sum_rows((mean * cnt) / cs, a.cores)
    r = f32(1) / invstd
    v = r * r + (-eps)
    d = mean - mean_all
    vs = sum_rows((d * d + v) * cnt, a.cores)
    one_m = f32(1) - m
    rv_new = (vs / (cs - f32(1))) * m + rv.reshape(-1) * one_m
    rm_new = rm.reshape(-1) * one_m + mean_all * m
    inv = f32(1) / np.sqrt(vs / cs + eps)
    return [np.asarray(o, np.float32).reshape(1, -1).astype(dtype) for o in (mean_all, inv, rm_new, rv_new)]


def _gather_fused_infer(ts, a):
    mean, invstd, counts, rm, rv = ts
    require(mean.rank == 2 and invstd.shape == mean.shape, "SyncBatchNormGatherStatsFused",
            "mean and invstd must be [W,C]")
    W, C = mean.shape
    require(a.cores >= 1, "SyncBatchNormGatherStatsFused", f"cores must be at least 1, got {a.cores}")
    require(counts.shape == (W,) and counts.dtype == F32, "SyncBatchNormGatherStatsFused",
            "counts must be float32 [W]")
    require(rm.shape == (1, C) and rv.shape == (1, C), "SyncBatchNormGatherStatsFused",
            "running stats must be [1,C]")
    out = rv.with_(dtype=mean.dtype)
    return [out, out, out, out]


SyncBatchNormGatherStatsFused = define_op(
    "SyncBatchNormGatherStatsFused", attrs=FusedStatsAttrs, num_inputs=5, kind="kernel",
    infer=_gather_fused_infer, compute=_gather_fused,
    fidelity=(Fidelity("bit-faithful", "950 kernel source (ops-nn sync_batch_norm_gather_stats_fused "
                       "op_kernel): op order, sequential sums over ranks (by blocks of "
                       "ceil(W/cores) when W > 255 and W > C); sqrt assumed correctly rounded; "
                       "whole-number counts", (3510,)),),
    doc="(meanAll, invstdAll, runningMean, runningVar), each [1,C], from per-rank stats.")


# --- both ---------------------------------------------------------------------------------------
def _backward_reduce(emit, args, a, ts) -> tuple[str, str]:
    """t = mean·sumDy; sumDyXmu = sumDyX − t; gradWeight = sumDyXmu·invstd (float32)."""
    sum_dy, sum_dy_x, mean, invstd = (r if t.dtype == F32 else emit("cast", [r], F32)
                                      for r, t in zip(args, ts))
    xmu = emit("sub", [sum_dy_x, emit("mul", [mean, sum_dy], F32)], F32)
    gw = emit("mul", [xmu, invstd], F32)
    back = lambda r, t: r if t.dtype == F32 else emit("cast", [r], t.dtype)  # noqa: E731
    return back(xmu, ts[0]), back(gw, ts[3])


def _backward_reduce_infer(ts, a):
    require(len({t.shape for t in ts}) == 1, "SyncBatchNormBackwardReduce",
            "sumDy, sumDyX, mean and invstd must share one shape")
    return [ts[0].with_(), ts[3].with_()]


SyncBatchNormBackwardReduce = define_op(
    "SyncBatchNormBackwardReduce", num_inputs=4, kind="kernel", infer=_backward_reduce_infer,
    expand=_backward_reduce,
    fidelity=(Fidelity("bit-faithful", "950 DAG (sync_batch_norm_backward_reduce_dag.h) and the "
                       "910B experimental AscendC kernel: the same three float32 steps"),),
    doc="(sumDyXmu, gradWeight) = (sumDyX − mean·sumDy, that·invstd).")
