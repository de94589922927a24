"""aclnnBatchNormGatherStatsWithCounts, composed like the C++ op_api (ops-nn
norm/sync_batch_norm_gather_stats_with_counts/op_host/op_api/aclnn_batch_norm_gather_stats_with_counts.cpp):
W ranks' per-channel ``mean``/``invstd`` [W,C], weighted by ``counts`` [W], become the global
``meanAll``/``invstdAll`` [C]; ``runningMean``/``runningVar`` [C] are updated in place.

Checks in the vendor's order: NULL input, mean, invstd, counts, meanAll, invstdAll (161001);
the dtypes of input, mean, invstd, runningMean, runningVar, counts, meanAll, invstdAll in
{F32, F16} plus BF16 on 910B/910_93/950 — counts too, so INT32 counts are rejected; private
formats of input, mean, invstd, counts; then the shapes (161002). An empty ``mean`` fills
meanAll with 0 and invstdAll with NaN and leaves the running stats alone. The path is chosen by
``SocVersion == ASCEND950``:

- 910B, 910_93, 910: a chain in float32 — running-stat prep (Cast to F32, [1,C]; NULL → zeros),
  counts broadcast to [W,C], ReduceSum, ReduceMeanWithCount (meanAll), the
  SyncBatchNormGatherStatsWithCounts kernel (invstd, runningVar), SyncBNTrainingUpdate
  (runningMean); copies into runningVar, runningMean, meanAll, invstdAll in that order.
- 950: one SyncBatchNormGatherStatsFused kernel in mean's dtype (running stats uncast, NULL → zeros
  in input's dtype); copies into meanAll, invstdAll, runningMean, runningVar.

Quirks kept: a NULL runningMean with a given runningVar leaves runningVar untouched; on 950 a
running stat whose dtype differs from mean's fails in ViewCopy (561103); no guard for
Σcounts ≤ 1 (inf/NaN). Where opgraph answers instead of the vendor's undefined behaviour:
runningMean given with runningVar NULL dereferences NULL in the vendor code → 161001 naming
runningVar; a 0-d counts has its dim 0 read before its rank is checked → 161002 naming counts;
on 950, the fused kernel's tiling rejections (invstd or a running stat — a NULL one is a zero fill
in input's dtype — not in mean's dtype, momentum outside [0, 1], eps ≤ 0) are only logged by the
vendor's l0 wrapper, so phase 1 succeeds there with an undetermined run → 561002 naming the
cause, after every check the vendor does make. 310P/310B (no kernels) → 561003 after the checks.

    >>> import numpy as np, opgraph
    >>> t = opgraph.tensor
    >>> mean_all, invstd_all = np.zeros(2, np.float32), np.zeros(2, np.float32)
    >>> st, ws, ex = aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize(
    ...     t(np.zeros((4, 2), np.float32)), t(np.float32([[0, 1], [2, 3]])), t(np.ones((2, 2), np.float32)),
    ...     None, None, 0.1, 1e-5, t(np.float32([1, 3])), t(mean_all), t(invstd_all))
    >>> aclnnBatchNormGatherStatsWithCounts(bytearray(ws) if ws else None, ws, ex)
    <Status.ACLNN_SUCCESS: 0>
    >>> mean_all.tolist(), [round(float(v), 4) for v in invstd_all]
    ([1.5, 2.5], [0.7559, 0.7559])
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from l0ops.basic import BroadcastTo, Cast, Contiguous, Fill, UnsqueezeNd, ViewCopy
from l0ops.primitives import as_f32
from l0ops.reduce import ReduceMeanWithCount, ReduceSum
from l0ops.syncbn import (SyncBatchNormGatherStatsFused, SyncBatchNormGatherStatsWithCounts,
                          SyncBNTrainingUpdate)
from l0ops.views import ReFormat, SqueezeNd
from opgraph.core.dtypes import DataType, Format
from opgraph.core.executor import Executor
from opgraph.core.ir import Value
from opgraph.core.opapi import Arrays, InputConfig, Option, Param
from opgraph.core.opdef import L0Error
from opgraph.core.platform import Platform
from opgraph.core.status import AclnnError, Status
from opgraph.core.tensor import Tensor
from .common import (F32, check_channel_vector, check_dtype, check_not_private, check_rank,
                     float_dtypes, invalid, require_kernel)
from .direct import NUMPY_CALLS
from .pythonic import as_tensor, output, refuse_null, result, run_op_api
from .twophase import check_not_null, op_api, run_executor

PLATFORMS = ("Ascend910B", "Ascend910_93", "Ascend950", "Ascend910")  # the doc: not 310B/310P
FUSED_SOC = "Ascend950"  # the gate is SocVersion == ASCEND950, not IsRegbase
DTYPE_ORDER = ("input", "mean", "invstd", "runningMean", "runningVar", "counts", "meanAll", "invstdAll")
PARAMS = (Param("input", "tensor", "input"), Param("mean", "tensor", "input"),
          Param("invstd", "tensor", "input"),
          Param("runningMean", "tensor", "inout", optional=True),
          Param("runningVar", "tensor", "inout", optional=True),
          Param("momentum", "double", "attr"), Param("eps", "double", "attr"),
          Param("counts", "tensor", "input"), Param("meanAll", "tensor", "output"),
          Param("invstdAll", "tensor", "output"))


def check_shapes(t: dict[str, Optional[Tensor]]) -> None:
    """CheckShape, in the vendor's order (161002)."""
    inp, mean, invstd, counts = t["input"], t["mean"], t["invstd"], t["counts"]
    check_rank("input", inp)
    for name in ("mean", "invstd"):
        if t[name].ndim != 2:
            raise invalid(f"{name}: rank {t[name].ndim} must be 2 ([W, C], W = number of ranks)")
    W = mean.shape[0]
    if invstd.shape[0] != W:
        raise invalid(f"invstd: first dim {invstd.shape[0]} must equal mean's {W} (shapes "
                      f"{list(mean.shape)}, {list(invstd.shape)})")
    if counts.ndim == 0:  # the vendor reads dim 0 of a 0-d shape here (undefined)
        raise invalid(f"counts: rank 0; must be 1-D [W] = [{W}]")
    if counts.shape[0] != W:
        raise invalid(f"counts: first dim {counts.shape[0]} must equal mean's {W} (the number of ranks)")
    C = inp.shape[1]
    for name in ("mean", "invstd"):
        if t[name].shape[1] != C:
            raise invalid(f"{name}: second dim {t[name].shape[1]} must be C = {C} (input.shape[1])")
    check_channel_vector("runningMean", t["runningMean"], C)
    check_channel_vector("runningVar", t["runningVar"], C)
    if counts.ndim != 1:
        raise invalid(f"counts: rank {counts.ndim} must be 1 (shape {list(counts.shape)})")
    check_channel_vector("meanAll", t["meanAll"], C)
    check_channel_vector("invstdAll", t["invstdAll"], C)


def check_params(p: Platform, t: dict[str, Optional[Tensor]]) -> None:
    """CheckNotNull, CheckDtypeValid, CheckFormat, CheckShape — in that order."""
    check_not_null(**{k: t[k] for k in ("input", "mean", "invstd", "counts", "meanAll", "invstdAll")})
    allowed = float_dtypes(p)
    for name in DTYPE_ORDER:
        check_dtype(name, t[name], allowed, p)
    for name in ("input", "mean", "invstd", "counts"):
        check_not_private(name, t[name])
    check_shapes(t)


def fill_with(ex: Executor, dst: Value, value: float) -> Value:
    """ProcessEmptyTensorWithValue: Fill(dst's shape, value in dst's dtype), re-tag ND, ViewCopy."""
    filled = Fill(ex, shape=dst.type.shape, value=value, dtype=dst.dtype)
    return ViewCopy(ex, ReFormat(ex, filled, format=Format.ND), dst)


def running_mid(ex: Executor, t: Optional[Value], C: int, to: Optional[DataType],
                fill_dtype: DataType) -> Value:
    """CalculateRunningTensor[NoCast]: Contiguous (→ Cast ``to``) → UnsqueezeNd([0]) → re-tag ND,
    giving [1,C]; NULL → zeros [1,C] of ``fill_dtype`` (Fill + re-tag ND)."""
    if t is None:
        v = Fill(ex, shape=(1, C), value=0.0, dtype=fill_dtype)
    else:
        v = Contiguous(ex, t)
        if to is not None:
            v = Cast(ex, v, to=to)
        v = UnsqueezeNd(ex, v, dims=(0,))
    return ReFormat(ex, v, format=Format.ND)


def cast_to(ex: Executor, x: Value, dtype: DataType) -> Value:
    """A Cast only where the vendor makes one: when the dtypes differ."""
    return x if x.dtype == dtype else Cast(ex, x, to=dtype)


def copy_to(ex: Executor, x: Value, dst: Value, name: str) -> Value:
    """SqueezeNd([0]) then ViewCopy into the user tensor ``name`` (561103 naming it if refused)."""
    try:
        return ViewCopy(ex, SqueezeNd(ex, x, dims=(0,)), dst)
    except L0Error as e:
        raise AclnnError(Status.ACLNN_ERR_INNER_NULLPTR,
                         f"{name}: ViewCopy of the result ({x.dtype.name}) returned NULL: {e}") from None


def copy_mean_invstd(ex: Executor, mean_all: Value, invstd_all: Value, v: dict[str, Value]) -> list[Value]:
    """CopyMeanAndInvstdToDst: both Casts first (where needed), then meanAll, then invstdAll."""
    m = cast_to(ex, mean_all, v["meanAll"].dtype)
    i = cast_to(ex, invstd_all, v["invstdAll"].dtype)
    return [copy_to(ex, m, v["meanAll"], "meanAll"), copy_to(ex, i, v["invstdAll"], "invstdAll")]


def running_var_crash() -> AclnnError:
    """161001 for a runningMean given without runningVar, where the vendor op_api crashes."""
    return AclnnError(Status.ACLNN_ERR_PARAM_NULLPTR,
                      "runningVar: must not be NULL when runningMean is given (pass both or neither; "
                      "the vendor op_api dereferences the NULL runningVar here and crashes)")


def gather_chain(ex: Executor, v: dict[str, Value], C: int, momentum: float, eps: float) -> None:
    """910B/910_93/910: the float32 l0 chain, in emission order."""
    rm_mid = running_mid(ex, v.get("runningMean"), C, F32, F32)
    rv_mid = running_mid(ex, v.get("runningVar"), C, F32, F32)
    mean_f = Cast(ex, Contiguous(ex, v["mean"]), to=F32)
    invstd_f = Cast(ex, Contiguous(ex, v["invstd"]), to=F32)
    counts_f = Cast(ex, Contiguous(ex, v["counts"]), to=F32)
    count_b = BroadcastTo(ex, UnsqueezeNd(ex, counts_f, dims=(-1,)), shape=invstd_f.type.shape)
    count_sum = ReduceSum(ex, count_b, axes=(0,), keepdims=True)
    count_sum_b = BroadcastTo(ex, count_sum, shape=count_b.type.shape)
    mean_all = ReduceMeanWithCount(ex, mean_f, count_b, count_sum_b, axes=(0,), keepdims=True)
    mean_all_b = BroadcastTo(ex, mean_all, shape=mean_f.type.shape)
    invstd_all, rv_out = SyncBatchNormGatherStatsWithCounts(
        ex, mean_f, invstd_f, count_b, mean_all_b, count_sum, rv_mid, momentum=momentum, epsilon=eps)
    outs = []
    if "runningMean" in v:  # CopyRunningTensorToDst returns early without runningMean
        rm_out = SyncBNTrainingUpdate(ex, mean_all, rm_mid, momentum=momentum)
        rm_out = cast_to(ex, rm_out, v["runningMean"].dtype)
        if "runningVar" not in v:
            raise running_var_crash()
        rv_out = cast_to(ex, rv_out, v["runningVar"].dtype)
        outs += [copy_to(ex, rv_out, v["runningVar"], "runningVar"),
                 copy_to(ex, rm_out, v["runningMean"], "runningMean")]
    ex.output(*outs, *copy_mean_invstd(ex, mean_all, invstd_all, v))


def fused_tiling_error(v: dict[str, Value], rm: Value, rv: Value, momentum: float,
                       eps: float) -> Optional[AclnnError]:
    """What the fused kernel's tiling rejects (the vendor's l0 wrapper only logs it), or None."""
    d = v["mean"].dtype
    why = None
    if v["invstd"].dtype != d:
        why = f"invstd: dtype {v['invstd'].dtype.name} differs from mean's {d.name}"
    for name, x in (("runningMean", rm), ("runningVar", rv)):
        if why is None and x.dtype != d:
            why = (f"{name}: dtype {x.dtype.name} differs from mean's {d.name}" if name in v else
                   f"input: {name} is NULL, so it is zeros in input's dtype {x.dtype.name}, which "
                   f"differs from mean's {d.name}")
    if why is None and (momentum < 0.0 or momentum > 1.0):
        why = f"momentum: {momentum} (as float) is outside [0, 1]"
    if why is None and eps <= 0.0:
        why = f"eps: {eps} (as float) must be positive"
    if why is None:
        return None
    return AclnnError(Status.ACLNN_ERR_INNER_TILING_ERROR,
                      f"{why}; the Ascend950 fused kernel's tiling rejects this (the vendor's l0 "
                      "wrapper only logs it, so what would run is undetermined)")


def gather_fused(ex: Executor, v: dict[str, Value], C: int, input_dtype: DataType,
                 momentum: float, eps: float) -> None:
    """950: one fused kernel, in emission order."""
    rm_mid = running_mid(ex, v.get("runningMean"), C, None, input_dtype)
    rv_mid = running_mid(ex, v.get("runningVar"), C, None, input_dtype)
    mean_c, invstd_c = Contiguous(ex, v["mean"]), Contiguous(ex, v["invstd"])
    counts_f = Cast(ex, Contiguous(ex, v["counts"]), to=F32)
    rm_c, rv_c = Contiguous(ex, rm_mid), Contiguous(ex, rv_mid)
    tiling = fused_tiling_error(v, rm_c, rv_c, momentum, eps)
    mean_all, invstd_all, rm_out, rv_out = SyncBatchNormGatherStatsFused(
        ex, mean_c, invstd_c, counts_f, rm_c, rv_c, momentum=momentum, eps=eps,
        cores=ex.platform.vector_cores)
    outs = copy_mean_invstd(ex, mean_all, invstd_all, v)
    if "runningMean" in v:  # CopyResultTensorToDst: no Cast
        outs.append(copy_to(ex, rm_out, v["runningMean"], "runningMean"))
        if "runningVar" not in v:
            raise running_var_crash()
        outs.append(copy_to(ex, rv_out, v["runningVar"], "runningVar"))
    if tiling is not None:
        raise tiling
    ex.output(*outs)


# --- what the CLI, the backend kit and the docs need beyond the compose function -------------
def make_inputs(cfg: InputConfig, rng: np.random.Generator) -> Arrays:
    """Random valid arguments: ``ranks`` rows of mean ~ N(0, 1) and invstd in [0.5, 2), whole
    counts in 1..16, running stats (unless ``no_running_stats``), momentum 0.1, eps 1e-5."""
    W, shape, d = cfg.option("ranks"), cfg.shape, cfg.dtype.np
    if W < 0:
        raise ValueError(f"ranks: {W} is negative (the number of ranks W must be >= 0)")
    C = shape[1]
    running = not cfg.option("no_running_stats")
    return {
        "input": rng.standard_normal(shape).astype(d),
        "mean": rng.standard_normal((W, C)).astype(d),
        "invstd": rng.uniform(0.5, 2.0, (W, C)).astype(d),
        "runningMean": rng.standard_normal(C).astype(d) if running else None,
        "runningVar": rng.uniform(0.5, 2.0, C).astype(d) if running else None,
        "momentum": 0.1, "eps": 1e-5,
        "counts": rng.integers(1, 17, W).astype(d),
        "meanAll": np.zeros(C, d), "invstdAll": np.zeros(C, d),
    }


def input_bytes(cfg: InputConfig) -> int:
    """Bytes of the arrays :func:`make_inputs` makes, computed without making them."""
    W, C = max(cfg.option("ranks"), 0), cfg.shape[1]
    per_channel = 2 if cfg.option("no_running_stats") else 4
    return (math.prod(cfg.shape) + 2 * W * C + W + per_channel * C) * cfg.dtype.itemsize


def reference(a: Arrays) -> dict[str, np.ndarray]:
    """The formulas in float64 (empty mean: meanAll 0, invstdAll NaN):
    ``n = Σcounts``, ``meanAll = Σ counts·mean / n``,
    ``var = Σ counts·(1/invstd² − eps + (mean − meanAll)²) / n``, ``invstdAll = 1/sqrt(var + eps)``;
    with runningMean: ``rm·(1 − m) + meanAll·m`` and ``rv·(1 − m) + var·n/(n − 1)·m``."""
    f = {k: np.asarray(v).astype(np.float64) for k, v in a.items() if isinstance(v, np.ndarray)}
    mean, invstd, cnt = f["mean"], f["invstd"], f["counts"].reshape(-1, 1)
    if mean.size == 0:
        C = f["meanAll"].shape[0]
        return {"meanAll": np.zeros(C), "invstdAll": np.full(C, np.nan)}
    eps, m = float(a["eps"]), float(a["momentum"])
    n = cnt.sum()
    mean_all = (cnt * mean).sum(axis=0) / n
    var = (cnt * (1 / invstd ** 2 - eps + (mean - mean_all) ** 2)).sum(axis=0) / n
    out = {"meanAll": mean_all, "invstdAll": 1 / np.sqrt(var + eps)}
    if "runningMean" in f and "runningVar" in f:
        out["runningMean"] = f["runningMean"] * (1 - m) + mean_all * m
        out["runningVar"] = f["runningVar"] * (1 - m) + var * n / (n - 1) * m
    return out


@op_api("aclnnBatchNormGatherStatsWithCounts", params=PARAMS, platforms=PLATFORMS,
        dtypes=float_dtypes, make_inputs=make_inputs, input_bytes=input_bytes,
        reference=reference, rank=(2, 8),
        options=(Option("ranks", "int", 3, "number of ranks W (rows of mean, invstd, counts)"),
                 Option("no_running_stats", "flag",
                        help="pass runningMean and runningVar as NULL")),
        summary="SyncBatchNorm: combine W ranks' mean/invstd by counts; update running stats")
def aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize(
        ex: Executor, input: Optional[Tensor], mean: Optional[Tensor], invstd: Optional[Tensor],
        runningMean: Optional[Tensor], runningVar: Optional[Tensor], momentum: float, eps: float,
        counts: Optional[Tensor], meanAll: Optional[Tensor], invstdAll: Optional[Tensor]) -> None:
    """Phase 1. Returns ``(status, workspace_size, executor)``; ``None`` is a NULL pointer."""
    p = ex.platform
    t = dict(input=input, mean=mean, invstd=invstd, runningMean=runningMean,
             runningVar=runningVar, counts=counts, meanAll=meanAll, invstdAll=invstdAll)
    check_params(p, t)
    v = {name: ex.input(name, x) for name, x in t.items() if x is not None}
    if mean.is_empty:
        ex.output(fill_with(ex, v["meanAll"], 0.0), fill_with(ex, v["invstdAll"], math.nan))
        return
    require_kernel(PLATFORMS, p, "SyncBatchNormGatherStatsWithCounts")
    m32, e32 = as_f32(momentum), as_f32(eps)  # the kernels' float attrs
    if p.soc == FUSED_SOC:
        gather_fused(ex, v, input.shape[1], input.dtype, m32, e32)
    else:
        gather_chain(ex, v, input.shape[1], m32, e32)


aclnnBatchNormGatherStatsWithCounts = run_executor
"""Phase 2: ``aclnnBatchNormGatherStatsWithCounts(workspace, workspace_size, executor, stream=None)``."""


def batch_norm_gather_stats_with_counts(input: Any, mean: Any, invstd: Any, running_mean: Any,
                                        running_var: Any, momentum: float, eps: float,
                                        counts: Any) -> tuple[np.ndarray, np.ndarray]:
    """torch.batch_norm_gather_stats_with_counts on numpy arrays (or opgraph Tensors): the global
    ``(mean, invstd)`` [C] (in mean's and invstd's dtypes) from W ranks' ``mean``/``invstd``
    [W,C] and ``counts`` [W]. ``running_mean``/``running_var`` (both or neither; writable
    arrays) are updated in place. As on the NPU, a ``running_var`` without ``running_mean`` is
    left unchanged. Raises AclnnError (writing nothing) on bad input.

    >>> rm, rv = np.zeros(2, np.float32), np.ones(2, np.float32)
    >>> m, inv = batch_norm_gather_stats_with_counts(
    ...     np.zeros((4, 2), np.float32), np.float32([[0, 1], [2, 3]]), np.ones((2, 2), np.float32),
    ...     rm, rv, 0.5, 1e-5, np.float32([1, 3]))
    >>> m.tolist(), rm.tolist(), [round(float(v), 4) for v in rv]
    ([1.5, 2.5], [0.75, 1.25], [1.6667, 1.6667])
    """
    args = (input, mean, invstd, running_mean, running_var, momentum, eps, counts)
    return tuple(NUMPY_CALLS.call("aclnnBatchNormGatherStatsWithCounts", args,
                                  lambda: _batch_norm_gather_stats_with_counts(*args)))


def _batch_norm_gather_stats_with_counts(input: Any, mean: Any, invstd: Any, running_mean: Any,
                                        running_var: Any, momentum: float, eps: float,
                                        counts: Any) -> tuple[np.ndarray, np.ndarray]:
    """The usual two-phase call of :func:`batch_norm_gather_stats_with_counts`."""
    names = ("input", "mean", "invstd", "running_mean", "running_var", "counts")
    x, m, i, rm, rv, c = (as_tensor(n, a) for n, a in zip(
        names, (input, mean, invstd, running_mean, running_var, counts)))
    if x is None or m is None or i is None:  # no C or dtype for the outputs: the op_api's refusal
        refuse_null(aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize,
                    aclnnBatchNormGatherStatsWithCounts, x, m, i, rm, rv, momentum, eps, c, None, None)
    C = x.shape[1] if x.ndim >= 2 else 0
    mean_all, mean_all_t = output("mean_all", None, (C,), m.dtype)
    invstd_all, invstd_all_t = output("invstd_all", None, (C,), i.dtype)
    run_op_api(aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize,
               aclnnBatchNormGatherStatsWithCounts, x, m, i, rm, rv, momentum, eps, c,
               mean_all_t, invstd_all_t)
    return result(mean_all, mean_all_t), result(invstd_all, invstd_all_t)
