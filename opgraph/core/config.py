"""Run-time choices that phase 1/2 read: the backend, the optimisation level and the opt-in,
NOT bit-exact fast-math rewrites (context vars).

    >>> with use_backend("numpy"), opt_level(1):
    ...     get_backend_name(), get_opt_level(), compile_setting()
    ('numpy', 1, 1)
    >>> with fast_math():
    ...     get_fast_math(), compile_setting()
    (True, (2, 'fast-math'))
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import Iterator, Union

from .backend import Backend, get

DEFAULT_BACKEND = "numpy"
DEFAULT_OPT_LEVEL = 2
OPT_LEVELS = (0, 1, 2)  # 0 as recorded, 1 what CANN launches, 2 fused

BackendRef = Union[str, Backend]
_backend: contextvars.ContextVar[BackendRef] = contextvars.ContextVar("opgraph_backend",
                                                                     default=DEFAULT_BACKEND)
_level: contextvars.ContextVar[int] = contextvars.ContextVar("opgraph_opt_level", default=DEFAULT_OPT_LEVEL)
_fast_math: contextvars.ContextVar[bool] = contextvars.ContextVar("opgraph_fast_math", default=False)


def _check_backend(ref: BackendRef) -> BackendRef:
    get(ref)  # raises BackendUnavailable with one clear line
    return ref


def get_backend_name() -> str:
    """The name of the backend phase 2 runs on."""
    ref = _backend.get()
    return ref if isinstance(ref, str) else ref.name


def current_backend_ref() -> BackendRef:
    """What phase 2 runs on, as set: a backend name or a Backend instance."""
    return _backend.get()


def current_backend() -> Backend:
    """The backend phase 2 runs on (BackendUnavailable if it cannot run here)."""
    return get(_backend.get())


def set_backend(backend: BackendRef) -> None:
    """Run phase 2 on ``backend`` (a registered name or a Backend instance) from now on."""
    _backend.set(_check_backend(backend))


class use_backend(contextlib.ContextDecorator):
    """``with opgraph.use_backend("native"): ...`` runs phase 2 there inside the block; an
    instance works too (``use_backend(MyBackend())``), and so does decorating a function. (A
    class, not a generator: entering and leaving cost a third as much, and SyncBatchNorm enters
    one per step.)"""

    __slots__ = ("backend", "_token")

    def __init__(self, backend: BackendRef) -> None:
        self.backend = backend

    def _recreate_cm(self) -> "use_backend":  # each decorated call enters its own
        return use_backend(self.backend)

    def __enter__(self) -> BackendRef:
        self._token = _backend.set(_check_backend(self.backend))
        return self.backend

    def __exit__(self, *exc: object) -> None:
        _backend.reset(self._token)


def check_level(n: int) -> int:
    """``n`` if it is an opt level, else ValueError naming the levels."""
    if isinstance(n, bool) or n not in OPT_LEVELS:
        raise ValueError(f"opt level must be one of {OPT_LEVELS}, got {n!r}")
    return int(n)


def get_opt_level() -> int:
    """The level phase 1 compiles at in this context: 0, 1 or 2 (default 2, fused)."""
    return _level.get()


def set_opt_level(n: int) -> None:
    """Compile phase 1 at level ``n``: 0 as recorded, 1 what CANN launches, 2 fused."""
    _level.set(check_level(n))


@contextlib.contextmanager
def opt_level(n: int) -> Iterator[int]:
    """``with opgraph.opt_level(n): ...`` compiles the op_api calls of the block at level ``n``
    (ValueError unless 0, 1 or 2); the level before it comes back on leaving.

        >>> with opt_level(1):
        ...     with opt_level(0):
        ...         inner = get_opt_level()
        ...     inner, get_opt_level()
        (0, 1)
    """
    token = _level.set(check_level(n))
    try:
        yield n
    finally:
        _level.reset(token)


def get_fast_math() -> bool:
    """Whether phase 1 adds the opt-in fast-math rewrites (off unless asked for)."""
    return _fast_math.get()


def set_fast_math(on: bool) -> None:
    """From now on compile phase 1 with (``True``) or without the fast-math rewrites: NOT
    bit-exact, each rule states its error bound (:mod:`opgraph.passes.fastmath`)."""
    _fast_math.set(_check_flag(on))


@contextlib.contextmanager
def fast_math(on: bool = True) -> Iterator[bool]:
    """``with opgraph.fast_math(): ...`` compiles the op_api calls of the block at level 2 (the
    default; levels 0 and 1 stay as recorded and what CANN launches) with the opt-in, NOT
    bit-exact fast-math rewrites (e.g. aclnnBatchNormElemtBackward's per-channel affine form,
    which computes float16 and bfloat16 in float32 and rounds once); ``fast_math(False)`` turns
    them off inside a block where they are on. The caches key calls by it. A context variable,
    as the level and the backend are: threads started inside do not inherit it."""
    token = _fast_math.set(_check_flag(on))
    try:
        yield on
    finally:
        _fast_math.reset(token)


def _check_flag(on: bool) -> bool:
    if not isinstance(on, bool):
        raise TypeError(f"fast_math takes True or False, got {on!r}")
    return on


def compile_setting() -> Union[int, tuple[int, str]]:
    """What phase 1's passes depend on besides the call, as a cache key part: the opt level,
    or ``(2, "fast-math")`` when the fast-math rewrites are on at level 2 (the only level they
    join)."""
    level = _level.get()
    return (level, "fast-math") if level == 2 and _fast_math.get() else level


def env_number(name: str, default: float, unit: str) -> float:
    """``$name`` as a finite number >= 0 (``default`` when unset or blank); ValueError naming
    the variable and ``unit`` otherwise.

        >>> env_number("OPGRAPH_NO_SUCH_VARIABLE", 2.5, "µs")
        2.5
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a number of {unit} >= 0, got {text!r}")
    return value


def default_threads() -> int:
    """Threads a backend's parallel work uses unless told otherwise: ``$OPGRAPH_NUM_THREADS``,
    else the CPUs this process may use (ValueError naming the variable for a bad value).

        >>> default_threads() >= 1
        True
    """
    text = os.environ.get("OPGRAPH_NUM_THREADS", "").strip()
    if text:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"OPGRAPH_NUM_THREADS must be an integer >= 1, got {text!r}")
        return n
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
