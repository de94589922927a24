"""aclnnSyncBatchNormGatherStats, composed like the C++ op_api (ops-nn
norm/sync_batch_norm_gather_stats/op_api/aclnn_sync_batch_norm_gather_stats.cpp): global batch
statistics from per-rank Σx (totalSum [N,C]), Σx² (totalSquareSum [N,C]) and element counts
(sampleCount [N]); the running statistics mean and variance [C] are updated in place.

    >>> import numpy as np, opgraph
    >>> t = opgraph.tensor
    >>> mean, var = np.zeros(1, np.float32), np.ones(1, np.float32)
    >>> bm, bi = np.zeros(1, np.float32), np.zeros(1, np.float32)
    >>> st, ws, ex = aclnnSyncBatchNormGatherStatsGetWorkspaceSize(
    ...     t(np.float32([[2], [4]])), t(np.float32([[4], [12]])), t(np.int32([2, 2])),
    ...     t(mean), t(var), 0.5, 0.0, t(bm), t(bi))
    >>> aclnnSyncBatchNormGatherStats(bytearray(ws) if ws else None, ws, ex)
    <Status.ACLNN_SUCCESS: 0>
    >>> float(bm[0]), float(mean[0]), round(float(bi[0]) ** -2, 5)        # batch var 1.75
    (1.5, 0.75, 1.75)

Graph (the same on 910B and 950): Contiguous(totalSum), Contiguous(totalSquareSum),
Contiguous(sampleCount) + Cast(→ int32), Contiguous(mean), Contiguous(variance), the
SyncBatchNormGatherStats kernel (4 outputs), then Cast + ViewCopy into batchMean, batchInvstd,
mean, variance. Quirks kept: BF16 only on the regbase 950 (not on 910B, unlike most of the
family); a float sampleCount is truncated to int32 (saturating; NaN → 0); N = 0 is an error (161002) while C = 0 is a
success that launches nothing. A SoC without the kernel (Ascend910, 310P, 310B) gets 561003
after the checks (the vendor's kernel lookup would surface as 561103 from the l0 wrapper).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from l0ops.basic import Cast, Contiguous, ViewCopy
from l0ops.primitives import as_f32
from l0ops.sync_bn_gather_stats import SyncBatchNormGatherStats
from opgraph.core.dtypes import DataType
from opgraph.core.executor import Executor
from opgraph.core.opapi import Arrays, InputConfig, Option, Param
from opgraph.core.platform import Platform
from opgraph.core.tensor import Tensor
from .common import BF16, F16, F32, S32, check_dtype, check_not_private, invalid, require_kernel
from .direct import NUMPY_CALLS
from .pythonic import as_tensor, output, refuse_null, run_op_api
from .twophase import check_not_null, op_api, run_executor

PLATFORMS = ("Ascend910B", "Ascend910_93", "Ascend950")  # doc: A2, A3, 950
TENSORS = ("totalSum", "totalSquareSum", "sampleCount", "mean", "variance", "batchMean", "batchInvstd")
RANKS = dict(totalSum=2, totalSquareSum=2, sampleCount=1, mean=1, variance=1, batchMean=1,
             batchInvstd=1)
PARAMS = (Param("totalSum", "tensor", "input"), Param("totalSquareSum", "tensor", "input"),
          Param("sampleCount", "tensor", "input"), Param("mean", "tensor", "inout"),
          Param("variance", "tensor", "inout"), Param("momentum", "float", "attr"),
          Param("eps", "float", "attr"), Param("batchMean", "tensor", "output"),
          Param("batchInvstd", "tensor", "output"))


def data_dtypes(p: Platform) -> tuple[DataType, ...]:
    """{F32, F16}, plus BF16 on the regbase arch (``IsRegbase()``: Ascend950) only."""
    return (F32, F16, BF16) if p.is_regbase else (F32, F16)


def count_dtypes(p: Platform) -> tuple[DataType, ...]:
    """sampleCount: the data dtypes plus INT32."""
    return data_dtypes(p) + (S32,)


def check_params(p: Platform, t: dict[str, Optional[Tensor]]) -> None:
    """CheckNotNull, CheckDtypeValid, CheckFormat, CheckShape — in that order."""
    check_not_null(**t)
    for name in TENSORS:
        check_dtype(name, t[name], count_dtypes(p) if name == "sampleCount" else data_dtypes(p), p)
    for first, second in (("totalSum", "totalSquareSum"), ("totalSum", "mean"),
                          ("totalSum", "variance"), ("batchMean", "batchInvstd")):
        if t[first].dtype != t[second].dtype:
            raise invalid(f"{second}: dtype {t[second].dtype.name} must equal {first}'s "
                          f"{t[first].dtype.name}")
    for name in TENSORS[:5]:
        check_not_private(name, t[name])
    for name in TENSORS:
        if t[name].ndim != RANKS[name]:
            raise invalid(f"{name}: must be {RANKS[name]}-D, got rank {t[name].ndim}")
    n, c = t["totalSum"].shape
    for name, dim, want, what in (("totalSquareSum", 0, n, "N"), ("totalSquareSum", 1, c, "C"),
                                  ("sampleCount", 0, n, "N"), ("mean", 0, c, "C"), ("variance", 0, c, "C"),
                                  ("batchMean", 0, c, "C"), ("batchInvstd", 0, c, "C")):
        if t[name].shape[dim] != want:
            raise invalid(f"{name}: dim {dim} is {t[name].shape[dim]}, must equal {what} = {want} "
                          f"(totalSum is {list(t['totalSum'].shape)})")


# --- what the CLI, the backend kit and the docs need beyond the compose function -------------
def ranks_channels(cfg: InputConfig) -> tuple[int, int]:
    """(N, C) from the generator's shape; ValueError naming the rule for any other rank."""
    if len(cfg.shape) != 2:
        raise ValueError(f"the shape is N,C (ranks, channels), got {list(cfg.shape)}")
    return cfg.shape[0], cfg.shape[1]


def make_inputs(cfg: InputConfig, rng: np.random.Generator) -> Arrays:
    """Random valid arguments for shape (N, C): each rank holds 1..64 samples per channel with
    mean ~ N(0, 1) and variance in [0.5, 2); running mean ~ N(0, 0.5), running var in [0.5, 1.5)."""
    n, c = ranks_channels(cfg)
    d = cfg.dtype
    out = d if cfg.option("batch_dtype") is None else cfg.option("batch_dtype")
    counts = rng.integers(1, 65, n)
    mu = rng.normal(0.0, 1.0, (n, c))
    var = rng.uniform(0.5, 2.0, (n, c))
    cast = lambda a, t: np.asarray(a).astype(t.np)  # noqa: E731
    return {
        "totalSum": cast(counts[:, None] * mu, d),
        "totalSquareSum": cast(counts[:, None] * (var + mu * mu), d),
        "sampleCount": cast(counts, cfg.option("count_dtype")),
        "mean": cast(rng.normal(0.0, 0.5, c), d),
        "variance": cast(rng.uniform(0.5, 1.5, c), d),
        "momentum": cfg.option("momentum"),
        "eps": cfg.option("eps"),
        "batchMean": np.zeros(c, out.np),
        "batchInvstd": np.zeros(c, out.np),
    }


def input_bytes(cfg: InputConfig) -> int:
    """Bytes of the arrays :func:`make_inputs` makes, computed without making them."""
    (n, c), d = ranks_channels(cfg), cfg.dtype
    out = d if cfg.option("batch_dtype") is None else cfg.option("batch_dtype")
    per_rank = 2 * c * d.itemsize + cfg.option("count_dtype").itemsize
    return n * per_rank + 2 * c * (d.itemsize + out.itemsize)


def reference(a: Arrays) -> dict[str, np.ndarray]:
    """The documented formula in float64 on the given inputs (momentum and eps as the C floats,
    the counts truncated as the op's int32 Cast does): bm = ΣS/Σn, var = ΣQ/Σn − bm²,
    invstd = 1/sqrt(var + eps), mean·(1 − m) + m·bm, variance·(1 − m) + m·var·Σn/(Σn − 1)."""
    s, q, cnt, rm, rv = (np.asarray(a[k]).astype(np.float64)
                         for k in ("totalSum", "totalSquareSum", "sampleCount", "mean", "variance"))
    with np.errstate(all="ignore"):  # a double past float32's range is inf, as the C cast
        m, eps = as_f32(a["momentum"]), as_f32(a["eps"])
        n = np.trunc(cnt).sum()
        bm = s.sum(0) / n
        var = q.sum(0) / n - bm * bm
        return {"batchMean": bm, "batchInvstd": 1.0 / np.sqrt(var + eps), "mean": rm * (1 - m) + m * bm,
                "variance": rv * (1 - m) + m * var * n / (n - 1)}


@op_api("aclnnSyncBatchNormGatherStats", params=PARAMS, platforms=PLATFORMS, dtypes=data_dtypes,
        make_inputs=make_inputs, input_bytes=input_bytes, reference=reference, rank=(2, 2),
        default_shape=(4, 8),
        options=(Option("count_dtype", "dtype", S32, "dtype of sampleCount: int32, float32, float16, "
                        "bfloat16 (Ascend950)"),
                 Option("batch_dtype", "dtype", None, "dtype of batchMean and batchInvstd "
                        "(default: --dtype)"),
                 Option("momentum", "float", 0.1, "running-statistics momentum (a C float)"),
                 Option("eps", "float", 1e-5, "eps added to the variance (a C float)")),
        summary="SyncBatchNorm global mean/invstd from per-rank sums, shape N (ranks), C; "
                "updates the running stats")
def aclnnSyncBatchNormGatherStatsGetWorkspaceSize(
        ex: Executor, totalSum: Optional[Tensor], totalSquareSum: Optional[Tensor],
        sampleCount: Optional[Tensor], mean: Optional[Tensor], variance: Optional[Tensor],
        momentum: float, eps: float, batchMean: Optional[Tensor], batchInvstd: Optional[Tensor]) -> None:
    """Phase 1. Returns ``(status, workspace_size, executor)``; ``None`` is a NULL pointer."""
    p = ex.platform
    t = dict(totalSum=totalSum, totalSquareSum=totalSquareSum, sampleCount=sampleCount, mean=mean,
             variance=variance, batchMean=batchMean, batchInvstd=batchInvstd)
    check_params(p, t)
    n, c = totalSum.shape
    if n == 0:
        raise invalid(f"totalSum: dim 0 (N, the number of ranks) is 0 in shape {[n, c]}")
    if c == 0:
        return  # success, workspace 0, an executor with no kernels
    require_kernel(PLATFORMS, p, "SyncBatchNormGatherStats")
    v = {name: ex.input(name, x) for name, x in t.items()}
    total_sum = Contiguous(ex, v["totalSum"])
    total_square_sum = Contiguous(ex, v["totalSquareSum"])
    count = Cast(ex, Contiguous(ex, v["sampleCount"]), to=S32)
    running_mean = Contiguous(ex, v["mean"])
    running_var = Contiguous(ex, v["variance"])
    tiling = dict(cores=p.vector_cores, ub_size=p.ub_size) if p.is_regbase else {}
    outs = SyncBatchNormGatherStats(
        ex, total_sum, total_square_sum, count, running_mean, running_var,
        momentum=as_f32(momentum), eps=as_f32(eps), arch=p.npu_arch, **tiling)
    ex.output(*(ViewCopy(ex, Cast(ex, out, to=t[name].dtype), v[name])
                for out, name in zip(outs, ("batchMean", "batchInvstd", "mean", "variance"))))


aclnnSyncBatchNormGatherStats = run_executor
"""Phase 2: ``aclnnSyncBatchNormGatherStats(workspace, workspace_size, executor, stream=None)``."""


def sync_batch_norm_gather_stats(total_sum: Any, total_square_sum: Any, sample_count: Any, mean: Any,
                                 variance: Any, momentum: float, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Global (batch_mean, batch_invstd) [C] from per-rank sums [N,C] and counts [N] on numpy
    arrays (or opgraph Tensors); ``mean`` and ``variance`` (the running statistics, writable
    arrays) are updated in place. Both results have mean's dtype. Raises AclnnError (writing
    nothing) on bad input.

    >>> rm, rv = np.zeros(2, np.float32), np.ones(2, np.float32)
    >>> bm, bi = sync_batch_norm_gather_stats(np.float32([[1, 2], [3, 4]]), np.float32([[1, 4], [9, 16]]),
    ...                                       np.int32([1, 1]), rm, rv, 0.1, 0.0)
    >>> bm.tolist(), bi.tolist(), rm.tolist()            # var 1 per channel, unbiased 2
    ([2.0, 3.0], [1.0, 1.0], [0.20000000298023224, 0.30000001192092896])
    """
    args = (total_sum, total_square_sum, sample_count, mean, variance, momentum, eps)
    return tuple(NUMPY_CALLS.call("aclnnSyncBatchNormGatherStats", args,
                                  lambda: _sync_batch_norm_gather_stats(*args)))


def _sync_batch_norm_gather_stats(total_sum: Any, total_square_sum: Any, sample_count: Any, mean: Any,
                                 variance: Any, momentum: float, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """The usual two-phase call of :func:`sync_batch_norm_gather_stats`."""
    names = ("total_sum", "total_square_sum", "sample_count", "mean", "variance")
    args = [as_tensor(n, a) for n, a in zip(names, (total_sum, total_square_sum, sample_count, mean,
                                                     variance))]
    m = args[3]
    if m is None:  # no shape for the outputs: the op_api names the first NULL (totalSum ...)
        refuse_null(aclnnSyncBatchNormGatherStatsGetWorkspaceSize, aclnnSyncBatchNormGatherStats,
                    *args, momentum, eps, None, None)
    bm, bm_t = output("batch_mean", None, m.shape, m.dtype)
    bi, bi_t = output("batch_invstd", None, m.shape, m.dtype)
    run_op_api(aclnnSyncBatchNormGatherStatsGetWorkspaceSize, aclnnSyncBatchNormGatherStats,
               *args, momentum, eps, bm_t, bi_t)
    return bm, bi
