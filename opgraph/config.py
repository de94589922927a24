"""Run-time choices that phase 1/2 read: the backend and the optimisation level (context vars).

    >>> with use_backend("numpy"), opt_level(1):
    ...     get_backend_name(), get_opt_level()
    ('numpy', 1)
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

DEFAULT_BACKEND = "numpy"
DEFAULT_OPT_LEVEL = 2
OPT_LEVELS = (0, 1, 2)

_backend: contextvars.ContextVar[str] = contextvars.ContextVar("opgraph_backend", default=DEFAULT_BACKEND)
_level: contextvars.ContextVar[int] = contextvars.ContextVar("opgraph_opt_level", default=DEFAULT_OPT_LEVEL)


def _check_backend(name: str) -> str:
    import backends
    backends.get(name)  # raises BackendUnavailable with one clear line
    return name


def get_backend_name() -> str:
    return _backend.get()


def set_backend(name: str) -> None:
    """Run phase 2 on backend ``name`` from now on (this thread/context)."""
    _backend.set(_check_backend(name))


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """``with opgraph.use_backend("native"): ...`` runs phase 2 there inside the block."""
    token = _backend.set(_check_backend(name))
    try:
        yield name
    finally:
        _backend.reset(token)


def _check_level(n: int) -> int:
    if n not in OPT_LEVELS:
        raise ValueError(f"opt level must be one of {OPT_LEVELS}, got {n!r}")
    return int(n)


def get_opt_level() -> int:
    return _level.get()


def set_opt_level(n: int) -> None:
    """Compile phase 1 at level ``n``: 0 as recorded, 1 what CANN launches, 2 fused."""
    _level.set(_check_level(n))


@contextlib.contextmanager
def opt_level(n: int) -> Iterator[int]:
    token = _level.set(_check_level(n))
    try:
        yield n
    finally:
        _level.reset(token)
