"""A test helper: the native backend's FusedReduce thresholds, all set at once.

:meth:`backends.native.NativeBackend.limits` reads three class attributes; a test that wants
the reduction passes at any size (0) or the serial call for every size sets them all, and a
fourth threshold added to the backend fails here rather than going unset in the tests.

    >>> import pytest
    >>> mp = pytest.MonkeyPatch()
    >>> reduce_limits_at(mp, 0)
    >>> NativeBackend().limits()
    (0, 0, 0)
    >>> mp.undo()
"""
from __future__ import annotations

from typing import Any

from backends.native import NativeBackend

REDUCE_LIMITS = ("min_elements", "min_short_elements", "min_stepped_elements")


def reduce_limits_at(monkeypatch: Any, value: int) -> None:
    """Every FusedReduce threshold of :class:`NativeBackend` at ``value`` for this test (0: the
    reduction passes at any size, the serial call for none)."""
    for name in REDUCE_LIMITS:
        monkeypatch.setattr(NativeBackend, name, value)
    assert NativeBackend().limits() == (value,) * len(REDUCE_LIMITS), "a threshold left unset"
