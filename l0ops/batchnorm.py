"""SyncBatchNormBackwardElemt, the AI Vector kernel, with its per-platform numerics (design §4).

``gradInput = ((gradOut − meanDy) − (input − mean)·(invstd²·meanDyXmu))·invstd·weight``

    >>> import numpy as np
    >>> x = np.arange(4, dtype=np.float32)
    >>> one, zero = np.float32(1), np.float32(0)
    >>> elemt_backward(x, x, zero, one, one, zero, np.float32(0.1), arch=2201).tolist()
    [0.0, 0.8999999761581421, 1.7999999523162842, 2.700000047683716]
"""
from __future__ import annotations

import numpy as np

from opgraph.dtypes import DataType
from .registry import L0Error, OpAttrs, define_op, require

F32, F16, BF16 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16
# (T, T1) pairs the kernel registry allows (reference §5.5): data dtype, parameter dtype.
KERNEL_VARIANTS = {(F16, F16), (BF16, BF16), (F32, F32), (F16, F32)}
# Archs whose kernel opgraph models: DAV_2201 (910B/910_93; 910 shares its flavour), DAV_3510.
MODELLED_ARCHS = {1001: "dav2201", 2201: "dav2201", 3510: "dav3510"}


class ElemtAttrs(OpAttrs):
    arch: int  # NpuArch whose kernel numerics apply (2201, 1001 or 3510); always printed


def kernel_flavour(arch: int) -> str:
    """'dav2201' (eight in-order vector steps) or 'dav3510' (regbase DAG)."""
    try:
        return MODELLED_ARCHS[arch]
    except KeyError:
        raise ValueError(f"SyncBatchNormBackwardElemt has no kernel for DAV_{arch}") from None


def elemt_backward(go, x, mean, invstd, weight, mdy, mdyx, *, arch: int = 2201,
                   out: "np.ndarray | None" = None) -> np.ndarray:
    """The kernel's numpy semantics on broadcastable operands.

    T = dtype of ``go``/``x``, T1 = dtype of the five parameters. On DAV_2201 T == T1 ∈ {f16, f32}
    computes in T (fp16 emulated as float32 rounded to fp16 after every step, which is bit-identical
    to native fp16); (bf16, bf16) and (f16, f32) compute in float32 and round back to T (RNE).
    DAV_3510 always computes in float32 with its own step order.
    """
    t = np.dtype(go.dtype)
    f32 = np.float32
    flavour = kernel_flavour(arch)
    direct_f16 = flavour == "dav2201" and t == F16.np and np.dtype(mean.dtype) == F16.np
    if direct_f16:
        def r(a):
            return a.astype(np.float16).astype(f32)
    else:
        def r(a):
            return a
    g, xi, mu, inv, w, md, mdx = (np.asarray(a).astype(f32, copy=False)
                                  for a in (go, x, mean, invstd, weight, mdy, mdyx))
    if flavour == "dav2201":
        s1 = r(g - md)
        s2 = r(xi - mu)
        m = r(inv * inv)
        m = r(m * mdx)
        s2 = r(s2 * m)
        s1 = r(s1 - s2)
        s1 = r(s1 * inv)
        res = r(s1 * w)
    else:
        sub1 = g - md
        sub2 = xi - mu
        m1 = inv * inv
        m2 = mdx * m1
        m3 = sub2 * m2
        sub3 = sub1 - m3
        ww = inv * w
        res = sub3 * ww
    res = res.astype(t, copy=False)
    if out is not None:
        np.copyto(out, res)
        return out
    return res


def _infer(ts, a):
    try:
        kernel_flavour(a.arch)
    except ValueError as e:
        raise L0Error(str(e)) from None
    shape = ts[0].shape
    for i, t in enumerate(ts):
        require(t.shape == shape, "SyncBatchNormBackwardElemt",
                f"input {i} has shape {list(t.shape)}, expected {list(shape)}")
    T, T1 = ts[0].dtype, ts[2].dtype
    require(ts[1].dtype == T, "SyncBatchNormBackwardElemt", "gradOut and input dtypes differ")
    require(all(t.dtype == T1 for t in ts[2:]), "SyncBatchNormBackwardElemt",
            "mean, invstd, weight, meanDy and meanDyXmu must share one dtype")
    require((T, T1) in KERNEL_VARIANTS, "SyncBatchNormBackwardElemt",
            f"no kernel variant for (T, T1) = ({T.short}, {T1.short})")
    return [ts[1].with_()]


SyncBatchNormBackwardElemt = define_op(
    "SyncBatchNormBackwardElemt", attrs=ElemtAttrs, num_inputs=7, kind="elementwise", infer=_infer,
    compute=lambda xs, a: [elemt_backward(*xs, arch=a.arch)],
    doc="The element-wise SyncBatchNorm input gradient kernel (7 same-shape inputs).")
