"""aclnnBatchNormElemtBackward, composed like the C++ op_api (ops-nn
norm/sync_batch_norm_backward_elemt/op_api/aclnn_batch_norm_elemt_backward.cpp): the checks in
the vendor's order, then every l0 call in emission order on the executor.

    >>> import numpy as np, opgraph
    >>> x = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    >>> f = lambda *v: opgraph.tensor(np.float32(v))
    >>> out = np.zeros_like(x)
    >>> st, ws, ex = aclnnBatchNormElemtBackwardGetWorkspaceSize(
    ...     opgraph.tensor(x), opgraph.tensor(x), f(0, 0), f(1, 1), f(1, 1), f(0, 0), f(1, 1),
    ...     f(5, 5), opgraph.tensor(out))
    >>> aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex)
    <Status.ACLNN_SUCCESS: 0>
    >>> [round(float(v), 4) for v in out.ravel()]
    [0.0, 0.9, 1.8, 2.7, 3.6, 4.5, 5.4, 6.3]
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from l0ops.basic import BroadcastTo, Cast, Contiguous, Fill, RealDiv, UnsqueezeNd, ViewCopy
from l0ops.reduce import ReduceSum
from l0ops.batchnorm import MODELLED_ARCHS, SyncBatchNormBackwardElemt
from opgraph.core.dtypes import DataType
from opgraph.core.executor import Executor
from opgraph.core.ir import Value
from opgraph.core.opapi import Arrays, InputConfig, Option, Param
from opgraph.core.platform import PRESETS, Platform
from opgraph.core.tensor import Tensor
from .common import F16, F32, MAX_RANK, S32, check_dtype, float_dtypes, invalid, require_kernel
from .direct import NUMPY_CALLS
from .pythonic import as_tensor, output, refuse_null, result, run_op_api
from .twophase import check_not_null, op_api, run_executor

COUNTER_DTYPES = (F32, F16, S32)
INPUT_ORDER = ("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter")
PLATFORMS = tuple(soc for soc, p in PRESETS.items() if p.npu_arch in MODELLED_ARCHS)
PARAMS = (*(Param(n, "tensor", "input", optional=n == "weight") for n in INPUT_ORDER),
          Param("gradInput", "tensor", "output"))


def check_params(p: Platform, t: dict[str, Optional[Tensor]]) -> None:
    """CheckNotNull, CheckDtypeValid, CheckFormat, CheckShape — in that order."""
    check_not_null(**{k: t[k] for k in ("gradOut", "input", "mean", "invstd", "sumDy", "sumDyXmu",
                                          "counter", "gradInput")})
    allowed = float_dtypes(p)
    for name in (*INPUT_ORDER, "gradInput"):
        check_dtype(name, t[name], COUNTER_DTYPES if name == "counter" else allowed, p)
    for name in ("gradOut", "input", "gradInput"):
        if t[name].format.is_private:
            raise invalid(f"{name}: private storage format {t[name].format.name} is not supported "
                          "(use ND, NCHW, NCL, NCDHW or another plain format)")
    inp = t["input"]
    if inp.ndim < 2:
        raise invalid(f"input: rank {inp.ndim} is less than 2")
    for name in ("input", "gradOut", "gradInput", "counter"):
        if t[name].ndim > MAX_RANK:
            raise invalid(f"{name}: rank {t[name].ndim} is greater than {MAX_RANK}")
    C = inp.shape[1]
    if C == 0:
        raise invalid(f"input: channel dim (dim 1) is 0 in shape {list(inp.shape)}")
    for name in ("gradOut", "gradInput"):
        if t[name].shape != inp.shape:
            raise invalid(f"{name}: shape {list(t[name].shape)} must equal input's {list(inp.shape)}")
    for name in ("mean", "invstd", "weight", "sumDy", "sumDyXmu"):
        x = t[name]
        if x is not None and x.shape != (C,):
            raise invalid(f"{name}: shape {list(x.shape)} must be [C] = [{C}] (C = input.shape[1])")


def mean_by_counter(ex: Executor, sum_dy: Value, sum_dy_xmu: Value, counter: Value) -> tuple[Value, Value]:
    """meanDy = sumDy / Σcounter and meanDyXmu = sumDyXmu / Σcounter, in FP32 (the div type)."""
    total = ReduceSum(ex, Cast(ex, counter, to=F32), axes=tuple(range(counter.type.rank)), keepdims=False)
    div_type = F32  # PromoteType(sumDy's compute type, FLOAT) is FP32 for FP16/FP32
    sum_dy = Cast(ex, sum_dy, to=div_type)
    sum_dy_xmu = Cast(ex, sum_dy_xmu, to=div_type)
    total = Cast(ex, total, to=div_type)
    return RealDiv(ex, sum_dy, total), RealDiv(ex, sum_dy_xmu, total)


def broadcast_channel(ex: Executor, param: Value, shape: tuple[int, ...]) -> Value:
    """[C] → (1, C) → (1, C, 1, …) → BroadcastTo(shape): channel parameter to full size."""
    v = UnsqueezeNd(ex, param, dims=(0,))
    if len(shape) > 2:
        v = UnsqueezeNd(ex, v, dims=tuple(range(2, len(shape))))
    return BroadcastTo(ex, v, shape=tuple(shape))


def promote_type(dtypes: list[DataType]) -> DataType:
    """FP16 only when all seven float inputs are FP16; otherwise FP32."""
    return F16 if all(d == F16 for d in dtypes) else F32


# --- what the CLI, the backend kit and the docs need beyond the compose function -------------
def make_inputs(cfg: InputConfig, rng: np.random.Generator) -> Arrays:
    """Random valid arguments: invstd in [0.5, 2), counter whole numbers in 1..8."""
    shape, d = cfg.shape, cfg.dtype
    out_dtype = d if cfg.option("grad_input_dtype") is None else cfg.option("grad_input_dtype")
    C = shape[1]
    cast = lambda a, t: np.asarray(a).astype(t.np)  # noqa: E731
    return {
        "gradOut": cast(rng.standard_normal(shape), d),
        "input": cast(rng.standard_normal(shape), d),
        "mean": cast(rng.normal(0.0, 0.5, C), d),
        "invstd": cast(rng.uniform(0.5, 2.0, C), d),
        "weight": None if cfg.option("no_weight") else cast(rng.uniform(0.5, 1.5, C), d),
        "sumDy": cast(rng.standard_normal(C), d),
        "sumDyXmu": cast(rng.standard_normal(C), d),
        "counter": cast(rng.integers(1, 9, C), cfg.option("counter_dtype")),
        "gradInput": np.zeros(shape, out_dtype.np),
    }


def input_bytes(cfg: InputConfig) -> int:
    """Bytes of the arrays :func:`make_inputs` makes, computed without making them."""
    d = cfg.dtype
    out_dtype = d if cfg.option("grad_input_dtype") is None else cfg.option("grad_input_dtype")
    per_channel = (4 if cfg.option("no_weight") else 5) * d.itemsize + cfg.option("counter_dtype").itemsize
    numel, channels = math.prod(cfg.shape), cfg.shape[1]
    return numel * (2 * d.itemsize + out_dtype.itemsize) + channels * per_channel


def reference(a: Arrays) -> dict[str, np.ndarray]:
    """The formula in float64 on the (already rounded) inputs; channel = dim 1:
    ``((gradOut − sumDy/Σcnt) − (input − mean)·invstd²·(sumDyXmu/Σcnt))·invstd·weight``."""
    f = {k: np.asarray(v).astype(np.float64) for k, v in a.items() if v is not None}
    x = f["input"]
    bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    ch = {k: f[k].reshape(bshape) for k in ("mean", "invstd", "weight", "sumDy", "sumDyXmu") if k in f}
    total = f["counter"].sum()
    weight = ch.get("weight", 1.0)
    return {"gradInput": (((f["gradOut"] - ch["sumDy"] / total)
                           - (x - ch["mean"]) * ch["invstd"] ** 2 * (ch["sumDyXmu"] / total))
                          * ch["invstd"] * weight)}


@op_api("aclnnBatchNormElemtBackward", params=PARAMS, platforms=PLATFORMS, dtypes=float_dtypes,
        make_inputs=make_inputs, input_bytes=input_bytes, reference=reference, rank=(2, MAX_RANK),
        in_place=True,
        options=(Option("no_weight", "flag", help="pass weight as NULL (filled with ones)"),
                 Option("counter_dtype", "dtype", F32, "dtype of counter: float32, float16, int32"),
                 Option("grad_input_dtype", "dtype", None, "dtype of gradInput (default: --dtype)")),
        summary="SyncBatchNorm element-wise input gradient, channel = dim 1")
def aclnnBatchNormElemtBackwardGetWorkspaceSize(
        ex: Executor, gradOut: Optional[Tensor], input: Optional[Tensor], mean: Optional[Tensor],
        invstd: Optional[Tensor], weight: Optional[Tensor], sumDy: Optional[Tensor],
        sumDyXmu: Optional[Tensor], counter: Optional[Tensor], gradInput: Optional[Tensor]) -> None:
    """Phase 1. Returns ``(status, workspace_size, executor)``; ``None`` is a NULL pointer."""
    p = ex.platform
    t = dict(gradOut=gradOut, input=input, mean=mean, invstd=invstd, weight=weight, sumDy=sumDy,
             sumDyXmu=sumDyXmu, counter=counter, gradInput=gradInput)
    check_params(p, t)
    if input.is_empty or gradOut.is_empty:
        return  # success, workspace 0, an executor with no kernels
    require_kernel(PLATFORMS, p, "SyncBatchNormBackwardElemt")
    shape, C = input.shape, input.shape[1]
    v = {name: ex.input(name, x) for name, x in t.items() if x is not None}
    if weight is None:
        v["weight"] = Fill(ex, shape=(C,), value=1.0, dtype=F32)
    c = {name: Contiguous(ex, v[name]) for name in INPUT_ORDER}
    floats = INPUT_ORDER[:-1]
    promote = promote_type([c[n].dtype for n in floats])
    c.update({name: Cast(ex, c[name], to=promote) for name in floats})
    mean_dy, mean_dy_xmu = mean_by_counter(ex, c["sumDy"], c["sumDyXmu"], c["counter"])
    b = {name: broadcast_channel(ex, val, shape)
         for name, val in (("mean", c["mean"]), ("invstd", c["invstd"]), ("weight", c["weight"]),
                           ("meanDy", mean_dy), ("meanDyXmu", mean_dy_xmu))}
    b["meanDy"] = Cast(ex, b["meanDy"], to=promote)
    b["meanDyXmu"] = Cast(ex, b["meanDyXmu"], to=promote)
    out = SyncBatchNormBackwardElemt(
        ex, c["gradOut"], c["input"], b["mean"], b["invstd"], b["weight"], b["meanDy"],
        b["meanDyXmu"], arch=p.npu_arch)
    out = Cast(ex, out, to=gradInput.dtype)
    ex.output(ViewCopy(ex, out, v["gradInput"]))


aclnnBatchNormElemtBackward = run_executor
"""Phase 2: ``aclnnBatchNormElemtBackward(workspace, workspace_size, executor, stream=None)``."""


def batch_norm_elemt_backward(grad_out: Any, input: Any, mean: Any, invstd: Any, weight: Any,
                              sum_dy: Any, sum_dy_xmu: Any, counter: Any,
                              out: "np.ndarray | Tensor | None" = None) -> np.ndarray:
    """torch.batch_norm_backward_elemt on numpy arrays (or opgraph Tensors): SyncBatchNorm's
    element-wise input gradient. ``out`` (any float dtype, may be a strided view) receives the
    result; by default a new array of input's shape and dtype. Raises AclnnError (writing
    nothing) on bad input.

    >>> x = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    >>> c = lambda *v: np.float32(v)
    >>> y = batch_norm_elemt_backward(x, x, c(0, 0), c(1, 1), c(1, 1), c(0, 0), c(1, 1), c(5, 5))
    >>> np.allclose(y, 0.9 * x)
    True
    """
    args = (grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, counter)
    if out is not None:  # the caller's array: the usual call checks and writes it
        return _batch_norm_elemt_backward(*args, out)
    return NUMPY_CALLS.call("aclnnBatchNormElemtBackward", args,
                            lambda: [_batch_norm_elemt_backward(*args, None)])[0]


def _batch_norm_elemt_backward(grad_out: Any, input: Any, mean: Any, invstd: Any, weight: Any,
                              sum_dy: Any, sum_dy_xmu: Any, counter: Any,
                              out: "np.ndarray | Tensor | None" = None) -> np.ndarray:
    """The usual two-phase call of :func:`batch_norm_elemt_backward`."""
    names = ("grad_out", "input", "mean", "invstd", "weight", "sum_dy", "sum_dy_xmu", "counter")
    args = [as_tensor(n, a) for n, a in zip(names, (grad_out, input, mean, invstd, weight, sum_dy,
                                                     sum_dy_xmu, counter))]
    x = args[1]
    if x is None:  # no shape for out: the op_api names the first NULL (gradOut, input ...)
        refuse_null(aclnnBatchNormElemtBackwardGetWorkspaceSize, aclnnBatchNormElemtBackward, *args, None)
    out, out_t = output("out", out, x.shape, x.dtype)
    run_op_api(aclnnBatchNormElemtBackwardGetWorkspaceSize, aclnnBatchNormElemtBackward, *args, out_t)
    return result(out, out_t)
