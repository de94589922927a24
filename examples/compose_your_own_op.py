"""Compose your own op: a new l0 op (``define_op``) and a new two-phase op_api (``op_api``),
built the way ops-nn's C++ op_apis are: check the arguments, then record l0 calls on the executor.

    aclnnChannelScale(x, scale, alpha, out):   out = alpha * x * scale[c]    (channel c = dim 1)

Run: python examples/compose_your_own_op.py
Every CLI command takes it too, e.g.
    opgraph dump aclnnChannelScale --load examples/compose_your_own_op.py --level 2
    opgraph run aclnnChannelScale --load examples/compose_your_own_op.py --dtype float16
"""
import sys

import numpy as np

import l0ops
import opgraph
from l0ops import OpAttrs, define_op
from opgraph import AclnnError, DataType, Status
from opgraph.core.opapi import InputConfig, Param
from opgraph.core.opdef import require

# --- 1. a new l0 op: attrs (a pydantic model), type inference, and its steps as elementwise ----
#        primitives: that makes it fusable, and its numpy semantics come from the same steps


class ScaledMulAttrs(OpAttrs):
    alpha: float = 1.0


def scaled_mul_infer(types, attrs):
    """x, y of one dtype and one shape → the same type."""
    x, y = types
    require(x.dtype == y.dtype, "ExampleScaledMul",
            f"dtypes differ ({x.dtype.short} vs {y.dtype.short})")
    require(x.shape == y.shape, "ExampleScaledMul",
            f"shapes differ ({list(x.shape)} vs {list(y.shape)})")
    return [x.with_()]


def scaled_mul_expand(emit, args, attrs, types):
    """alpha * x * y in the operands' dtype (each product rounded, like two vector Muls)."""
    d = types[0].dtype
    alpha = emit("fill", [], d, value=attrs.alpha)
    return emit("mul", [emit("mul", args, d), alpha], d)


# A unique name, and replace=True so running this file twice in one process is fine.
ScaledMul = define_op("ExampleScaledMul", attrs=ScaledMulAttrs, kind="elementwise", num_inputs=2,
                      infer=scaled_mul_infer, expand=scaled_mul_expand, replace=True,
                      doc="alpha * x * y, elementwise (an example user op)")

# --- 2. a new op_api composed from l0 ops -------------------------------------------------------
FLOATS = (DataType.FLOAT, DataType.FLOAT16, DataType.BF16)


def check_params(x, scale, out):
    """The argument checks, in CANN's order: NULL (161001), dtype, then shape (161002)."""
    opgraph.aclnn.check_not_null(x=x, scale=scale, out=out)
    for name, t in (("x", x), ("scale", scale), ("out", out)):
        if t.dtype not in FLOATS:
            raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                             f"{name}: dtype {t.dtype.name} is not FLOAT, FLOAT16 or BF16")
    if x.ndim < 2:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID, f"x: rank {x.ndim} is less than 2")
    if scale.shape != (x.shape[1],):
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"scale: shape {list(scale.shape)} must be [C] = [{x.shape[1]}]")
    if out.shape != x.shape:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"out: shape {list(out.shape)} must equal x's {list(x.shape)}")


def make_inputs(cfg: InputConfig, rng: np.random.Generator) -> dict:
    """Random arguments for the CLI and the backend kit."""
    return {"x": rng.standard_normal(cfg.shape).astype(cfg.dtype.np),
            "scale": rng.uniform(-2, 2, cfg.shape[1]).astype(cfg.dtype.np),
            "alpha": 2.0, "out": np.zeros(cfg.shape, cfg.dtype.np)}


def reference(a: dict) -> dict:
    """The formula in float64 (what ``opgraph run`` compares against)."""
    x = np.asarray(a["x"], np.float64)
    scale = np.asarray(a["scale"], np.float64).reshape((1, -1) + (1,) * (x.ndim - 2))
    return {"out": a["alpha"] * x * scale}


# replace=True in the registry: running this file twice in one process is fine
@opgraph.aclnn.op_api("aclnnChannelScale",
                      params=(Param("x", "tensor", "input"), Param("scale", "tensor", "input"),
                              Param("alpha", "double", "attr"), Param("out", "tensor", "output")),
                      dtypes=lambda p: FLOATS, make_inputs=make_inputs, reference=reference,
                      rank=(2, 8), aclnn_api=None, summary="out = alpha * x * scale[c] (an example)")
def aclnnChannelScaleGetWorkspaceSize(ex, x, scale, alpha, out):
    """Phase 1 of aclnnChannelScale; returns (status, workspace_size, executor)."""
    check_params(x, scale, out)
    if x.is_empty:
        return  # success, nothing to launch
    compute = DataType.FLOAT16 if x.dtype == scale.dtype == DataType.FLOAT16 else DataType.FLOAT
    xc = l0ops.Cast(ex, l0ops.Contiguous(ex, ex.input("x", x)), to=compute)
    sc = l0ops.Cast(ex, l0ops.Contiguous(ex, ex.input("scale", scale)), to=compute)
    sc = l0ops.UnsqueezeNd(ex, sc, dims=(0,))                                  # (1, C)
    if x.ndim > 2:
        sc = l0ops.UnsqueezeNd(ex, sc, dims=tuple(range(2, x.ndim)))           # (1, C, 1, ...)
    sc = l0ops.BroadcastTo(ex, sc, shape=x.shape)
    y = l0ops.Cast(ex, ScaledMul(ex, xc, sc, alpha=float(alpha)), to=out.dtype)
    ex.output(l0ops.ViewCopy(ex, y, ex.input("out", out)))


aclnnChannelScale = opgraph.aclnn.run_executor  # phase 2 is the shared executor run


def CHECK_RET(ret, what):
    if ret != Status.ACLNN_SUCCESS:
        print(f"{what} failed. ERROR: {int(ret)} {opgraph.aclnn.aclGetRecentErrMsg()}")
        sys.exit(1)


def main() -> int:
    rng = np.random.default_rng(0)
    x_host = rng.standard_normal((2, 3, 4)).astype(np.float16)
    scale_host = np.float32([0.5, 2.0, -1.0])
    out_host = np.zeros((2, 3, 4), np.float32)

    # bad arguments come back as a status and a message, never as an exception
    ret, _, _ = aclnnChannelScaleGetWorkspaceSize(opgraph.tensor(x_host), None, 2.0,
                                                  opgraph.tensor(out_host))
    print(f"scale=NULL -> {int(ret)} {opgraph.aclnn.aclGetRecentErrMsg()}")

    ret, ws, executor = aclnnChannelScaleGetWorkspaceSize(
        opgraph.tensor(x_host), opgraph.tensor(scale_host), 2.0, opgraph.tensor(out_host))
    CHECK_RET(ret, "aclnnChannelScaleGetWorkspaceSize")
    print(f"workspaceSize = {ws}")
    print(executor.graph)
    ret = aclnnChannelScale(bytearray(ws) if ws else None, ws, executor)
    CHECK_RET(ret, "aclnnChannelScale")

    expected = (x_host.astype(np.float32) * scale_host.reshape(1, 3, 1)) * np.float32(2.0)
    err = float(np.max(np.abs(out_host - expected)))
    print(f"out[0, :, 0] = {out_host[0, :, 0].tolist()}")
    print(f"max abs error vs numpy: {err}")
    if err != 0.0:
        print("MISMATCH")
        return 1
    print("matches numpy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
