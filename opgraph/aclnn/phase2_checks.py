"""Phase 2's argument checks (``CommonOpExecutorRun``'s): the executor one from phase 1, not
destroyed, not run before unless repeatable; the workspace size an integer a ``uint64_t`` holds
and at least what phase 1 reported; the workspace a writable contiguous buffer of plain bytes
sharing no byte with the call's tensors. Each failure is an AclnnError naming the argument.

    >>> check_runnable(None, 0, None)
    Traceback (most recent call last):
    opgraph.core.status.AclnnError: ACLNN_ERR_PARAM_NULLPTR (161001): executor: must not be NULL
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import numpy as np

from opgraph.core.executor import Executor
from opgraph.core.status import AclnnError, Status
from opgraph.core.tensor import Tensor, array_address, extent

_FIELD_NAMES = re.compile(r":[^:]*:")  # the names in a PEP 3118 struct format: "T{O:a:f:b:}"


def _buffer_len(workspace: Any) -> int:
    try:
        mv = memoryview(workspace)
    except (TypeError, ValueError):  # (ValueError: numpy's datetime64 arrays export no buffer)
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"workspace: expected a writable buffer, got {type(workspace).__name__}") from None
    fmt = mv.format
    if "O" in fmt and "O" in _FIELD_NAMES.sub("", fmt):  # a run would overwrite the references
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         "workspace: the buffer holds Python object references (an object array); "
                         "a workspace is plain bytes (a bytearray or a numeric array)")
    if mv.readonly:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID, "workspace: buffer is read-only")
    if not mv.c_contiguous:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         "workspace: buffer is not contiguous; a workspace is one block of bytes "
                         "(a bytearray or a C-contiguous array)")
    return mv.nbytes


def already_ran() -> AclnnError:
    """161002 for a second phase 2 on an executor not made repeatable."""
    return AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                      "executor: already ran; phase 2 runs once per phase 1 unless "
                      "aclSetAclOpExecutorRepeatable was called right after phase 1")


_UINT64_MAX = (1 << 64) - 1


def check_runnable(workspace: Any, workspace_size: Any, executor: Optional[Executor]) -> None:
    """The phase-2 argument checks (raise AclnnError)."""
    if executor is None:
        raise AclnnError(Status.ACLNN_ERR_PARAM_NULLPTR, "executor: must not be NULL")
    if not isinstance(executor, Executor) or executor.program is None:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"executor: expected an Executor from phase 1, got {type(executor).__name__}")
    if executor.destroyed:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         "executor: already destroyed (aclDestroyAclOpExecutor)")
    if executor.runs and not executor.repeatable:  # (a single-use executor)
        raise already_ran()
    need = executor.workspace_size
    if isinstance(workspace_size, (bool, np.bool_)) or not isinstance(workspace_size, (int, np.integer)):
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"workspaceSize: expected an integer, got {type(workspace_size).__name__}")
    if workspace_size < 0:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID, f"workspaceSize: {workspace_size} is negative")
    if workspace_size > _UINT64_MAX:  # phase 1's rule for integers: what the C type holds
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"workspaceSize: an integer of {int(workspace_size).bit_length()} bits does "
                         "not fit in a uint64_t")
    if workspace_size < need:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"workspaceSize: {workspace_size} is smaller than the {need} bytes phase 1 reported")
    if need > 0:
        if workspace is None:
            raise AclnnError(Status.ACLNN_ERR_PARAM_NULLPTR,
                             f"workspace: NULL but phase 1 reported {need} bytes")
        have = _buffer_len(workspace)
        if have < need:
            raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                             f"workspace: buffer holds {have} bytes, phase 1 reported {need}")
        _check_apart(workspace, need, executor.bindings)


def _check_apart(workspace: Any, need: int, bindings: Mapping[str, Optional[Tensor]]) -> None:
    """The workspace's first ``need`` bytes (the run's scratch) share no byte with a tensor of
    the call: the run would overwrite an input or output (AclnnError naming it)."""
    lo = array_address(np.frombuffer(workspace, np.uint8, need))
    hi = lo + need
    for name, t in bindings.items():
        if t is not None:
            tlo, thi = extent(t)
            if tlo < hi and lo < thi and tlo < thi:  # (an empty tensor spans no byte)
                raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                                 f"workspace: shares memory with {name}, which the run's scratch "
                                 "would overwrite; a workspace is a buffer of its own")


__all__ = ["already_ran", "check_runnable"]
