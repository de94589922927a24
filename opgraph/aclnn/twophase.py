"""The two-phase aclnn machinery shared by every op_api: phase 1 records and compiles a graph on
an executor, phase 2 runs it on the current backend. Write a new op like this:

    >>> import numpy as np, l0ops, opgraph
    >>> @op_api("aclnnDemoCast")
    ... def demo_cast(ex, x, out):
    ...     check_not_null(x=x, out=out)
    ...     y = l0ops.Cast(ex, l0ops.Contiguous(ex, ex.input("x", x)), to=out.dtype)
    ...     ex.output(l0ops.ViewCopy(ex, y, ex.input("out", out)))
    >>> out = np.zeros(3, np.float16)
    >>> status, ws, ex = demo_cast(opgraph.tensor(np.float32([1, 2, 3])), opgraph.tensor(out))
    >>> run_executor(bytearray(ws) if ws else None, ws, ex), out.tolist()
    (<Status.ACLNN_SUCCESS: 0>, [1.0, 2.0, 3.0])

Phase 1 never raises for bad arguments: it returns ``(status, 0, None)`` and leaves the message
for :func:`aclGetRecentErrMsg`.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional

import numpy as np

from l0ops.registry import L0Error

from ..config import get_backend_name, get_opt_level
from ..executor import Executor
from ..platform import get_platform
from .cache import EXECUTOR_CACHE, CompiledOp, cache_key
from ..status import AclnnError, Status
from ..tensor import Tensor

_last_error = threading.local()


def aclGetRecentErrMsg() -> str:
    """The message of the last failed aclnn call in this thread ('' if none)."""
    err = recent_error()
    return str(err) if err else ""


def recent_error() -> "AclnnError | None":
    """The last failed aclnn call's error in this thread (None after a success)."""
    return getattr(_last_error, "err", None)


def _fail(status: Status, msg: str) -> Status:
    _last_error.err = AclnnError(status, msg)
    return status


def _succeed() -> Status:
    _last_error.err = None
    return Status.ACLNN_SUCCESS


def check_not_null(**tensors: Any) -> None:
    """161001 for the first argument that is None (NULL), in the order given."""
    for name, t in tensors.items():
        if t is None:
            raise AclnnError(Status.ACLNN_ERR_PARAM_NULLPTR, f"{name}: must not be NULL")
        if not isinstance(t, Tensor):
            raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                             f"{name}: expected an opgraph.Tensor, got {type(t).__name__}")


def record(name: str, compose: Callable[[Executor], None]) -> tuple[Status, int, Optional[Executor]]:
    """Phase 1: run ``compose(executor)`` (checks + l0 calls), then compile at the current level."""
    ex = Executor(name)
    try:
        with np.errstate(all="ignore"):  # IEEE results (inf, NaN) are defined; the NPU does not warn
            compose(ex)
            check_outputs_writable(ex)
            ex.compile(get_opt_level())
    except AclnnError as e:
        return _fail(e.status, e.message), 0, None
    except L0Error as e:
        return _fail(Status.ACLNN_ERR_INNER_NULLPTR, f"an l0 op returned NULL: {e}"), 0, None
    return _succeed(), ex.workspace_size, ex


def written_inputs(graph: Any) -> list[str]:
    """Names of the graph inputs (user tensors) some node writes: the op_api's outputs."""
    written = {n.inputs[k].name for n in graph.nodes for k in n.opdef.written(n)}
    return [v.name for v in graph.inputs if v.name in written]


def _unwritable_reason(t: Tensor) -> "str | None":
    if t.copied:
        return ("the array could not be wrapped without a copy (negative strides, strides that are "
                "not a multiple of the item size, or a dtype conversion), so the result would be "
                "lost; pass a writable view with non-negative strides in whole elements")
    if not t.storage.flags.writeable:
        return "storage is read-only"
    return None


def check_outputs_writable(ex: Executor) -> None:
    """161002 for an output phase 2 could not write where the caller sees it."""
    for name in written_inputs(ex.graph):
        t = ex.bindings[name]
        why = _unwritable_reason(t) if t.numel else None
        if why:
            raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID, f"{name}: {why}")


def op_api(name: str) -> Callable[[Callable[..., None]], Callable[..., tuple[Status, int, Optional[Executor]]]]:
    """Turn ``compose(ex, *args)`` into ``aclnnXxxGetWorkspaceSize(*args) -> (status, size, executor)``.

    Successful compilations are cached by argument metadata (see :mod:`.cache`): a second call
    with the same shapes, dtypes, strides, formats, NULL pattern, platform and level reuses the
    compiled plan and only rebinds the tensors."""
    def deco(compose: Callable[..., None]):
        @functools.wraps(compose)
        def get_workspace_size(*args: Any) -> tuple[Status, int, Optional[Executor]]:
            key = cache_key(name, args, get_platform(), get_opt_level())
            hit = EXECUTOR_CACHE.get(key) if key is not None else None
            if hit is not None:
                return _succeed(), hit.workspace_size, hit.instantiate(args)
            status, size, ex = record(name, lambda ex: compose(ex, *args))
            if ex is not None and key is not None:
                EXECUTOR_CACHE.put(key, CompiledOp.from_executor(ex, args))
            return status, size, ex
        get_workspace_size.op_name = name  # type: ignore[attr-defined]
        return get_workspace_size
    return deco


def _buffer_len(workspace: Any) -> int:
    try:
        mv = memoryview(workspace)
    except TypeError:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"workspace: expected a writable buffer, got {type(workspace).__name__}") from None
    if mv.readonly:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID, "workspace: buffer is read-only")
    return mv.nbytes


def check_runnable(workspace: Any, workspace_size: int, executor: Optional[Executor]) -> None:
    """The phase-2 argument checks (raise AclnnError)."""
    if executor is None:
        raise AclnnError(Status.ACLNN_ERR_PARAM_NULLPTR, "executor: must not be NULL")
    if not isinstance(executor, Executor):
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"executor: expected an Executor from phase 1, got {type(executor).__name__}")
    if executor.destroyed:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         "executor: already destroyed (aclDestroyAclOpExecutor)")
    if executor.runs and not executor.repeatable:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         "executor: already ran; phase 2 runs once per phase 1 unless "
                         "aclSetAclOpExecutorRepeatable was called right after phase 1")
    need = executor.workspace_size
    if isinstance(workspace_size, (bool, np.bool_)) or not isinstance(workspace_size, (int, np.integer)):
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"workspaceSize: expected an integer, got {type(workspace_size).__name__}")
    if workspace_size < 0:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID, f"workspaceSize: {workspace_size} is negative")
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


def run_executor(workspace: Any, workspace_size: int, executor: Optional[Executor],
                 stream: Any = None) -> Status:
    """Phase 2 (``CommonOpExecutorRun``): run the compiled graph on the current backend."""
    import backends
    try:
        check_runnable(workspace, workspace_size, executor)
        backend = backends.get(get_backend_name())
    except AclnnError as e:
        return _fail(e.status, e.message)
    except backends.BackendUnavailable as e:
        return _fail(Status.ACLNN_ERR_RUNTIME_ERROR, str(e))
    assert executor is not None
    executor.runs += 1
    if executor.compiled is not None and executor.compiled.nodes:
        try:
            with np.errstate(all="ignore"):  # IEEE results are defined; the NPU does not warn
                backend.run(executor.compiled, executor.bindings, workspace)
        except Exception as e:  # a backend failure is a runtime error, never a raw traceback
            return _fail(Status.ACLNN_ERR_RUNTIME_ERROR,
                         f"backend {backend.name!r} failed: {type(e).__name__}: {e}")
    return _succeed()


def aclSetAclOpExecutorRepeatable(executor: Optional[Executor]) -> Status:
    """Allow phase 2 to run this executor many times (call right after phase 1)."""
    if executor is None:
        return _fail(Status.ACLNN_ERR_INNER_NULLPTR, "executor: must not be NULL")
    if executor.runs or executor.destroyed:
        return _fail(Status.ACLNN_ERR_PARAM_INVALID,
                     "executor: aclSetAclOpExecutorRepeatable must be called right after phase 1")
    executor.repeatable = True
    return Status.ACLNN_SUCCESS


def aclDestroyAclOpExecutor(executor: Optional[Executor]) -> Status:
    """Free a repeatable executor; phase 2 on it is rejected afterwards."""
    if executor is None:
        return _fail(Status.ACLNN_ERR_INNER_NULLPTR, "executor: must not be NULL")
    executor.destroyed = True
    return Status.ACLNN_SUCCESS


def _set_addr(executor: Optional[Executor], names: list[str], index: int, t: Any, what: str) -> Status:
    if executor is None or t is None:
        return _fail(Status.ACLNN_ERR_INNER_NULLPTR, f"{what}: executor and tensor must not be NULL")
    if not isinstance(executor, Executor) or not isinstance(t, Tensor):
        return _fail(Status.ACLNN_ERR_PARAM_INVALID,
                     f"{what}: expected an Executor and an opgraph.Tensor, got "
                     f"{type(executor).__name__} and {type(t).__name__}")
    if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
        return _fail(Status.ACLNN_ERR_PARAM_INVALID, f"{what}: index must be an integer, got {index!r}")
    if not 0 <= index < len(names):
        return _fail(Status.ACLNN_ERR_PARAM_INVALID, f"{what}: index {index} out of range [0, {len(names)})")
    name = names[index]
    old = executor.bindings[name]
    if (old.shape, old.strides, old.dtype, old.format) != (t.shape, t.strides, t.dtype, t.format):
        return _fail(Status.ACLNN_ERR_PARAM_INVALID,
                     f"{what}: new tensor for %{name} must keep shape, strides, dtype and format")
    why = _unwritable_reason(t) if name in written_inputs(executor.graph) and t.numel else None
    if why:
        return _fail(Status.ACLNN_ERR_PARAM_INVALID, f"{what}: %{name}: {why}")
    executor.bindings[name] = t
    return Status.ACLNN_SUCCESS


def _io_names(executor: Executor, output: bool) -> list[str]:
    written = set(written_inputs(executor.graph))
    return [v.name for v in executor.graph.inputs if (v.name in written) == output]


def aclSetInputTensorAddr(executor: Optional[Executor], index: int, t: Tensor) -> Status:
    """Rebind input ``index`` (recorded order, NULL inputs skipped) to tensor ``t``'s memory."""
    return _set_addr(executor, _io_names(executor, False) if executor else [], index, t,
                     "aclSetInputTensorAddr")


def aclSetOutputTensorAddr(executor: Optional[Executor], index: int, t: Tensor) -> Status:
    """Rebind output ``index`` to tensor ``t``'s memory."""
    return _set_addr(executor, _io_names(executor, True) if executor else [], index, t,
                     "aclSetOutputTensorAddr")
