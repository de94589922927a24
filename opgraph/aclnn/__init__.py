"""The aclnn C API, in Python: two-phase op_apis and the executor meta API.

    >>> from opgraph import aclnn
    >>> callable(aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize)
    True
"""
from .batch_norm_elemt_backward import (aclnnBatchNormElemtBackward,
                                        aclnnBatchNormElemtBackwardGetWorkspaceSize)
from .twophase import (aclDestroyAclOpExecutor, aclGetRecentErrMsg, aclSetAclOpExecutorRepeatable,
                       aclSetInputTensorAddr, aclSetOutputTensorAddr, check_not_null, op_api, record,
                       run_executor)

__all__ = ["aclnnBatchNormElemtBackward", "aclnnBatchNormElemtBackwardGetWorkspaceSize",
           "aclDestroyAclOpExecutor", "aclGetRecentErrMsg", "aclSetAclOpExecutorRepeatable",
           "aclSetInputTensorAddr", "aclSetOutputTensorAddr", "check_not_null", "op_api", "record",
           "run_executor"]
