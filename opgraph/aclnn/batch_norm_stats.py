"""aclnnBatchNormStats, composed like the C++ op_api (ops-math
math/reduce_std_with_mean/op_api/aclnn_batch_norm_stats.cpp): per-channel (dim 1) mean and
``invstd = 1/sqrt(biased variance + eps)`` of ``input``, written into two FLOAT [C] tensors.

The graph depends on ``IsRegBase()`` (only Ascend950): 950 takes ReduceVar (variance and mean
in one kernel), Add(eps), Pow(−0.5) and copies invstd, then mean; every other SoC takes
ReduceMean, copies mean at once, broadcasts it back and runs ReduceStdWithMean(invert=True),
which computes ``sqrt(1/(var + eps))`` — reciprocal first, so the two families can differ in
the last bit. An empty input (a non-channel dim of 0) gives mean = 0 and invstd = NaN.

Fidelity: the 910B-family ReduceMean and ReduceStdWithMean kernels are prebuilt (formula, in the
op order of public TBE copies); the 950 ReduceVar follows its kernel's two-pass op order; Add
and Pow(−0.5) are bit-faithful. Every sum runs in opgraph's fixed float32 order. The vendor's
``ReFormat(x, ND)`` is an in-place re-tag (no kernel); it is recorded as a free view.

    >>> import numpy as np, opgraph
    >>> x = np.float16([[1, 2], [3, 4], [5, 6]])           # N = 3, C = 2
    >>> mean, invstd = np.zeros(2, np.float32), np.zeros(2, np.float32)   # always FLOAT
    >>> st, ws, ex = aclnnBatchNormStatsGetWorkspaceSize(
    ...     opgraph.tensor(x), 0.0, opgraph.tensor(mean), opgraph.tensor(invstd))
    >>> aclnnBatchNormStats(bytearray(ws) if ws else None, ws, ex)
    <Status.ACLNN_SUCCESS: 0>
    >>> mean.tolist(), [round(float(v), 5) for v in invstd]
    ([3.0, 4.0], [0.61237, 0.61237])
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from l0ops.arith import Add, Pow
from l0ops.basic import BroadcastTo, Cast, Contiguous, Fill, UnsqueezeNd, ViewCopy
from l0ops.bninfer import ConvertToTensor
from l0ops.primitives import as_f32
from l0ops.reduce import ReduceMean, ReduceStdWithMean, ReduceVar
from l0ops.views import ReFormat
from opgraph.core.dtypes import DataType, Format
from opgraph.core.executor import Executor
from opgraph.core.ir import Value
from opgraph.core.opapi import Arrays, InputConfig, Option, Param
from opgraph.core.platform import Platform
from opgraph.core.tensor import Tensor
from .common import (BF16, F16, F32, MAX_RANK, check_channel_vector, check_dtype, check_not_private,
                     check_rank, invalid, require_kernel)
from .direct import NUMPY_CALLS
from .pythonic import as_tensor, output, refuse_null, result, run_op_api
from .twophase import check_not_null, op_api, run_executor

# the doc's product table: 950, A3 (910_93), A2 (910B), Atlas training (910); not 310B / 310P
PLATFORMS = ("Ascend910B", "Ascend910_93", "Ascend950", "Ascend910")
PARAMS = (Param("input", "tensor", "input"), Param("eps", "double", "attr"),
          Param("mean", "tensor", "output"), Param("invstd", "tensor", "output"))
POW_EXPONENT = -0.5  # NEGTIVE_SQRT_EXP, a float


def input_dtypes(p: Platform) -> tuple[DataType, ...]:
    """{F32, F16}, plus BF16 iff ``IsRegBase()`` (NpuArch DAV_3510: only Ascend950)."""
    return (F32, F16, BF16) if p.is_regbase else (F32, F16)


def check_params(p: Platform, input: Optional[Tensor], mean: Optional[Tensor],
                 invstd: Optional[Tensor]) -> None:
    """CheckNotNull, CheckDtypeValid, CheckFormat, CheckShape — in the vendor's order."""
    check_not_null(input=input, mean=mean, invstd=invstd)
    check_dtype("input", input, input_dtypes(p), p)
    check_dtype("mean", mean, (F32,), p)
    check_dtype("invstd", invstd, (F32,), p)
    for name, t in (("input", input), ("mean", mean), ("invstd", invstd)):
        check_not_private(name, t)
    check_rank("input", input)
    for name, t in (("mean", mean), ("invstd", invstd)):
        if t.ndim != 1:
            raise invalid(f"{name}: must be 1-D [C], got rank {t.ndim} (shape {list(t.shape)})")
    C = input.shape[1]
    if C == 0:
        raise invalid(f"input: channel dim (dim 1) is 0 in shape {list(input.shape)}")
    check_channel_vector("mean", mean, C)
    check_channel_vector("invstd", invstd, C)


def fill_into(ex: Executor, dst: Value, value: float) -> Value:
    """ProcessEmptyTensorWithValue: Fill(dst's shape, value as FLOAT) → ReFormat(ND) → ViewCopy."""
    filled = ReFormat(ex, Fill(ex, shape=dst.shape, value=value, dtype=dst.dtype), format=Format.ND)
    return ViewCopy(ex, filled, dst)


def stats_regbase(ex: Executor, x: Value, axes: tuple[int, ...], eps: float, mean: Value,
                  invstd: Value) -> tuple[Value, Value]:
    """aclnnBatchNormStatsImplUnify (950): ReduceVar → Add(eps) → Pow(−0.5); invstd copied first."""
    var, mean_x = ReduceVar(ex, x, axes=axes, correction=0, keepdims=False)
    eps_t = ConvertToTensor(ex, value=as_f32(eps), dtype=F32)  # (float)eps, host data
    y = Pow(ex, Add(ex, var, eps_t), ConvertToTensor(ex, value=POW_EXPONENT, dtype=F32))
    return ViewCopy(ex, y, invstd), ViewCopy(ex, mean_x, mean)


def stats_membase(ex: Executor, x: Value, axes: tuple[int, ...], eps: float, mean: Value,
                  invstd: Value) -> tuple[Value, Value]:
    """910B / 910_93 / 910: ReduceMean → ViewCopy(mean) → UnsqueezeNd → BroadcastTo →
    ReduceStdWithMean(correction 0, invert, (float)eps) → ViewCopy(invstd)."""
    mean_x = ReduceMean(ex, x, axes=axes, keepdims=False)
    mean_done = ViewCopy(ex, mean_x, mean)
    mean_b = BroadcastTo(ex, UnsqueezeNd(ex, mean_x, dims=axes), shape=x.shape)
    y = ReduceStdWithMean(ex, x, mean_b, axes=axes, correction=0, keepdims=False, invert=True,
                          eps=as_f32(eps))
    return mean_done, ViewCopy(ex, y, invstd)


# --- what the CLI, the backend kit and the docs need beyond the compose function -------------
def make_inputs(cfg: InputConfig, rng: np.random.Generator) -> Arrays:
    """Random valid arguments: per-channel offset and scale, so every channel differs."""
    shape, C = cfg.shape, cfg.shape[1]
    bshape = (1, C) + (1,) * (len(shape) - 2)
    x = rng.standard_normal(shape) * rng.uniform(0.5, 2.0, C).reshape(bshape) \
        + rng.normal(0.0, 1.0, C).reshape(bshape)
    return {"input": x.astype(cfg.dtype.np), "eps": float(cfg.option("eps")),
            "mean": np.zeros(C, np.float32), "invstd": np.zeros(C, np.float32)}


def input_bytes(cfg: InputConfig) -> int:
    """Bytes of the arrays :func:`make_inputs` makes, computed without making them."""
    return math.prod(cfg.shape) * cfg.dtype.itemsize + 2 * 4 * cfg.shape[1]


def reference(a: Arrays) -> dict[str, np.ndarray]:
    """The formulas in float64 on the (already rounded) input, over every dim but 1:
    ``mean = Σx/n``, ``invstd = 1/sqrt(Σ(x − mean)²/n + eps)``; empty input: 0 and NaN."""
    x = np.asarray(a["input"]).astype(np.float64)
    axes = tuple(d for d in range(x.ndim) if d != 1)
    C = x.shape[1]
    if x.size == 0:
        return {"mean": np.zeros(C), "invstd": np.full(C, np.nan)}
    mean = x.mean(axis=axes)
    var = ((x - mean.reshape((1, C) + (1,) * (x.ndim - 2))) ** 2).mean(axis=axes)
    with np.errstate(all="ignore"):  # any eps is accepted: var + eps < 0 gives NaN, as on the NPU
        return {"mean": mean, "invstd": 1.0 / np.sqrt(var + float(a["eps"]))}


@op_api("aclnnBatchNormStats", params=PARAMS, platforms=PLATFORMS, dtypes=input_dtypes,
        make_inputs=make_inputs, input_bytes=input_bytes, reference=reference, rank=(2, MAX_RANK),
        default_shape=(2, 3, 4, 4),
        options=(Option("eps", "float", 1e-5, "eps added to the variance (a C double)"),),
        summary="SyncBatchNorm per-channel mean and invstd (biased variance), channel = dim 1")
def aclnnBatchNormStatsGetWorkspaceSize(ex: Executor, input: Optional[Tensor], eps: float,
                                        mean: Optional[Tensor], invstd: Optional[Tensor]) -> None:
    """Phase 1. Returns ``(status, workspace_size, executor)``; ``None`` is a NULL pointer. The
    vendor code has no SoC gate of its own; a SoC outside the product table (310P, 310B) gets
    561003 after the checks and the empty-input path (whose Fill kernels exist everywhere)."""
    p = ex.platform
    check_params(p, input, mean, invstd)
    x = ex.input("input", input)
    m, s = ex.input("mean", mean), ex.input("invstd", invstd)
    if input.is_empty:
        ex.output(fill_into(ex, m, 0.0), fill_into(ex, s, math.nan))
        return
    require_kernel(PLATFORMS, p, "ReduceVar" if p.is_regbase else "ReduceStdWithMean")
    x = ReFormat(ex, Cast(ex, Contiguous(ex, x), to=F32), format=Format.ND)
    axes = tuple(d for d in range(input.ndim) if d != 1)
    ex.output(*(stats_regbase if p.is_regbase else stats_membase)(ex, x, axes, eps, m, s))


aclnnBatchNormStats = run_executor
"""Phase 2: ``aclnnBatchNormStats(workspace, workspace_size, executor, stream=None)``."""


def batch_norm_stats(input: Any, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """torch.batch_norm_stats on a numpy array (or opgraph Tensor): per-channel (dim 1) mean and
    invstd = 1/sqrt(biased var + eps), both new float32 [C] arrays. Raises AclnnError on bad
    input.

    >>> mean, invstd = batch_norm_stats(np.float16([[1, 2], [3, 4], [5, 6]]), 1e-5)
    >>> mean.dtype, mean.tolist(), np.allclose(invstd, 1 / np.sqrt(8 / 3 + 1e-5))
    (dtype('float32'), [3.0, 4.0], True)
    """
    args = (input, eps)
    return tuple(NUMPY_CALLS.call("aclnnBatchNormStats", args, lambda: _batch_norm_stats(*args)))


def _batch_norm_stats(input: Any, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """The usual two-phase call of :func:`batch_norm_stats`."""
    x = as_tensor("input", input)
    if x is None:  # no C for the outputs: the op_api's own refusal
        refuse_null(aclnnBatchNormStatsGetWorkspaceSize, aclnnBatchNormStats, None, eps, None, None)
    C = x.shape[1] if x.ndim >= 2 else 0
    mean, mean_t = output("mean", None, (C,), F32)
    invstd, invstd_t = output("invstd", None, (C,), F32)
    run_op_api(aclnnBatchNormStatsGetWorkspaceSize, aclnnBatchNormStats, x, eps, mean_t, invstd_t)
    return result(mean, mean_t), result(invstd, invstd_t)
