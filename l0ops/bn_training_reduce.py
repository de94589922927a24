"""BNTrainingReduce: the per-channel Σx and Σx² kernel behind aclnnBatchNormReduce (ops-nn
batch_norm_v3 op_api batch_norm.cpp, the l0 wrapper; norm/bn_training_reduce op_kernel arch35,
the 950 kernel). x is 4-D, tagged NCHW or NHWC; the two float32 outputs have the 4-D shape the
op_api passes (``shape``: [1,C,1,1] for NCHW, [1,1,1,C] for NHWC) and x's format.

Numerics: x is cast to float32, squared in float32 (one rounding), and both are summed over
every dim but the channel dim. The 950 kernel pre-scales x by 2^-k for the plain sum and
scales the result back by 2^k; a power-of-two scaling is exact (barring subnormals and
intermediate overflow), so it is not modelled. Its cross-core sums use atomic adds (an order
that changes from run to run), so the sums here run in opgraph's fixed order
(:mod:`l0ops.ordered`) — except where the 950 tiling picks its small-R template
(:func:`small_r`; attribute ``sequential``): one register per channel accumulates
``0 + x0 + x1 + …`` in order (bn_training_reduce_small_r.h:46-62), which is modelled as such
(not fused: the fixed order is not that one).

    >>> import numpy as np
    >>> x = np.float32([1, 2, 3, 4]).reshape(1, 2, 2, 1)                # NCHW: C = 2
    >>> s, q = BNTrainingReduce.compute([x], BNTrainingReduce.make_attrs(shape=(1, 2, 1, 1)))
    >>> s.ravel().tolist(), q.ravel().tolist()
    ([3.0, 7.0], [5.0, 25.0])
"""
from __future__ import annotations

import numpy as np

from opgraph.core.dtypes import DataType, Format
from opgraph.core.opdef import Fidelity, OpAttrs, require
from opgraph.core.types import TensorType
from .define import define_op
from .expansion import expansion_compute

F32 = DataType.FLOAT
FORMATS = (Format.NCHW, Format.NHWC)


def channel_dim(fmt: Format) -> int:
    """The channel dim of a 4-D tensor in ``fmt``: 3 for NHWC, else 1."""
    return 3 if fmt == Format.NHWC else 1


def out_shape(shape: tuple[int, ...], fmt: Format) -> tuple[int, ...]:
    """[1,C,1,1] (NCHW) or [1,1,1,C] (NHWC) for a 4-D ``shape`` in ``fmt``."""
    c = channel_dim(fmt)
    return tuple(shape[c] if d == c else 1 for d in range(4))


SMALL_R = (1, 3, 10, 17)  # IsFirstRoundSmallR: the H·W the small-R template takes


def small_r(t: TensorType) -> bool:
    """Whether the 950 tiling runs its small-R template on x's TensorType ``t``
    (bn_training_reduce_tiling_arch35.cpp:49-68, tried first: TryBuildSmallRConfig): NCHW,
    N = 1 and H·W in {1, 3, 10, 17}."""
    return t.rank == 4 and t.format == Format.NCHW and t.shape[0] == 1 and t.shape[2] * t.shape[3] in SMALL_R


class OutShapeAttrs(OpAttrs):
    """BNTrainingReduce's attributes: ``shape``, the outputs' shape ([1,C,1,1] for NCHW, [1,1,1,C]
    for NHWC: :func:`out_shape` of x); ``sequential``, the 950's small-R template (in-order
    sums; only where :func:`small_r` holds)."""

    shape: tuple[int, ...]
    sequential: bool = False  # the 950's small-R template (set where small_r(x) on Ascend950)


def _infer(ts, a: OutShapeAttrs):
    x = ts[0]
    require(x.rank == 4 and x.format in FORMATS, "BNTrainingReduce",
            f"x must be 4-D and tagged NCHW or NHWC, got {x}")
    want = out_shape(x.shape, x.format)
    require(tuple(a.shape) == want, "BNTrainingReduce",
            f"output shape {list(a.shape)} must be {list(want)} for x {x}")
    require(not a.sequential or small_r(x), "BNTrainingReduce",
            f"sequential sums are the small-R template's: NCHW, N = 1, H·W in {SMALL_R}; got {x}")
    out = x.with_(shape=want, dtype=F32)
    return [out, out]


def _expand(emit, args, a: OutShapeAttrs, ts) -> tuple[str, str]:
    """(Σ f32(x), Σ f32(f32(x)·f32(x))) over the dims where ``shape`` is 1 (a dim of size 1 in
    x adds nothing to the order, so the channel dim is never ambiguous)."""
    x = args[0] if ts[0].dtype == F32 else emit("cast", args, F32)
    over = ts[0].shape
    return (emit("sum", [x], F32, shape=tuple(a.shape), over=over),
            emit("sum", [emit("mul", [x, x], F32)], F32, shape=tuple(a.shape), over=over))


_ordered = expansion_compute(_expand)


def _compute(xs, a: OutShapeAttrs) -> list[np.ndarray]:
    """The small-R template: per channel, float32 registers from +0 adding x[0, c, r] and
    f32(x·x) for r = 0, 1, … in order; else the expansion (opgraph's fixed order)."""
    if not a.sequential:
        return _ordered(xs, a)
    x = np.asarray(xs[0]).astype(np.float32)
    rows = x.reshape(x.shape[1], -1)
    s, q = np.zeros(x.shape[1], np.float32), np.zeros(x.shape[1], np.float32)
    for r in range(rows.shape[1]):
        v = rows[:, r]
        s, q = s + v, q + v * v
    return [s.reshape(a.shape), q.reshape(a.shape)]


BNTrainingReduce = define_op(
    "BNTrainingReduce", attrs=OutShapeAttrs, num_inputs=1, kind="reduce", infer=_infer,
    compute=_compute, expand=_expand, expandable=lambda node: not node.attrs.sequential,
    fidelity=(Fidelity("bit-faithful", "950 kernel source (ops-nn bn_training_reduce arch35): cast "
                       "to float32, square in float32, sum (its 2^-k pre-scaling is exact); the "
                       "small-R template's sums in its order (sequential from +0); elsewhere the "
                       "kernel's cross-core atomic adds have no fixed order, so the float32 sums "
                       "run in opgraph's fixed order (l0ops.ordered)", (3510,)),
              Fidelity("formula", "no public 910B source (prebuilt): Σx and Σx² of float32(x), "
                       "the square rounded to float32, sums in opgraph's fixed order "
                       "(l0ops.ordered)", (2201,))),
    doc="(sum, squareSum): float32 Σx and Σx² of a 4-D NCHW/NHWC x over every dim but the "
        "channel dim, with the 4-D ``shape`` [1,C,1,1] or [1,1,1,C] and x's format.")

__all__ = ["BNTrainingReduce", "channel_dim", "out_shape", "small_r"]
