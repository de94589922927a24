"""The executor cache: phase 1 with the same argument metadata reuses the compiled program.

The key holds, per argument, the tensor metadata (shape, strides, dtype, format, writable) or
None for a NULL, scalars by value, the aliasing pattern of the arguments, the platform and the
opt level — everything phase 1 depends on except data pointers. Bounded (LRU, 256 entries by
default; the least recently used entry is evicted) and thread-safe.

    >>> import numpy as np, opgraph
    >>> t = opgraph.tensor(np.zeros((2, 3), np.float32))
    >>> cache_key("op", (t, None), opgraph.get_platform(), 2)[1]
    (('T', ((2, 3), (3, 1), 0, 2), True), None)
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

from opgraph.core.executor import CompiledProgram, Executor
from opgraph.core.tensor import Tensor


TensorMeta = Callable[[Tensor], Optional[Hashable]]


def call_key(name: str, args: tuple, platform: Any, level: int, meta: TensorMeta) -> Optional[tuple]:
    """``(name, per-argument metadata, aliasing, platform, level)`` with ``meta(tensor)`` for
    each tensor (None from it, or an argument that is neither a tensor nor a number: no key)."""
    metas: list[Optional[Hashable]] = []
    first: dict[int, int] = {}
    alias = []
    for i, a in enumerate(args):
        if a is None:
            metas.append(None)
            alias.append(i)
            continue
        if isinstance(a, Tensor):
            m = meta(a)
            if m is None:
                return None
            metas.append(m)
        elif isinstance(a, (int, float, bool)):
            metas.append(("V", type(a).__name__, a))
        else:
            return None  # uncacheable argument
        alias.append(first.setdefault(id(a), i))
    return (name, tuple(metas), tuple(alias), platform, level)


def _exact(t: Tensor) -> Hashable:
    # writability is part of it: phase 1 rejects an output it could not write
    return ("T", t.signature, t.storage.flags.writeable and not t.copied)


def cache_key(name: str, args: tuple, platform: Any, level: int) -> Optional[tuple]:
    """The cache key, or None when an argument cannot be keyed (then nothing is cached)."""
    return call_key(name, args, platform, level, _exact)


@dataclass(frozen=True)
class CachedOp:
    """What a cache hit reuses: the compiled program and which argument position binds each
    graph input."""

    program: CompiledProgram
    positions: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, ex: Executor, args: tuple) -> "CachedOp":
        pos = tuple((name, next(i for i, a in enumerate(args) if a is t))
                    for name, t in ex.bindings.items())
        assert ex.program is not None
        return cls(ex.program, pos)

    def instantiate(self, args: tuple) -> Executor:
        """A fresh single-use executor over the shared program, bound to ``args``."""
        return Executor.of_program(self.program, {name: args[i] for name, i in self.positions})


class ExecutorCache:
    """A bounded LRU map from cache keys to CachedOp, safe under threads."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._items: "OrderedDict[tuple, CachedOp]" = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: tuple) -> Optional[CachedOp]:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item

    def put(self, key: tuple, item: CachedOp) -> None:
        with self._lock:
            self._items[key] = item
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)


EXECUTOR_CACHE = ExecutorCache()
