"""The aclOpExecutor meta API: repeatable executors and rebinding tensor addresses
(opbase aclSetAclOpExecutorRepeatable / aclDestroyAclOpExecutor / aclSetInputTensorAddr /
aclSetOutputTensorAddr).

    >>> import numpy as np, opgraph
    >>> from opgraph.aclnn import aclnnBatchNormElemtBackwardGetWorkspaceSize as phase1
    >>> t = lambda a: opgraph.tensor(np.asarray(a, np.float32))
    >>> x, c = np.ones((2, 3), np.float32), np.ones(3, np.float32)
    >>> _, ws, ex = phase1(t(x), t(x), t(c), t(c), t(c), t(c), t(c), t(c), t(np.zeros((2, 3))))
    >>> aclSetAclOpExecutorRepeatable(ex), aclSetInputTensorAddr(ex, 0, t(2 * x))
    (<Status.ACLNN_SUCCESS: 0>, <Status.ACLNN_SUCCESS: 0>)
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from opgraph.core.executor import Executor
from opgraph.core.opapi import op_api_specs
from opgraph.core.status import Status
from opgraph.core.tensor import Tensor
from .twophase import (fail, memory_partner, succeed, unwritable_reason, writes_shared_memory,
                       written_inputs)


def _bad_executor(executor: Any) -> Optional[Status]:
    """The failure status for a NULL or non-Executor argument, else None."""
    if executor is None:
        return fail(Status.ACLNN_ERR_INNER_NULLPTR, "executor: must not be NULL")
    if not isinstance(executor, Executor):
        return fail(Status.ACLNN_ERR_PARAM_INVALID,
                    f"executor: expected an Executor, got {type(executor).__name__}")
    return None


def aclSetAclOpExecutorRepeatable(executor: Optional[Executor]) -> Status:
    """Allow phase 2 to run this executor many times (call right after phase 1)."""
    bad = _bad_executor(executor)
    if bad is not None:
        return bad
    if executor.runs or executor.destroyed:
        return fail(Status.ACLNN_ERR_PARAM_INVALID,
                    "executor: aclSetAclOpExecutorRepeatable must be called right after phase 1")
    executor.repeatable = True
    return succeed()


def aclDestroyAclOpExecutor(executor: Optional[Executor]) -> Status:
    """Free a repeatable executor; phase 2 on it is rejected afterwards."""
    bad = _bad_executor(executor)
    if bad is not None:
        return bad
    executor.destroyed = True
    if executor.program is not None:  # its tensors are not held on for repeated runs
        executor.program.release(executor.bindings)
    return succeed()


def _io_names(executor: Executor, output: bool) -> list[str]:
    written = set(written_inputs(executor.graph))
    return [v.name for v in executor.graph.inputs if (v.name in written) == output]


def _set_addr(executor: Any, output: bool, index: Any, t: Any, what: str) -> Status:
    if executor is None or t is None:
        return fail(Status.ACLNN_ERR_INNER_NULLPTR, f"{what}: executor and tensor must not be NULL")
    if not isinstance(executor, Executor) or not isinstance(t, Tensor):
        return fail(Status.ACLNN_ERR_PARAM_INVALID,
                    f"{what}: expected an Executor and an opgraph.Tensor, got "
                    f"{type(executor).__name__} and {type(t).__name__}")
    if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
        return fail(Status.ACLNN_ERR_PARAM_INVALID, f"{what}: index must be an integer, got {index!r}")
    names = _io_names(executor, output)
    if not 0 <= index < len(names):
        return fail(Status.ACLNN_ERR_PARAM_INVALID, f"{what}: index {index} out of range [0, {len(names)})")
    name = names[index]
    old = executor.bindings[name]
    if (old.shape, old.strides, old.dtype, old.format) != (t.shape, t.strides, t.dtype, t.format):
        return fail(Status.ACLNN_ERR_PARAM_INVALID,
                    f"{what}: new tensor for %{name} must keep shape, strides, dtype and format")
    why = unwritable_reason(t) if output and t.numel else None
    if why:
        return fail(Status.ACLNN_ERR_PARAM_INVALID, f"{what}: %{name}: {why}")
    bindings = {**executor.bindings, name: t}
    if executor.program is not None and executor.program.opt_level != 0:
        shared = _sharing(executor, bindings, name)
        if shared:  # the program was optimised for writes apart (see writes_shared_memory)
            return fail(Status.ACLNN_ERR_PARAM_INVALID,
                        f"{what}: %{name} would share memory with {shared}: a call that writes "
                        "over another argument's memory is compiled as recorded, so phase 1 must "
                        "see it")
    executor.bindings = bindings
    return succeed()


def _sharing(executor: Executor, bindings: dict[str, Tensor], name: str) -> Optional[str]:
    """The argument that input or output ``name`` would share memory with under ``bindings``
    by :func:`~.twophase.writes_shared_memory`'s rule (None if none)."""
    written = set(written_inputs(executor.graph))
    names = [v.name for v in executor.graph.inputs]
    args = tuple(bindings[n] for n in names)
    written_at = tuple(i for i, n in enumerate(names) if n in written)
    read_at = tuple(i for i, n in enumerate(names) if n not in written)
    spec = op_api_specs().get(executor.name)  # (an executor made outside a registered op_api: none)
    in_place = spec is not None and spec.in_place
    if not writes_shared_memory(args, written_at, read_at, in_place):
        return None
    other = memory_partner({n: bindings[n] for n in names}, written, name, in_place)
    return f"%{other}" if other else "another argument"


def aclSetInputTensorAddr(executor: Optional[Executor], index: int, t: Tensor) -> Status:
    """Rebind input ``index`` (recorded order, NULL inputs skipped) to tensor ``t``'s memory."""
    return _set_addr(executor, False, index, t, "aclSetInputTensorAddr")


def aclSetOutputTensorAddr(executor: Optional[Executor], index: int, t: Tensor) -> Status:
    """Rebind output ``index`` to tensor ``t``'s memory."""
    return _set_addr(executor, True, index, t, "aclSetOutputTensorAddr")
