"""The aclnn C API, in Python: every registered op_api's two-phase pair and the executor meta
API. One module per op_api; importing this package registers the built-in ones.

    >>> from opgraph import aclnn
    >>> "aclnnBatchNormElemtBackward" in aclnn.op_apis()
    True
"""
from opgraph.core.opapi import get_op_api, op_api_specs, op_apis
from .twophase import aclGetRecentErrMsg, check_not_null, op_api, record, recent_error, run_executor
from .executor_api import (aclDestroyAclOpExecutor, aclSetAclOpExecutorRepeatable,
                           aclSetInputTensorAddr, aclSetOutputTensorAddr)
from . import (batch_norm_elemt, batch_norm_gather_stats_with_counts,  # noqa: F401  (register)
               batch_norm_reduce, batch_norm_reduce_backward, batch_norm_stats,
               sync_batch_norm_gather_stats)
from .batch_norm_elemt_backward import (aclnnBatchNormElemtBackward,
                                        aclnnBatchNormElemtBackwardGetWorkspaceSize)

__all__ = ["aclnnBatchNormElemtBackward", "aclnnBatchNormElemtBackwardGetWorkspaceSize",
           "aclDestroyAclOpExecutor", "aclGetRecentErrMsg", "aclSetAclOpExecutorRepeatable",
           "aclSetInputTensorAddr", "aclSetOutputTensorAddr", "check_not_null", "get_op_api",
           "op_api", "op_api_specs", "op_apis", "recent_error", "record", "run_executor"]
