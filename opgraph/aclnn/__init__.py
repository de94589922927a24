"""The aclnn C API, in Python: every registered op_api's two-phase pair and the executor meta
API. One module per op_api; importing this package registers the built-in ones.

    >>> from opgraph import aclnn
    >>> [n for n in aclnn.op_apis() if n.startswith("aclnnBatchNorm")][:3]
    ['aclnnBatchNormElemt', 'aclnnBatchNormElemtBackward', 'aclnnBatchNormGatherStatsWithCounts']
"""
from opgraph.core.opapi import get_op_api, op_api_specs, op_apis
from .twophase import aclGetRecentErrMsg, check_not_null, op_api, record, recent_error, run_executor
from .executor_api import (aclDestroyAclOpExecutor, aclSetAclOpExecutorRepeatable,
                           aclSetInputTensorAddr, aclSetOutputTensorAddr)
from .batch_norm_elemt import aclnnBatchNormElemt, aclnnBatchNormElemtGetWorkspaceSize
from .batch_norm_elemt_backward import (aclnnBatchNormElemtBackward,
                                        aclnnBatchNormElemtBackwardGetWorkspaceSize)
from .batch_norm_gather_stats_with_counts import (aclnnBatchNormGatherStatsWithCounts,
                                                  aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize)
from .batch_norm_reduce import aclnnBatchNormReduce, aclnnBatchNormReduceGetWorkspaceSize
from .batch_norm_reduce_backward import (aclnnBatchNormReduceBackward,
                                         aclnnBatchNormReduceBackwardGetWorkspaceSize)
from .batch_norm_stats import aclnnBatchNormStats, aclnnBatchNormStatsGetWorkspaceSize
from .sync_batch_norm_gather_stats import (aclnnSyncBatchNormGatherStats,
                                           aclnnSyncBatchNormGatherStatsGetWorkspaceSize)

__all__ = ["aclnnBatchNormElemt", "aclnnBatchNormElemtGetWorkspaceSize",
           "aclnnBatchNormElemtBackward", "aclnnBatchNormElemtBackwardGetWorkspaceSize",
           "aclnnBatchNormGatherStatsWithCounts", "aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize",
           "aclnnBatchNormReduce", "aclnnBatchNormReduceGetWorkspaceSize",
           "aclnnBatchNormReduceBackward", "aclnnBatchNormReduceBackwardGetWorkspaceSize",
           "aclnnBatchNormStats", "aclnnBatchNormStatsGetWorkspaceSize",
           "aclnnSyncBatchNormGatherStats", "aclnnSyncBatchNormGatherStatsGetWorkspaceSize",
           "aclDestroyAclOpExecutor", "aclGetRecentErrMsg", "aclSetAclOpExecutorRepeatable",
           "aclSetInputTensorAddr", "aclSetOutputTensorAddr", "check_not_null", "get_op_api",
           "op_api", "op_api_specs", "op_apis", "recent_error", "record", "run_executor"]
