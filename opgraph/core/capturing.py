"""The capture hook: while a recorder is active in this context, the two-phase machinery reports
every successful phase 1 to it and asks it whether to defer phase 2. :mod:`opgraph.capture`
is the recorder; this module only holds the context variable, so that the op_api layer needs
no import from above it.

    >>> class Log:
    ...     def __init__(self): self.calls = []
    ...     def on_phase1(self, executor, args): self.calls.append(executor)
    ...     def on_phase2(self, executor): return True
    >>> log = Log()
    >>> with recording(log):
    ...     active() is log
    True
    >>> active() is None
    True
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional, Protocol, Sequence


class CallRecorder(Protocol):
    """What phase 1 and phase 2 tell an active recorder."""

    def on_phase1(self, executor: Any, args: Sequence[Any]) -> None:
        """A phase 1 succeeded: ``executor`` holds the recorded graph and its bindings."""

    def on_phase2(self, executor: Any) -> bool:
        """Phase 2 of ``executor`` was called: True when the recorder defers it (nothing runs)."""


class CaptureError(RuntimeError):
    """A sequence of calls the capture cannot turn into one program (the message says why)."""


_active: contextvars.ContextVar[Optional[CallRecorder]] = contextvars.ContextVar(
    "opgraph_capture", default=None)


def active() -> Optional[CallRecorder]:
    """The recorder of the current context (None when nothing is being captured)."""
    return _active.get()


@contextlib.contextmanager
def recording(recorder: CallRecorder) -> Iterator[CallRecorder]:
    """Make ``recorder`` the active one inside the block (nested captures are refused)."""
    if _active.get() is not None:
        raise CaptureError("a capture is already active in this context (captures do not nest)")
    token = _active.set(recorder)
    try:
        yield recorder
    finally:
        _active.reset(token)


__all__ = ["CallRecorder", "CaptureError", "active", "recording"]
