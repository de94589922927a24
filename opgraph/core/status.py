"""aclnnStatus codes and the Pythonic error that carries one.

    >>> int(Status.ACLNN_ERR_PARAM_NULLPTR)
    161001
    >>> str(AclnnError(Status.ACLNN_ERR_PARAM_INVALID, "input: rank 1 < 2"))
    'ACLNN_ERR_PARAM_INVALID (161002): input: rank 1 < 2'
"""
from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """aclnnStatus; names and numbers as in ops-nn docs/zh/context/aclnn_return_code.md."""

    ACLNN_SUCCESS = 0
    ACLNN_ERR_PARAM_NULLPTR = 161001
    ACLNN_ERR_PARAM_INVALID = 161002
    ACLNN_ERR_RUNTIME_ERROR = 361001
    ACLNN_ERR_INNER = 561000
    ACLNN_ERR_INNER_INFERSHAPE_ERROR = 561001
    ACLNN_ERR_INNER_TILING_ERROR = 561002
    ACLNN_ERR_INNER_FIND_KERNEL_ERROR = 561003
    ACLNN_ERR_INNER_CREATE_EXECUTOR = 561101
    ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR = 561102
    ACLNN_ERR_INNER_NULLPTR = 561103
    ACLNN_ERR_INNER_WRONG_ATTR_INFO_SIZE = 561104
    ACLNN_ERR_INNER_KEY_CONFLICT = 561105
    ACLNN_ERR_INNER_INVALID_IMPL_MODE = 561106
    ACLNN_ERR_INNER_OPP_PATH_NOT_FOUND = 561107
    ACLNN_ERR_INNER_LOAD_JSON_FAILED = 561108
    ACLNN_ERR_INNER_JSON_VALUE_NOT_FOUND = 561109
    ACLNN_ERR_INNER_JSON_FORMAT_INVALID = 561110
    ACLNN_ERR_INNER_JSON_DTYPE_INVALID = 561111
    ACLNN_ERR_INNER_OPP_KERNEL_PKG_NOT_FOUND = 561112
    ACLNN_ERR_INNER_OP_FILE_INVALID = 561113
    ACLNN_ERR_INNER_ATTR_NUM_OUT_OF_BOUND = 561114
    ACLNN_ERR_INNER_ATTR_LEN_NOT_ENOUGH = 561115
    ACLNN_ERR_INNER_INPUT_NUM_IN_JSON_TOO_LARGE = 561116
    ACLNN_ERR_INNER_INPUT_JSON_IS_NULL = 561117
    ACLNN_ERR_INNER_STATIC_WORKSPACE_INVALID = 561118
    ACLNN_ERR_INNER_STATIC_BLOCK_DIM_INVALID = 561119

    ACLNN_ERR_INNER_KEY_CONFILICT = 561105  # the vendor's old spelling (an alias)


class AclnnError(RuntimeError):
    """An aclnn call rejected its arguments: ``.status`` is the code, the message names the rule.
    A RuntimeError, as torch's kernels raise on bad input and opgraph's other errors are."""

    def __init__(self, status: Status, message: str):
        self.status = Status(status)
        self.message = message
        super().__init__(f"{self.status.name} ({int(self.status)}): {message}")

    def __str__(self) -> str:
        return self.args[0]
