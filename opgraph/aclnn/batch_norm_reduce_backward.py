"""aclnnBatchNormReduceBackward, composed like the C++ op_api (ops-nn
norm/sync_batch_norm_backward_reduce/op_api/aclnn_batch_norm_backward_reduce.cpp): the per-channel
(dim 1) sums SyncBatchNorm's backward needs, each written only when its mask asks for it:
``sumDy = Σ gradOut``, ``sumDyXmu = Σ gradOut·(input − mean)``, ``gradWeight = sumDyXmu·invstd``
and ``gradBias = sumDy`` (inputG → sumDy and sumDyXmu, weightG → gradWeight, biasG → gradBias).

The graph is the same on every SoC: Contiguous and Cast(→FLOAT) on gradOut, input, mean, invstd
and weight (a NULL weight is first filled with ones; weight's cast is never used), Mul(gradOut,
input), ReduceSum of the product, then of gradOut, over every dim but 1, the
SyncBatchNormBackwardReduce kernel (``sumDyXmu = ΣdyX − mean·Σdy``, ``·invstd``), and a Cast +
ViewCopy per enabled output. Masked-off outputs may be NULL; they are neither checked nor written.
An empty gradOut, input, mean or invstd gives zeros in the enabled outputs on Ascend950 and
leaves them untouched elsewhere (the vendor code records nothing there).

Vendor quirks kept: weight's dtype and shape and the shapes of gradOut, mean and invstd are not
checked; gradOut only has to broadcast against input (Mul broadcasts; Σdy then sums gradOut as
given), else Mul or ReduceSum fails: 561103, as in CANN. Deviation: where the vendor would hand
the SyncBatchNormBackwardReduce kernel buffers of other sizes (mean or invstd not of Σdy's shape
[C]: reads past their end), the l0 op refuses them and the call returns 561103.

    >>> import numpy as np, opgraph
    >>> x = np.float32([[1, 2], [3, 4], [5, 6]])                      # N = 3, C = 2
    >>> f = lambda *v: opgraph.tensor(np.float32(v))
    >>> out = {k: np.zeros(2, np.float32) for k in ("dy", "xmu", "gw", "gb")}
    >>> st, ws, ex = aclnnBatchNormReduceBackwardGetWorkspaceSize(
    ...     opgraph.tensor(np.ones_like(x)), opgraph.tensor(x), f(3, 4), f(2, 2), None,
    ...     True, True, True, *(opgraph.tensor(out[k]) for k in ("dy", "xmu", "gw", "gb")))
    >>> aclnnBatchNormReduceBackward(bytearray(ws) if ws else None, ws, ex)
    <Status.ACLNN_SUCCESS: 0>
    >>> {k: v.tolist() for k, v in out.items()}
    {'dy': [3.0, 3.0], 'xmu': [0.0, 0.0], 'gw': [0.0, 0.0], 'gb': [3.0, 3.0]}
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from l0ops.arith import Mul
from l0ops.basic import Cast, Contiguous, Fill, ViewCopy
from l0ops.reduce import ReduceSum
from l0ops.syncbn import SyncBatchNormBackwardReduce
from opgraph.core.dtypes import DataType
from opgraph.core.executor import Executor
from opgraph.core.ir import Value
from opgraph.core.opapi import Arrays, InputConfig, Option, Param
from opgraph.core.platform import Platform
from opgraph.core.status import AclnnError, Status
from opgraph.core.tensor import Tensor
from .common import (BF16, F16, F32, MAX_RANK, check_dtype, check_not_private, check_rank, invalid,
                     require_kernel)
from .direct import NUMPY_CALLS
from .pythonic import as_tensor, mask, output, result, run_op_api
from .twophase import check_not_null, op_api, run_executor

# the doc's product table: 950, A3 (910_93), A2 (910B), Atlas training (910); not 310B / 310P
PLATFORMS = ("Ascend910B", "Ascend910_93", "Ascend950", "Ascend910")
INPUTS = ("gradOut", "input", "mean", "invstd")
OUTPUTS = ("sumDy", "sumDyXmu", "gradWeight", "gradBias")
MASK_OF = {"sumDy": "inputG", "sumDyXmu": "inputG", "gradWeight": "weightG", "gradBias": "biasG"}
PARAMS = (*(Param(n, "tensor", "input") for n in INPUTS), Param("weight", "tensor", "input", optional=True),
          *(Param(m, "bool", "attr") for m in ("inputG", "weightG", "biasG")),
          *(Param(n, "tensor", "output", optional=True) for n in OUTPUTS))


def supported_dtypes(p: Platform) -> tuple[DataType, ...]:
    """{F32, F16}, plus BF16 iff ``NpuArch == DAV_2201 || IsRegbase`` (910B, 910_93, 950)."""
    return (F32, F16, BF16) if p.npu_arch == 2201 or p.is_regbase else (F32, F16)


def enabled(masks: dict[str, bool]) -> tuple[str, ...]:
    """The outputs whose mask is set, in the vendor's list order."""
    return tuple(n for n in OUTPUTS if masks[MASK_OF[n]])


def check_params(p: Platform, t: dict[str, Optional[Tensor]], masks: dict[str, bool]) -> None:
    """CheckNotNull (inputs, then the enabled outputs), CheckDtypeValid, CheckFormat, CheckShape.
    weight is never checked."""
    check_not_null(**{n: t[n] for n in INPUTS})
    on = enabled(masks)
    for n in on:
        if t[n] is None:
            raise AclnnError(Status.ACLNN_ERR_PARAM_NULLPTR, f"{n}: must not be NULL when "
                             f"{MASK_OF[n]} is true")
    allowed = supported_dtypes(p)
    for n in INPUTS:
        check_dtype(n, t[n], allowed, p)
    if t["gradOut"].dtype != t["input"].dtype:
        raise invalid(f"gradOut: dtype {t['gradOut'].dtype.name} must equal input's "
                      f"{t['input'].dtype.name}")
    for n in on:
        check_dtype(n, t[n], allowed, p)
    if t["gradOut"].format != t["input"].format:
        raise invalid(f"gradOut: storage format {t['gradOut'].format.name} must equal input's "
                      f"{t['input'].format.name}")
    for n in (*INPUTS, *on):
        check_not_private(n, t[n])
    check_rank("gradOut", t["gradOut"])
    check_rank("input", t["input"])
    C = t["input"].shape[1]
    if C == 0:
        raise invalid(f"input: channel dim (dim 1) is 0 in shape {list(t['input'].shape)}")
    for n in on:
        if t[n].shape != (C,):
            raise invalid(f"{n}: shape {list(t[n].shape)} must be [C] = [{C}] (C = input.shape[1])")


def copy_outputs(ex: Executor, sum_dy: Value, sum_dy_xmu: Value, grad_weight: Value,
                 dst: dict[str, Value]) -> list[Value]:
    """OutputParamCastAndViewCopy: Cast(→ the output's dtype) + ViewCopy for each enabled output,
    in the order sumDy, sumDyXmu, gradWeight, gradBias (gradBias gets sumDy's value)."""
    src = {"sumDy": sum_dy, "sumDyXmu": sum_dy_xmu, "gradWeight": grad_weight, "gradBias": sum_dy}
    return [ViewCopy(ex, Cast(ex, src[n], to=dst[n].dtype), dst[n]) for n in OUTPUTS if n in dst]


def reduce_sums(ex: Executor, dy: Value, x: Value) -> tuple[Value, Value]:
    """Mul(dy, x), then ReduceSum of the product, then of dy, over every dim of x but 1:
    ``(Σdy, Σdy·x)``."""
    axes = tuple(d for d in range(x.type.rank) if d != 1)
    sum_dy_x = ReduceSum(ex, Mul(ex, dy, x), axes=axes, keepdims=False)
    return ReduceSum(ex, dy, axes=axes, keepdims=False), sum_dy_x


# --- what the CLI, the backend kit and the docs need beyond the compose function -------------
def default_out_dtype(data: DataType, mean: DataType) -> DataType:
    """torch_npu's choice for the outputs it allocates: FLOAT16 when input and mean are both
    FLOAT16, else FLOAT."""
    return F16 if data == F16 and mean == F16 else F32


def _config(cfg: InputConfig) -> tuple[DataType, DataType, dict[str, bool]]:
    """(param dtype, output dtype, masks) of a generator configuration."""
    pd = cfg.option("param_dtype")
    od = cfg.option("out_dtype") or default_out_dtype(cfg.dtype, pd)
    masks = {"inputG": not cfg.option("no_input_g"), "weightG": not cfg.option("no_weight_g"),
             "biasG": not cfg.option("no_bias_g")}
    return pd, od, masks


def make_inputs(cfg: InputConfig, rng: np.random.Generator) -> Arrays:
    """Random valid arguments: gradOut and input of cfg.shape, mean near input's channel means,
    invstd in [0.5, 2); outputs zeroed, NULL where their mask is off."""
    shape, C = cfg.shape, cfg.shape[1]
    pd, od, masks = _config(cfg)
    a: Arrays = {
        "gradOut": rng.standard_normal(shape).astype(cfg.dtype.np),
        "input": (rng.standard_normal(shape) + 0.5).astype(cfg.dtype.np),
        "mean": rng.normal(0.5, 0.1, C).astype(pd.np),
        "invstd": rng.uniform(0.5, 2.0, C).astype(pd.np),
        "weight": None if cfg.option("no_weight") else rng.uniform(0.5, 1.5, C).astype(pd.np),
        **masks}
    on = enabled(masks)
    a.update({n: np.zeros(C, od.np) if n in on else None for n in OUTPUTS})
    return a


def input_bytes(cfg: InputConfig) -> int:
    """Bytes of the arrays :func:`make_inputs` makes, computed without making them."""
    pd, od, masks = _config(cfg)
    C = cfg.shape[1]
    params = (2 if cfg.option("no_weight") else 3) * pd.itemsize
    return 2 * math.prod(cfg.shape) * cfg.dtype.itemsize + C * (params + len(enabled(masks)) * od.itemsize)


def reference(a: Arrays) -> dict[str, np.ndarray]:
    """The formulas in float64 on the (already rounded) inputs, over every dim but 1, for the
    outputs given: ``sumDy = gradBias = Σdy``, ``sumDyXmu = Σdy·(x − mean)``,
    ``gradWeight = sumDyXmu·invstd`` (an empty input sums to 0)."""
    dy, x = (np.asarray(a[n]).astype(np.float64) for n in ("gradOut", "input"))
    mean, invstd = (np.asarray(a[n]).astype(np.float64) for n in ("mean", "invstd"))
    axes = tuple(d for d in range(x.ndim) if d != 1)
    bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    sum_dy = dy.sum(axis=axes)
    xmu = (dy * (x - mean.reshape(bshape))).sum(axis=axes)
    values = {"sumDy": sum_dy, "sumDyXmu": xmu, "gradWeight": xmu * invstd, "gradBias": sum_dy}
    return {n: v for n, v in values.items() if a.get(n) is not None and a.get(MASK_OF[n])}


@op_api("aclnnBatchNormReduceBackward", params=PARAMS, platforms=PLATFORMS, dtypes=supported_dtypes,
        aclnn_header="aclnn_batch_norm_backward_reduce.h",
        make_inputs=make_inputs, input_bytes=input_bytes, reference=reference, rank=(2, MAX_RANK),
        default_shape=(2, 3, 4, 4),
        options=(Option("no_weight", "flag", help="pass weight as NULL (filled with ones; unused)"),
                 Option("no_input_g", "flag", help="inputG = false: sumDy and sumDyXmu are NULL"),
                 Option("no_weight_g", "flag", help="weightG = false: gradWeight is NULL"),
                 Option("no_bias_g", "flag", help="biasG = false: gradBias is NULL"),
                 Option("param_dtype", "dtype", F32, "dtype of mean, invstd and weight"),
                 Option("out_dtype", "dtype", None, "dtype of the outputs (default: float16 when "
                        "--dtype and --param-dtype are float16, else float32, as torch_npu)")),
        summary="SyncBatchNorm backward per-channel sums Σdy, Σdy·(x−mean), grad weight/bias")
def aclnnBatchNormReduceBackwardGetWorkspaceSize(
        ex: Executor, gradOut: Optional[Tensor], input: Optional[Tensor], mean: Optional[Tensor],
        invstd: Optional[Tensor], weight: Optional[Tensor], inputG: bool, weightG: bool, biasG: bool,
        sumDy: Optional[Tensor], sumDyXmu: Optional[Tensor], gradWeight: Optional[Tensor],
        gradBias: Optional[Tensor]) -> None:
    """Phase 1. Returns ``(status, workspace_size, executor)``; ``None`` is a NULL pointer. A SoC
    outside the product table (310P, 310B) gets 561003 after the checks and the empty-input
    path."""
    p = ex.platform
    t = dict(gradOut=gradOut, input=input, mean=mean, invstd=invstd, sumDy=sumDy,
             sumDyXmu=sumDyXmu, gradWeight=gradWeight, gradBias=gradBias)
    masks = {"inputG": bool(inputG), "weightG": bool(weightG), "biasG": bool(biasG)}
    check_params(p, t, masks)
    C = input.shape[1]
    if any(t[n].is_empty for n in INPUTS):
        if p.is_regbase:  # FillScalar(C, 0) and the per-mask Cast + ViewCopy; elsewhere nothing
            dst = {n: ex.input(n, t[n]) for n in enabled(masks)}
            zeros = Fill(ex, shape=(C,), value=0.0, dtype=F32)
            ex.output(*copy_outputs(ex, zeros, zeros, zeros, dst))
        return
    require_kernel(PLATFORMS, p, "SyncBatchNormBackwardReduce")
    v = {n: ex.input(n, t[n]) for n in INPUTS}
    v["weight"] = (ex.input("weight", weight) if weight is not None
                   else Fill(ex, shape=(C,), value=1.0, dtype=F32))
    dst = {n: ex.input(n, t[n]) for n in enabled(masks)}
    c = {n: Contiguous(ex, v[n]) for n in (*INPUTS, "weight")}
    f = {n: Cast(ex, c[n], to=F32) for n in (*INPUTS, "weight")}  # weight's cast is never used
    sum_dy, sum_dy_x = reduce_sums(ex, f["gradOut"], f["input"])
    sum_dy_xmu, grad_weight = SyncBatchNormBackwardReduce(ex, sum_dy, sum_dy_x, f["mean"], f["invstd"])
    ex.output(*copy_outputs(ex, sum_dy, sum_dy_xmu, grad_weight, dst))


aclnnBatchNormReduceBackward = run_executor
"""Phase 2: ``aclnnBatchNormReduceBackward(workspace, workspace_size, executor, stream=None)``."""


def batch_norm_backward_reduce(grad_out: Any, input: Any, mean: Any, invstd: Any, weight: Any,
                               input_g: bool, weight_g: bool, bias_g: bool
                               ) -> tuple[Optional[np.ndarray], ...]:
    """torch.batch_norm_backward_reduce on numpy arrays (or opgraph Tensors):
    ``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)``, each a new [C] array, None where its mask
    is off. Their dtype follows torch_npu: float16 when input and mean are both float16, else
    float32. Raises AclnnError on bad input.

    >>> x = np.float32([[1, 2], [3, 4], [5, 6]])
    >>> r = batch_norm_backward_reduce(np.ones_like(x), x, np.float32([3, 4]),
    ...                                np.float32([2, 2]), None, True, False, True)
    >>> [None if v is None else v.tolist() for v in r]
    [[3.0, 3.0], [0.0, 0.0], None, [3.0, 3.0]]
    """
    args = (grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g)
    return tuple(NUMPY_CALLS.call("aclnnBatchNormReduceBackward", args,
                                  lambda: _batch_norm_backward_reduce(*args)))


def _batch_norm_backward_reduce(grad_out: Any, input: Any, mean: Any, invstd: Any, weight: Any,
                               input_g: bool, weight_g: bool, bias_g: bool
                               ) -> tuple[Optional[np.ndarray], ...]:
    """The usual two-phase call of :func:`batch_norm_backward_reduce`."""
    names = ("grad_out", "input", "mean", "invstd", "weight")
    args = [as_tensor(n, a) for n, a in zip(names, (grad_out, input, mean, invstd, weight))]
    x, m = args[1], args[2]
    C = x.shape[1] if x is not None and x.ndim >= 2 else 0
    od = default_out_dtype(x.dtype if x is not None else F32, m.dtype if m is not None else F32)
    ig, wg, bg = mask("input_g", input_g), mask("weight_g", weight_g), mask("bias_g", bias_g)
    outs = [output(n, None, (C,), od) if on else (None, None)
            for n, on in zip(("sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"), (ig, ig, wg, bg))]
    run_op_api(aclnnBatchNormReduceBackwardGetWorkspaceSize, aclnnBatchNormReduceBackward, *args,
               input_g, weight_g, bias_g, *(t for _, t in outs))
    return tuple(None if t is None else result(o, t) for o, t in outs)
