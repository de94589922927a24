"""l0 ops: one definition per op (attrs, shape/dtype inference, effects, numpy semantics).

    >>> import l0ops
    >>> sorted(l0ops.all_ops())[:3]
    ['BroadcastTo', 'Cast', 'Contiguous']
"""
from .registry import DType, L0Error, OpAttrs, OpDef, all_ops, define_op, get_op
from .basic import (BroadcastTo, Cast, Contiguous, Fill, RealDiv, ReduceSum, UnsqueezeNd,
                    ViewCopy, cast_array)
from .batchnorm import SyncBatchNormBackwardElemt, elemt_backward
from .fused import FusedAttrs, FusedElementwise, Instr, run_fused

__all__ = ["DType", "L0Error", "OpAttrs", "OpDef", "all_ops", "define_op", "get_op",
           "BroadcastTo", "Cast", "Contiguous", "Fill", "RealDiv", "ReduceSum", "UnsqueezeNd",
           "ViewCopy", "SyncBatchNormBackwardElemt", "FusedAttrs", "FusedElementwise", "Instr", "run_fused", "cast_array", "elemt_backward"]
