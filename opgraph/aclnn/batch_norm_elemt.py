"""aclnnBatchNormElemt, composed like the C++ op_api (ops-nn
norm/batch_norm_elemt/op_host/op_api/aclnn_batch_norm_elemt.cpp, with the internal inference
``BatchNorm()`` helper of norm/batch_norm_v3/op_host/op_api/aclnn_batch_norm.cpp):
``output = (input − mean)·invstd·weight + bias``, channel = dim 1.

The vendor's quirks, kept:

- a NULL input, mean, invstd or output is 161002 (the doc says 161001); weight and bias may be
  NULL and are then filled as FLOAT ones / zeros (a Fill kernel each);
- the op turns invstd back into a variance, ``var = 1/invstd² − eps``, in invstd's dtype (Mul,
  OnesLike, Div, Sub with a 0-d eps tensor in that dtype: four kernels on [C]), and the
  inference kernel normalises with rsqrt(var + eps); so a negative invstd acts as |invstd|;
- no cross-dtype check: an output dtype other than input's passes the checks and fails at the
  final ViewCopy with 561103;
- rank > 5 is viewed as 5-D NCDHW [N, C, H, W, −1] and back; rank < 4 as 4-D NCHW and back;
  5-D passes as is on DAV_2201 (910B/910_93) and 950.

910B/910_93 (and Ascend910 up to rank 4) end in BNInfer with [1,C,1,1] float32 parameters;
Ascend950 (regbase) ends in BatchNormV3 (training = false) with [C] parameters cast to the
promoted types; its inference tilings take the channel from the last dim of a 4-D NHWC- or
5-D NDHWC-tagged input (the check and the parameters still use dim 1): there the channel is the
last dim, and a last dim other than dim 1 would read the [C] parameters out of bounds (no
vendor check stops it) → 561002 naming input. Ascend910 with rank ≥ 5 takes a Transpose-based
path (ResizeFrom5D) opgraph does not model: 561003, saying so. Ascend310P/310B have no kernel for the op: 561003.

    >>> import numpy as np, opgraph
    >>> x = np.float32([[1, 2], [3, 4]])
    >>> f = lambda *v: opgraph.tensor(np.float32(v))
    >>> out = np.zeros_like(x)
    >>> st, ws, ex = aclnnBatchNormElemtGetWorkspaceSize(
    ...     opgraph.tensor(x), None, None, f(2, 3), f(0.5, 2), 0.0, opgraph.tensor(out))
    >>> aclnnBatchNormElemt(bytearray(ws) if ws else None, ws, ex)
    <Status.ACLNN_SUCCESS: 0>
    >>> out.tolist()
    [[-0.5, -2.0], [0.5, 2.0]]
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from l0ops.arith import Div, Mul, OnesLike, Sub
from l0ops.basic import Cast, Contiguous, Fill, UnsqueezeNd, ViewCopy
from l0ops.bninfer import BatchNormV3, BNInfer, ConvertToTensor, v3_channel_axis
from l0ops.primitives import as_f32
from l0ops.views import ReFormat, Reshape
from opgraph.core.dtypes import Format, promote_types
from opgraph.core.executor import Executor
from opgraph.core.ir import Value
from opgraph.core.opapi import Arrays, InputConfig, Option, Param
from opgraph.core.platform import Platform
from opgraph.core.status import AclnnError, Status
from opgraph.core.tensor import Tensor, tensor
from .common import (F32, MAX_RANK, check_dtype, check_not_private, check_rank, float_dtypes,
                     invalid, require_kernel)
from .direct import NUMPY_CALLS
from .pythonic import as_tensor, refuse_masked, refuse_null, result, run_op_api
from .twophase import op_api, run_executor

PLATFORMS = ("Ascend910B", "Ascend910_93", "Ascend950", "Ascend910")  # the doc's A2, A3, 910 + 950
CHANNEL_PARAMS = ("weight", "bias", "mean", "invstd")
PARAMS = (Param("input", "tensor", "input"), Param("weight", "tensor", "input", optional=True),
          Param("bias", "tensor", "input", optional=True), Param("mean", "tensor", "input"),
          Param("invstd", "tensor", "input"), Param("eps", "double", "attr"),
          Param("output", "tensor", "output"))


def check_params(p: Platform, t: dict[str, Optional[Tensor]]) -> None:
    """CheckNotNull (161002!), CheckDtypeValid, CheckFormat, CheckShape — in that order."""
    for name in ("input", "mean", "invstd", "output"):
        if t[name] is None:
            raise invalid(f"{name}: must not be NULL (aclnnBatchNormElemt reports NULL as "
                          "ACLNN_ERR_PARAM_INVALID)")
    for name in ("input", *CHANNEL_PARAMS, "output"):
        check_dtype(name, t[name], float_dtypes(p), p)
    inp, out = t["input"], t["output"]
    if inp.format != out.format:
        raise invalid(f"output: storage format {out.format.name} differs from input's {inp.format.name}")
    check_not_private("input", inp)
    check_rank("input", inp)
    check_rank("output", out)
    if out.shape != inp.shape:
        raise invalid(f"output: shape {list(out.shape)} must equal input's {list(inp.shape)}")
    C = inp.shape[1]
    if C == 0:
        raise invalid(f"input: channel dim (dim 1) is 0 in shape {list(inp.shape)}")
    for name in CHANNEL_PARAMS:
        if t[name] is not None and t[name].ndim != 1:
            raise invalid(f"{name}: must be 1-D, got rank {t[name].ndim}")
    for name in CHANNEL_PARAMS:
        if t[name] is not None and t[name].shape[0] != C:
            raise invalid(f"{name}: shape {list(t[name].shape)} must be [C] = [{C}] (C = input.shape[1])")


def rebuild_variance(ex: Executor, invstd: Value, eps: float) -> Value:
    """var = 1/(invstd·invstd) − eps in invstd's dtype: Mul, OnesLike, Div, then Sub of a 0-d
    eps tensor made from (float)eps in that dtype."""
    sq = Mul(ex, invstd, invstd)
    var = Div(ex, OnesLike(ex, sq), sq)
    return Sub(ex, var, ConvertToTensor(ex, value=as_f32(eps), dtype=var.dtype))


def resize_from_1d(ex: Executor, t: Value, rank: int) -> Value:
    """ResizeFrom1D: Contiguous, Cast(→ FLOAT), [C] → [1,C,1,1] (5-D: [1,C,1,1,1]), re-tag."""
    dims, fmt = ((0, 2, 3, 4), Format.NCDHW) if rank == 5 else ((0, 2, 3), Format.NCHW)
    return ReFormat(ex, UnsqueezeNd(ex, Cast(ex, Contiguous(ex, t), to=F32), dims=dims), format=fmt)


def batch_norm_proc(ex: Executor, x: Value, w: Value, b: Value, mean: Value, var: Value,
                    eps: float) -> Value:
    """910B BatchNormProc, training = false: ResizeFrom1D on weight, bias, mean, var; BNInfer."""
    w, b, mean, var = (resize_from_1d(ex, t, x.type.rank) for t in (w, b, mean, var))
    return BNInfer(ex, x, w, b, mean, var, eps=eps)


def batch_norm_proc_regbase(ex: Executor, x: Value, w: Value, b: Value, mean: Value, var: Value,
                            eps: float) -> Value:
    """950 BatchNormProcRegbase, training = false: weight/bias cast to PromoteType(w, b), FLOAT
    unless that is x's dtype; mean/var to PromoteType(mean, var), FLOAT unless that equals both
    the weight type and x's dtype; BatchNormV3; Cast(y → x's dtype)."""
    axis = v3_channel_axis(x.type)
    if x.shape[axis] != w.shape[0]:
        raise AclnnError(Status.ACLNN_ERR_INNER_TILING_ERROR, (
            f"input: {x.type.format.name}-tagged shape {list(x.shape)} on {ex.platform.soc}: "
            f"BatchNormV3's last-channel tiling takes C = {x.shape[axis]} (dim {axis}), but the "
            f"parameters have C = {w.shape[0]} (dim 1); the kernel would read them out of bounds "
            "(undetermined; tag the input ND or NCHW/NCDHW, or make the two dims equal)"))
    wb_type = promote_types(w.dtype, b.dtype)
    wb_type = wb_type if wb_type == x.dtype else F32
    w = Cast(ex, Contiguous(ex, w), to=wb_type)
    b = Cast(ex, Contiguous(ex, b), to=wb_type)
    xc = Contiguous(ex, x)
    run_type = promote_types(mean.dtype, var.dtype)
    run_type = run_type if run_type == wb_type and run_type == x.dtype else F32
    mean = Cast(ex, Contiguous(ex, mean), to=run_type)
    var = Cast(ex, Contiguous(ex, var), to=run_type)
    y, _, _ = BatchNormV3(ex, xc, w, b, mean, var, eps=eps, momentum=0.0, training=False,
                          channel_axis=axis)
    return Cast(ex, y, to=x.dtype)


def batch_norm_infer(ex: Executor, x: Value, w: Value, b: Value, mean: Value, var: Value,
                     eps: float) -> Value:
    """The ``BatchNorm()`` helper with training = false and every parameter given: rank < 4 is
    viewed as 4-D NCHW (ResizeFromND) and back (ResizeToND); then the SoC's path."""
    rank = x.type.rank
    x4 = x
    if rank < 4:
        x4 = ReFormat(ex, Reshape(ex, x, shape=x.shape + (1,) * (4 - rank)), format=Format.NCHW)
    proc = batch_norm_proc_regbase if ex.platform.is_regbase else batch_norm_proc
    y = proc(ex, x4, w, b, mean, var, as_f32(eps))
    if rank < 4:
        y = ReFormat(ex, Reshape(ex, y, shape=x.shape), format=x.type.format)
    return y


# --- what the CLI, the backend kit and the docs need beyond the compose function -------------
def make_inputs(cfg: InputConfig, rng: np.random.Generator) -> Arrays:
    """Random valid arguments: invstd in [0.5, 2), weight in [0.5, 1.5); mean and invstd in
    ``stats_dtype`` (default: the data dtype)."""
    shape, d = cfg.shape, cfg.dtype
    sd = cfg.option("stats_dtype") or d
    C = shape[1]
    cast = lambda a, t: np.asarray(a).astype(t.np)  # noqa: E731
    return {
        "input": cast(rng.standard_normal(shape) * 2 + 0.5, d),
        "weight": None if cfg.option("no_weight") else cast(rng.uniform(0.5, 1.5, C), d),
        "bias": None if cfg.option("no_bias") else cast(rng.normal(0.0, 0.5, C), d),
        "mean": cast(rng.normal(0.5, 0.5, C), sd),
        "invstd": cast(rng.uniform(0.5, 2.0, C), sd),
        "eps": float(cfg.option("eps")),
        "output": np.zeros(shape, d.np),
    }


def input_bytes(cfg: InputConfig) -> int:
    """Bytes of the arrays :func:`make_inputs` makes, computed without making them."""
    d, sd = cfg.dtype, cfg.option("stats_dtype") or cfg.dtype
    wb = (0 if cfg.option("no_weight") else 1) + (0 if cfg.option("no_bias") else 1)
    return math.prod(cfg.shape) * 2 * d.itemsize + cfg.shape[1] * (wb * d.itemsize + 2 * sd.itemsize)


def reference(a: Arrays) -> dict[str, np.ndarray]:
    """The formula in float64 on the (already rounded) inputs, channel = dim 1:
    ``(input − mean)·|invstd|·weight + bias`` (rsqrt(1/invstd²) is |invstd|; NULL weight = 1,
    NULL bias = 0)."""
    x = np.asarray(a["input"]).astype(np.float64)
    bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    ch = {k: np.asarray(a[k]).astype(np.float64).reshape(bshape)
          for k in CHANNEL_PARAMS if a.get(k) is not None}
    y = (x - ch["mean"]) * np.abs(ch["invstd"]) * ch.get("weight", 1.0) + ch.get("bias", 0.0)
    return {"output": y}


@op_api("aclnnBatchNormElemt", params=PARAMS, platforms=PLATFORMS, dtypes=float_dtypes,
        make_inputs=make_inputs, input_bytes=input_bytes, reference=reference, rank=(2, MAX_RANK),
        in_place=True,
        default_shape=(2, 3, 4, 5),
        options=(Option("no_weight", "flag", help="pass weight as NULL (filled with ones)"),
                 Option("no_bias", "flag", help="pass bias as NULL (filled with zeros)"),
                 Option("stats_dtype", "dtype", None, "dtype of mean and invstd (default: --dtype)"),
                 Option("eps", "float", 1e-5, "eps of the variance (a C double)")),
        summary="SyncBatchNorm forward normalisation with given mean/invstd, channel = dim 1")
def aclnnBatchNormElemtGetWorkspaceSize(
        ex: Executor, input: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
        mean: Optional[Tensor], invstd: Optional[Tensor], eps: float,
        output: Optional[Tensor]) -> None:
    """Phase 1. Returns ``(status, workspace_size, executor)``; ``None`` is a NULL pointer."""
    p = ex.platform
    t = dict(input=input, weight=weight, bias=bias, mean=mean, invstd=invstd, output=output)
    check_params(p, t)
    if input.is_empty:
        return  # success, workspace 0, an executor with no kernels; output untouched
    require_kernel(PLATFORMS, p, "BatchNormV3" if p.is_regbase else "BNInfer")
    if p.npu_arch == 1001 and input.ndim >= 5:
        raise AclnnError(Status.ACLNN_ERR_INNER_FIND_KERNEL_ERROR,
                         f"input: rank {input.ndim} on {p.soc} takes the 5-D path through "
                         "Transpose (ResizeFrom5D), which opgraph does not model; ranks 2-4 are")
    v = {name: ex.input(name, x) for name, x in t.items() if x is not None}
    shape, rank, C = input.shape, input.ndim, input.shape[1]
    x = Contiguous(ex, v["input"])
    if rank > 5:
        x = ReFormat(ex, Reshape(ex, x, shape=shape[:4] + (-1,)), format=Format.NCDHW)
    w = v["weight"] if weight is not None else Fill(ex, shape=(C,), value=1.0, dtype=F32)
    b = v["bias"] if bias is not None else Fill(ex, shape=(C,), value=0.0, dtype=F32)
    var = rebuild_variance(ex, Contiguous(ex, v["invstd"]), eps)
    w, b, m = Contiguous(ex, w), Contiguous(ex, b), Contiguous(ex, v["mean"])
    y = batch_norm_infer(ex, x, w, b, m, var, eps)
    if rank > 5:
        y = ReFormat(ex, Reshape(ex, y, shape=shape), format=Format.ND)
    ex.output(ViewCopy(ex, y, v["output"]))


aclnnBatchNormElemt = run_executor
"""Phase 2: ``aclnnBatchNormElemt(workspace, workspace_size, executor, stream=None)``."""


def batch_norm_elemt(input: Any, weight: Any, bias: Any, mean: Any, invstd: Any, eps: float,
                     out: "np.ndarray | Tensor | None" = None) -> np.ndarray:
    """torch.batch_norm_elemt on numpy arrays (or opgraph Tensors): ``(input − mean)·invstd·
    weight + bias`` per channel (dim 1). ``out`` (input's dtype and shape, may be a strided view)
    receives the result; by default a new array. Raises AclnnError (writing nothing) on bad input.

    >>> x = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    >>> y = batch_norm_elemt(x, None, np.float32([0, 1]), np.float32([1, 2]), np.float32([0.5, 2]), 0.0)
    >>> y.ravel().tolist()
    [-0.5, 0.0, 1.0, 3.0, 1.5, 2.0, 9.0, 11.0]
    """
    args = (input, weight, bias, mean, invstd, eps)
    if out is not None:  # the caller's array: the usual call checks and writes it
        return _batch_norm_elemt(*args, out)
    return NUMPY_CALLS.call("aclnnBatchNormElemt", args,
                            lambda: [_batch_norm_elemt(*args, None)])[0]


def _batch_norm_elemt(input: Any, weight: Any, bias: Any, mean: Any, invstd: Any, eps: float,
                     out: "np.ndarray | Tensor | None" = None) -> np.ndarray:
    """The usual two-phase call of :func:`batch_norm_elemt`."""
    args = [as_tensor(n, a) for n, a in zip(("input", "weight", "bias", "mean", "invstd"),
                                             (input, weight, bias, mean, invstd))]
    x = args[0]
    if x is None:  # no shape for out: the op_api's own refusal (161002, its words)
        refuse_null(aclnnBatchNormElemtGetWorkspaceSize, aclnnBatchNormElemt, *args, eps, None)
    if out is None:
        out = np.empty(x.shape, dtype=x.dtype.np)
    out_t = out if isinstance(out, Tensor) else _as_output(out, x.format)
    run_op_api(aclnnBatchNormElemtGetWorkspaceSize, aclnnBatchNormElemt, *args, eps, out_t)
    return result(out, out_t)


def _as_output(out: Any, fmt: Format) -> Tensor:
    """A numpy ``out`` as a tensor tagged like the input (the op requires equal formats)."""
    refuse_masked("out", out)
    try:
        return tensor(out, format=fmt)
    except (TypeError, ValueError) as e:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"out: cannot be used as a tensor ({type(out).__name__}): {e}") from None
