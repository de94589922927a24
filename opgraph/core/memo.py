"""A bounded memo table: a dict of values made on first use that empties itself when full.

Lookups are plain ``dict.get`` (hot paths keep that speed); only a miss goes through
:meth:`BoundedMemo.put`, which holds the bound.

    >>> m = BoundedMemo(limit=2)
    >>> m.put("a", 1), m.put("b", 2), m.put("c", 3), sorted(m)
    (1, 2, 3, ['c'])
"""
from __future__ import annotations

from typing import Any, Hashable


class BoundedMemo(dict):
    """A dict holding at most ``limit`` entries: :meth:`put` empties it when it is full."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def put(self, key: Hashable, value: Any) -> Any:
        """Store ``value`` under ``key`` unless another thread stored one first; returns the
        value the table holds (emptying the table first when it is full)."""
        if len(self) >= self.limit:
            self.clear()
        return self.setdefault(key, value)


__all__ = ["BoundedMemo"]
