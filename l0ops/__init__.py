"""l0 ops: one definition per op — attributes, shape/dtype inference, effects, numpy semantics
and expansion into elementwise primitives (see :func:`define_op`).

    >>> import l0ops
    >>> {"Cast", "Mul", "ReduceVar", "SqueezeNd"} <= set(l0ops.all_ops())
    True

Layering: l0ops sits on ``opgraph.core`` and is imported by the passes, the op_apis and the
backends. Its first import is ``opgraph.core`` (which loads the ``opgraph`` package first), and
its modules import one another by module path, so either package may be imported first.
"""
from opgraph.core.opdef import DType, Fidelity, L0Error, OpAttrs, OpDef, all_ops, get_op, require
from .define import define_op
from .primitives import FusedAttrs, Instr, cast_array
from .interpreter import run_fused
from .basic import BroadcastTo, Cast, Contiguous, Fill, RealDiv, UnsqueezeNd, ViewCopy
from .reduce import ReduceMean, ReduceMeanWithCount, ReduceStdWithMean, ReduceSum, ReduceVar
from .arith import Add, Div, Mul, OnesLike, Pow, Sub
from .views import ReFormat, Reshape, SqueezeNd
from .batchnorm import SyncBatchNormBackwardElemt, elemt_backward
from .bninfer import BatchNormV3, BNInfer
from .bn_training_reduce import BNTrainingReduce  # noqa: F401
from .sync_bn_gather_stats import SyncBatchNormGatherStats  # noqa: F401
from .syncbn import (SyncBatchNormBackwardReduce, SyncBatchNormGatherStatsFused,
                     SyncBatchNormGatherStatsWithCounts, SyncBNTrainingUpdate)
from .fused import FusedElementwise
from .fused_reduce import FusedReduce

__all__ = ["DType", "Fidelity", "L0Error", "OpAttrs", "OpDef", "all_ops", "define_op", "get_op",
           "require", "FusedAttrs", "Instr", "cast_array", "run_fused", "BroadcastTo", "Cast",
           "Contiguous", "Fill", "RealDiv", "ReduceSum", "UnsqueezeNd", "ViewCopy", "ReduceMean",
           "ReduceMeanWithCount", "ReduceStdWithMean", "ReduceVar", "Add", "Div", "Mul", "OnesLike",
           "Pow", "Sub", "ReFormat", "Reshape", "SqueezeNd",
           "SyncBatchNormBackwardElemt", "elemt_backward", "FusedElementwise", "BatchNormV3",
           "BNInfer", "SyncBatchNormBackwardReduce", "SyncBatchNormGatherStatsFused",
           "SyncBatchNormGatherStatsWithCounts", "SyncBNTrainingUpdate", "FusedReduce"]
