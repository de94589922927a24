"""The two-phase aclnn machinery shared by every op_api: phase 1 checks the arguments, records a
graph on an executor and compiles it; phase 2 runs it on the current backend. A new op_api is one
module with one decorated compose function:

    >>> import numpy as np, opgraph
    >>> from l0ops.basic import Cast, Contiguous, ViewCopy
    >>> from opgraph.core.opapi import Param
    >>> @op_api("aclnnDemoCast", params=(Param("x", "tensor", "input"),
    ...                                  Param("out", "tensor", "output")))
    ... def demo_cast(ex, x, out):
    ...     check_not_null(x=x, out=out)
    ...     y = Cast(ex, Contiguous(ex, ex.input("x", x)), to=out.dtype)
    ...     ex.output(ViewCopy(ex, y, ex.input("out", out)))
    >>> out = np.zeros(3, np.float16)
    >>> status, ws, ex = demo_cast(opgraph.tensor(np.float32([1, 2, 3])), opgraph.tensor(out))
    >>> run_executor(bytearray(ws) if ws else None, ws, ex), out.tolist()
    (<Status.ACLNN_SUCCESS: 0>, [1.0, 2.0, 3.0])
    >>> import inspect; str(inspect.signature(demo_cast)).split(" ->")[0]   # not (ex, x, out)
    '(x, out)'

Phase 1 never raises for bad arguments: it returns ``(status, 0, None)`` and leaves the message
for :func:`aclGetRecentErrMsg`. The executor API (repeatable executors, rebinding addresses) is in
:mod:`opgraph.aclnn.executor_api`.
"""
from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Concatenate, Container, Mapping, Optional, ParamSpec, Sequence

import numpy as np

from opgraph.core import capturing
from opgraph.core.backend import BackendUnavailable, made
from opgraph.core.config import (compile_setting, current_backend, current_backend_ref, get_fast_math,
                                 get_opt_level)
from opgraph.core.executor import CompiledProgram, Executor
from opgraph.core.memory import plan_memory
from opgraph.core.opapi import OpApiSpec, Param, op_api_specs, register_op_api
from opgraph.core.opdef import L0Error
from opgraph.core.quiet import restore, silence
from opgraph.core.platform import get_platform
from opgraph.core.status import AclnnError, Status
from opgraph.core.tensor import Tensor, extent, overlaps_itself, same_view
from opgraph.core.types import RecordedCall
from opgraph.passes import fast_math_applied, optimize
from .phase2_checks import already_ran, check_runnable
from .cache import EXECUTOR_CACHE, CachedOp, cache_key, clear_all_caches, written_inputs
from .structure import STRUCTURE_CACHE, UNTEMPLATED, Template, build_template, structure_key

P = ParamSpec("P")
Phase1 = tuple[Status, int, Optional[Executor]]
_last_error = threading.local()


def aclGetRecentErrMsg() -> str:
    """The message of the last failed aclnn call in this thread ('' if none)."""
    err = recent_error()
    return str(err) if err else ""


def recent_error() -> "AclnnError | None":
    """The last failed aclnn call's error in this thread (None after a success)."""
    return getattr(_last_error, "err", None)


def fail(status: Status, msg: str) -> Status:
    """Record ``msg`` for aclGetRecentErrMsg and return ``status``."""
    _last_error.err = AclnnError(status, msg)
    return status


def succeed() -> Status:
    """ACLNN_SUCCESS, with this thread's recent error message cleared."""
    _last_error.err = None
    return Status.ACLNN_SUCCESS


def check_not_null(**tensors: Any) -> None:
    """161001 for the first argument that is None (NULL), in the order given."""
    for name, t in tensors.items():
        if t is None:
            raise AclnnError(Status.ACLNN_ERR_PARAM_NULLPTR, f"{name}: must not be NULL")


def unwritable_reason(t: Tensor) -> "str | None":
    """Why phase 2 could not write ``t`` where the caller sees it (None if it can)."""
    if t.copied:
        return ("the array could not be wrapped without a copy (negative strides, strides that are "
                "not a multiple of the item size, or a dtype conversion), so the result would be "
                "lost; pass a writable view with non-negative strides in whole elements")
    if not t.storage.flags.writeable:
        return "storage is read-only"
    if overlaps_itself(t):
        return ("its elements overlap in memory (a stride of 0 on a dimension longer than 1, or "
                "strides that interleave), so results would be lost; pass an array whose "
                "elements are apart")
    return None


def check_outputs_writable(ex: Executor) -> None:
    """161002 for an output phase 2 could not write where the caller sees it."""
    for name in written_inputs(ex.graph):
        t = ex.bindings[name]
        why = unwritable_reason(t) if t.numel else None
        if why:
            raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID, f"{name}: {why}")


MASK_TYPES = (bool, np.bool_)  # what a bool parameter (an output mask) takes


def wrong_kind(name: str, want: str, got: Any) -> AclnnError:
    """161002 for argument ``name`` that is not ``want`` (``"a bool"``, ``"a number"`` ...)."""
    return AclnnError(Status.ACLNN_ERR_PARAM_INVALID, f"{name}: expected {want}, got {type(got).__name__}")


def _check_kinds(params: Sequence[Param], args: Sequence[Any]) -> None:
    """Python-level argument types: a tensor parameter takes an opgraph.Tensor or None, a
    scalar a real number, a mask a bool (161002 naming the parameter)."""
    if len(args) != len(params):
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"expected {len(params)} arguments ({', '.join(p.name for p in params)}), "
                         f"got {len(args)}")
    for p, a in zip(params, args):
        if p.kind == "tensor":
            ok = a is None or isinstance(a, Tensor)
            want = "an opgraph.Tensor or None"
        elif p.kind == "bool":
            ok = isinstance(a, MASK_TYPES)
            want = "a bool"
        else:
            ok = isinstance(a, (int, float, np.integer, np.floating)) and not isinstance(a, (bool, np.bool_))
            want = "a number"
            if ok and isinstance(a, (int, np.integer)):
                _check_integer_range(p, int(a))
        if not ok:
            raise wrong_kind(p.name, want, a)


def _check_integer_range(p: Param, a: int) -> None:
    """161002 for an integer scalar its C type cannot hold: int64 for ``int``, a finite double
    for the floating kinds (``float(10**400)`` would raise OverflowError)."""
    if p.kind == "int":
        ok, c_type = -(1 << 63) <= a < (1 << 63), "int64_t"
    else:
        ok, c_type = abs(a) <= _DOUBLE_MAX, "double"
    if not ok:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"{p.name}: an integer of {a.bit_length()} bits does not fit in a {c_type}")


_DOUBLE_MAX = int(np.finfo(np.float64).max)  # the largest integer float() takes


def _positional(sig: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``args`` and ``kwargs`` as the positional arguments of ``sig`` (161002 naming an unknown,
    repeated or missing parameter)."""
    unknown = [k for k in kwargs if k not in sig.parameters]
    if unknown:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"{unknown[0]}: no such parameter (parameters: {', '.join(sig.parameters)})")
    try:
        return sig.bind(*args, **kwargs).args
    except TypeError as e:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID, str(e)) from None


def recorded_call(name: str, params: Sequence[Param], args: Sequence[Any]) -> RecordedCall:
    """The call as graph metadata: tensors by parameter name (None for NULL), scalars by value."""
    return RecordedCall(name, tuple(
        (p.name, p.kind, (None if a is None else p.name) if p.kind == "tensor"
         else (bool(a) if p.kind == "bool" else int(a) if p.kind == "int" else float(a)))
        for p, a in zip(params, args)))


def compile_executor(ex: Executor, level: int, fast_math: bool = False) -> None:
    """Optimise the recorded graph at ``level`` (with the opt-in fast-math rewrites if asked:
    the program says whether one applied) and plan its memory (the workspace size)."""
    stats: list = []
    compiled = (optimize(ex.graph, level, fast_math=fast_math, verify_each=False, stats=stats)
                if ex.graph.nodes else ex.graph)
    ex.program = CompiledProgram(ex.graph, compiled, plan_memory(compiled), level, ex.platform,
                                 fast_math=fast_math_applied(stats))


def record(name: str, compose: Callable[[Executor], None], call: Optional[RecordedCall] = None,
           as_recorded: bool = False) -> Phase1:
    """Phase 1: run ``compose(executor)`` (checks + l0 calls), then compile at the current level
    and fast-math setting (``as_recorded``: at level 0 without fast-math, whatever is set)."""
    ex = Executor(name, call=call)
    try:
        with np.errstate(all="ignore"):  # IEEE results (inf, NaN) are defined; the NPU does not warn
            compose(ex)
            check_outputs_writable(ex)
            if as_recorded:
                compile_executor(ex, 0)
            else:
                compile_executor(ex, get_opt_level(), get_fast_math())
    except AclnnError as e:
        return fail(e.status, e.message), 0, None
    except L0Error as e:
        return fail(Status.ACLNN_ERR_INNER_NULLPTR, f"an l0 op returned NULL: {e}"), 0, None
    return succeed(), ex.workspace_size, ex


def op_api(name: str, *, params: Sequence[Param], **spec: Any
           ) -> Callable[[Callable[Concatenate[Executor, P], None]], Callable[P, Phase1]]:
    """Register ``compose(ex, *args)`` as op_api ``name``; returns phase 1,
    ``aclnnXxxGetWorkspaceSize(*args) -> (status, workspace_size, executor)``.

    ``params`` lists the C prototype's parameters (workspaceSize/executor excluded) and must
    match compose's. ``spec`` holds the other :class:`OpApiSpec` fields (platforms, dtypes,
    make_inputs, reference, options, rank, aclnn_api, summary). Successful compilations are
    cached by argument metadata (:mod:`.cache`): a later call with the same shapes, dtypes,
    strides, formats, NULL pattern, scalars, platform and level only rebinds the tensors; a
    call with new sizes of a known structure (:mod:`.structure`) skips recording and passes.
    A name registered from another file needs ``replace=True`` (a reload of the same file does
    not); registering again empties the caches."""
    params = tuple(params)
    replace = bool(spec.pop("replace", False))

    def deco(compose: Callable[..., None]) -> Callable[..., Phase1]:
        sig = inspect.signature(compose)
        names = list(sig.parameters)[1:]
        public = sig.replace(parameters=list(sig.parameters.values())[1:], return_annotation=Phase1)
        if names != [p.name for p in params]:
            raise ValueError(f"op_api {name}: compose parameters {names} differ from the declared "
                             f"{[p.name for p in params]}")

        def get_workspace_size(*args: Any, **kwargs: Any) -> Phase1:
            if kwargs:  # by name, as the signature it advertises allows
                try:
                    args = _positional(public, args, kwargs)
                except AclnnError as e:
                    return fail(e.status, e.message), 0, None
            platform, level = get_platform(), compile_setting()
            shared = writes_shared_memory(args, written_at, read_at, in_place)
            key = cache_key(name, args, platform, level)
            if shared and key is not None:  # compiled as recorded: an entry of its own
                key += (SHARED_OUTPUTS,)
            hit = EXECUTOR_CACHE.get(key) if key is not None else None
            if hit is not None and hit.writable(args):  # the key fixes every argument's kind
                return _reused(hit, args)
            # a known structure fixes every argument's kind, as the key does
            skey, dims = structure_key(name, args, platform, level, key) if not shared else (None, ())
            template = STRUCTURE_CACHE.get(skey) if skey is not None else None
            if isinstance(template, Template):  # a new shape of a known structure
                hit = template.at(dims)
                EXECUTOR_CACHE.put(key, hit)
                if hit.writable(args):
                    return _reused(hit, args)
            try:
                _check_kinds(params, args)
            except AclnnError as e:
                return fail(e.status, e.message), 0, None
            status, size, ex = record_call(args, shared)
            if ex is not None and key is not None:
                EXECUTOR_CACHE.put(key, CachedOp.of(ex, args))
            if ex is not None and skey is not None and template is None:
                made = build_template(lambda probe: record_call(probe)[2], args, ex, dims)
                STRUCTURE_CACHE.put(skey, made or UNTEMPLATED)
                succeed()  # the probe's outcome is not the caller's
            return status, size, _captured(ex, args)

        def record_call(args: tuple, as_recorded: bool = False) -> Phase1:
            return record(name, lambda ex: compose(ex, *args), recorded_call(name, params, args),
                          as_recorded)

        written_at = tuple(i for i, p in enumerate(params)
                           if p.kind == "tensor" and p.role in ("output", "inout"))
        read_at = tuple(i for i, p in enumerate(params) if p.kind == "tensor" and p.role == "input")
        in_place = bool(spec.get("in_place"))

        get_workspace_size.__name__ = get_workspace_size.__qualname__ = compose.__name__
        get_workspace_size.__doc__ = compose.__doc__
        get_workspace_size.__module__ = compose.__module__
        get_workspace_size.__signature__ = public  # type: ignore[attr-defined]
        get_workspace_size.op_name = name  # type: ignore[attr-defined]
        get_workspace_size.source_file = compose.__code__.co_filename  # type: ignore[attr-defined]
        made = OpApiSpec(name, params, get_workspace_size, run_executor, **spec)
        before = op_api_specs().get(name)
        if before is not None:  # the same file again (a reload), or replace=True
            where = getattr(before.get_workspace_size, "source_file", "?")
            if not replace and where != compose.__code__.co_filename:
                raise ValueError(f"op_api {name!r} is already registered (from {where}); pass "
                                 "replace=True to op_api() to replace it")
            clear_all_caches()  # what they hold was compiled from the one replaced
        get_workspace_size.spec = register_op_api(made, replace=True)  # type: ignore[attr-defined]
        return get_workspace_size
    return deco


SHARED_OUTPUTS = "writes share memory"  # the cache-key part of a call compiled as recorded


def writes_shared_memory(args: tuple, written_at: Sequence[int], read_at: Sequence[int] = (),
                         in_place: bool = False) -> bool:
    """Whether a tensor at positions ``written_at`` (the outputs and in-out tensors) shares
    memory with another of them or with a tensor at ``read_at`` (the inputs), other than an
    ``in_place`` op_api's output that is the very view of an input. Such a call is compiled as
    recorded (level 0) at any level: the recorded order of the writes and reads decides what
    the memory ends up holding and what is read, and the passes move them (a redirected copy
    writes when its producer runs; a fused kernel stores its results in its own order and
    reads its inputs chunk by chunk) — the levels then disagree.

        >>> import numpy as np, opgraph
        >>> a = np.zeros(4, np.float32)
        >>> writes_shared_memory((opgraph.tensor(a), opgraph.tensor(a)), (0, 1))
        True
        >>> writes_shared_memory((opgraph.tensor(a), opgraph.tensor(a)), (1,), (0,), in_place=True)
        False
    """
    if len(args) <= max(written_at[-1] if written_at else 0, read_at[-1] if read_at else 0):
        return False  # a short call fails its kinds check
    spans: list[tuple[Tensor, int, int]] = []  # the written tensors' byte ranges
    for i in written_at:
        w = args[i]
        if isinstance(w, Tensor):
            lo, hi = extent(w)
            if lo < hi:  # (an empty tensor, lo == hi, intersects nothing)
                for _, vlo, vhi in spans:
                    if vlo < hi and lo < vhi:
                        return True
                spans.append((w, lo, hi))
    for w, wlo, whi in spans:
        for i in read_at:
            r = args[i]
            if isinstance(r, Tensor):
                lo, hi = extent(r)
                if wlo < hi and lo < whi and lo < hi and not (in_place and same_view(w, r)):
                    return True
    return False


def memory_partner(tensors: Mapping[str, Tensor], written: Container[str], name: str,
                   in_place: bool = False) -> Optional[str]:
    """The first other name in ``tensors`` whose tensor shares memory with ``name``'s where
    either is ``written`` — :func:`writes_shared_memory`'s rule, naming the clash; None if none.

        >>> import numpy as np, opgraph
        >>> a = np.zeros(4, np.float32)
        >>> ts = {"x": opgraph.tensor(a), "y": opgraph.tensor(a[2:]), "z": opgraph.tensor(a)}
        >>> memory_partner(ts, {"y"}, "x"), memory_partner(ts, set(), "x")
        ('y', None)
    """
    t = tensors[name]
    lo, hi = extent(t)
    if lo == hi:  # (an empty tensor shares nothing)
        return None
    for other, u in tensors.items():
        if other == name or not (name in written or other in written):
            continue
        olo, ohi = extent(u)
        if olo < hi and lo < ohi and not (in_place and (name in written) != (other in written)
                                          and same_view(t, u)):
            return other
    return None


def _reused(hit: CachedOp, args: tuple) -> Phase1:
    """Phase 1 answered from a cache: a fresh executor over ``hit``'s program, bound to ``args``."""
    return succeed(), hit.program.workspace_size, _captured(hit.instantiate(args), args)


def _captured(ex: Optional[Executor], args: Sequence[Any]) -> Optional[Executor]:
    """Report a successful phase 1 to the active capture, if any (:mod:`opgraph.core.capturing`)."""
    recorder = capturing.active()
    if recorder is not None and ex is not None:
        recorder.on_phase1(ex, args)
    return ex


# --- phase 2 -----------------------------------------------------------------------------------
_CLAIM = threading.Lock()  # a run is claimed at once: checked and counted under it


def run_executor(workspace: Any, workspace_size: int, executor: Optional[Executor],
                 stream: Any = None) -> Status:
    """Phase 2 (``CommonOpExecutorRun``): run the compiled program on the current backend, with
    the caller's ``workspace`` as the arena the memory plan lays out. A backend that has built
    this program's executable, or one this program's can be derived from (a structure's other
    sizes: :meth:`~opgraph.core.executor.CompiledProgram.known_executable`), runs it without
    asking again whether it is available."""
    try:
        check_runnable(workspace, workspace_size, executor)
        assert executor is not None and executor.program is not None
        program = executor.program
        backend = made(current_backend_ref())
        exe = program.known_executable(backend)
        if exe is None:
            backend = current_backend()
    except AclnnError as e:
        return fail(e.status, e.message)
    except BackendUnavailable as e:
        return fail(Status.ACLNN_ERR_RUNTIME_ERROR, str(e))
    with _CLAIM:  # another thread may have run this executor since the check above
        if executor.runs and not executor.repeatable:
            e = already_ran()
            return fail(e.status, e.message)
        executor.runs += 1
    recorder = capturing.active()
    if recorder is not None and recorder.on_phase2(executor):
        return succeed()  # deferred: the capture runs it as part of its program
    if program.compiled.nodes:
        ws = None if not program.workspace_size else workspace
        try:
            if exe is None:
                exe = program.executable(backend)
            # a repeatable executor runs its tensors again and again: the backend may bind to them
            run = exe.run_repeatable if executor.repeatable else exe.run
            if exe.quiet:
                run(executor.bindings, ws)
            else:  # IEEE results are defined; the NPU does not warn
                token = silence()
                try:
                    run(executor.bindings, ws)
                finally:
                    restore(token)
        except Exception as e:  # a backend failure is a runtime error, never a raw traceback
            return fail(Status.ACLNN_ERR_RUNTIME_ERROR,
                        f"backend {backend.name!r} failed: {type(e).__name__}: {e}")
    return succeed()
