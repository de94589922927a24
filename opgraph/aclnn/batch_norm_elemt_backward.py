"""aclnnBatchNormElemtBackward, composed like the C++ op_api (reference §5.4–§5.5): the checks in
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

from typing import Optional

import l0ops
from l0ops.batchnorm import MODELLED_ARCHS

from ..dtypes import DataType
from ..executor import Executor
from ..ir import Value
from ..platform import PRESETS, Platform
from ..status import AclnnError, Status
from ..tensor import Tensor
from .twophase import check_not_null, op_api, run_executor

F32, F16, BF16, S32 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16, DataType.INT32
DTYPES = (F32, F16)
DTYPES_BF16 = (F32, F16, BF16)
COUNTER_DTYPES = (F32, F16, S32)
MAX_RANK = 8
INPUT_ORDER = ("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter")


def _invalid(msg: str) -> AclnnError:
    return AclnnError(Status.ACLNN_ERR_PARAM_INVALID, msg)


def data_dtypes(p: Platform) -> tuple[DataType, ...]:
    """BF16 is accepted on Ascend910B / 910_93 and on regbase (Ascend950) only."""
    return DTYPES_BF16 if p.soc in ("Ascend910B", "Ascend910_93") or p.is_regbase else DTYPES


def check_params(p: Platform, t: dict[str, Optional[Tensor]]) -> None:
    """CheckNotNull, CheckDtypeValid, CheckFormat, CheckShape — in that order."""
    check_not_null(**{k: t[k] for k in ("gradOut", "input", "mean", "invstd", "sumDy", "sumDyXmu",
                                          "counter", "gradInput")})
    check_not_null(**({"weight": t["weight"]} if t["weight"] is not None else {}))
    allowed = data_dtypes(p)
    for name in ("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter", "gradInput"):
        x = t[name]
        if x is None:
            continue
        ok = COUNTER_DTYPES if name == "counter" else allowed
        if x.dtype not in ok:
            raise _invalid(f"{name}: dtype {x.dtype.name} is not supported on {p.soc} "
                           f"(supported: {', '.join(d.name for d in ok)})")
    for name in ("gradOut", "input", "gradInput"):
        if t[name].format.is_private:
            raise _invalid(f"{name}: private storage format {t[name].format.name} is not supported "
                           "(use ND, NCHW, NCL, NCDHW or another plain format)")
    inp = t["input"]
    if inp.ndim < 2:
        raise _invalid(f"input: rank {inp.ndim} is less than 2")
    for name in ("input", "gradOut", "gradInput", "counter"):
        if t[name].ndim > MAX_RANK:
            raise _invalid(f"{name}: rank {t[name].ndim} is greater than {MAX_RANK}")
    C = inp.shape[1]
    if C == 0:
        raise _invalid(f"input: channel dim (dim 1) is 0 in shape {list(inp.shape)}")
    for name in ("gradOut", "gradInput"):
        if t[name].shape != inp.shape:
            raise _invalid(f"{name}: shape {list(t[name].shape)} must equal input's {list(inp.shape)}")
    for name in ("mean", "invstd", "weight", "sumDy", "sumDyXmu"):
        x = t[name]
        if x is not None and x.shape != (C,):
            raise _invalid(f"{name}: shape {list(x.shape)} must be [C] = [{C}] (C = input.shape[1])")


def mean_by_counter(ex: Executor, sum_dy: Value, sum_dy_xmu: Value, counter: Value) -> tuple[Value, Value]:
    """meanDy = sumDy / Σcounter and meanDyXmu = sumDyXmu / Σcounter, in FP32 (the div type)."""
    total = l0ops.ReduceSum(ex, l0ops.Cast(ex, counter, to=F32),
                            axes=tuple(range(counter.type.rank)), keepdims=False)
    div_type = F32  # PromoteType(sumDy's compute type, FLOAT) is FP32 for FP16/FP32
    sum_dy = l0ops.Cast(ex, sum_dy, to=div_type)
    sum_dy_xmu = l0ops.Cast(ex, sum_dy_xmu, to=div_type)
    total = l0ops.Cast(ex, total, to=div_type)
    return l0ops.RealDiv(ex, sum_dy, total), l0ops.RealDiv(ex, sum_dy_xmu, total)


def broadcast_channel(ex: Executor, param: Value, shape: tuple[int, ...]) -> Value:
    """[C] → (1, C) → (1, C, 1, …) → BroadcastTo(shape): channel parameter to full size."""
    v = l0ops.UnsqueezeNd(ex, param, dims=(0,))
    if len(shape) > 2:
        v = l0ops.UnsqueezeNd(ex, v, dims=tuple(range(2, len(shape))))
    return l0ops.BroadcastTo(ex, v, shape=tuple(shape))


def promote_type(dtypes: list[DataType]) -> DataType:
    """FP16 only when all seven float inputs are FP16; otherwise FP32."""
    return F16 if all(d == F16 for d in dtypes) else F32


@op_api("aclnnBatchNormElemtBackward")
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
    if not p.supports_elemt_backward or p.npu_arch not in MODELLED_ARCHS:
        supported = ", ".join(k for k, q in PRESETS.items() if q.supports_elemt_backward)
        raise AclnnError(Status.ACLNN_ERR_INNER_FIND_KERNEL_ERROR,
                         f"SyncBatchNormBackwardElemt has no kernel on {p.soc} ({p.arch_name}); "
                         f"supported platforms: {supported}")
    shape, C = input.shape, input.shape[1]
    v = {name: ex.input(name, x) for name, x in t.items() if x is not None}
    if weight is None:
        v["weight"] = l0ops.Fill(ex, shape=(C,), value=1.0, dtype=F32)
    c = {name: l0ops.Contiguous(ex, v[name]) for name in INPUT_ORDER}
    floats = INPUT_ORDER[:-1]
    promote = promote_type([c[n].dtype for n in floats])
    c.update({name: l0ops.Cast(ex, c[name], to=promote) for name in floats})
    mean_dy, mean_dy_xmu = mean_by_counter(ex, c["sumDy"], c["sumDyXmu"], c["counter"])
    b = {name: broadcast_channel(ex, val, shape)
         for name, val in (("mean", c["mean"]), ("invstd", c["invstd"]), ("weight", c["weight"]),
                           ("meanDy", mean_dy), ("meanDyXmu", mean_dy_xmu))}
    b["meanDy"] = l0ops.Cast(ex, b["meanDy"], to=promote)
    b["meanDyXmu"] = l0ops.Cast(ex, b["meanDyXmu"], to=promote)
    out = l0ops.SyncBatchNormBackwardElemt(
        ex, c["gradOut"], c["input"], b["mean"], b["invstd"], b["weight"], b["meanDy"],
        b["meanDyXmu"], arch=p.npu_arch)
    out = l0ops.Cast(ex, out, to=gradInput.dtype)
    ex.output(l0ops.ViewCopy(ex, out, v["gradInput"]))


aclnnBatchNormElemtBackward = run_executor
"""Phase 2: ``aclnnBatchNormElemtBackward(workspace, workspace_size, executor, stream=None)``."""
