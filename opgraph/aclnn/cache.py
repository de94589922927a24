"""The executor cache: phase 1 with the same argument metadata reuses the compiled plan.

The key holds, per argument, the tensor metadata (shape, strides, dtype, format, writeable) or None for a
NULL, the aliasing pattern of the arguments, the platform and the opt level — everything phase 1
depends on except data pointers. Bounded (LRU) and thread-safe.

    >>> import numpy as np, opgraph
    >>> t = opgraph.tensor(np.zeros((2, 3), np.float32))
    >>> cache_key("op", (t, None), opgraph.get_platform(), 2)[1]
    (('T', (2, 3), (3, 1), 0, 2, True), None)
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Optional

from ..executor import Executor
from ..tensor import Tensor


def _meta(a: Any) -> Optional[Hashable]:
    if a is None:
        return None
    if isinstance(a, Tensor):
        # writeability is part of it: phase 1 rejects a read-only output
        return ("T", a.shape, a.strides, int(a.dtype), int(a.format), a.writeable)
    if isinstance(a, (int, float, str, bool)):
        return ("V", a)
    raise TypeError  # uncacheable argument


def cache_key(name: str, args: tuple, platform: Any, level: int) -> Optional[tuple]:
    """The cache key, or None when an argument cannot be keyed (then nothing is cached)."""
    try:
        metas = tuple(_meta(a) for a in args)
    except TypeError:
        return None
    first: dict[int, int] = {}
    alias = tuple(first.setdefault(id(a), i) if a is not None else i for i, a in enumerate(args))
    return (name, metas, alias, platform, level)


@dataclass(frozen=True)
class CompiledOp:
    """What a cache hit reuses: the recorded and compiled graphs, the memory plan, and which
    argument position binds each graph input."""

    name: str
    graph: Any
    compiled: Any
    memory_plan: Any
    workspace_size: int
    opt_level: int
    platform: Any
    positions: tuple[tuple[str, int], ...]

    @classmethod
    def from_executor(cls, ex: Executor, args: tuple) -> "CompiledOp":
        pos = []
        for name, t in ex.bindings.items():
            idx = next(i for i, a in enumerate(args) if a is t)
            pos.append((name, idx))
        return cls(ex.name, ex.graph, ex.compiled, ex.memory_plan, ex.workspace_size,
                   ex.opt_level, ex.platform, tuple(pos))

    def instantiate(self, args: tuple) -> Executor:
        """A fresh single-use executor over the shared plan, bound to ``args``."""
        ex = Executor.__new__(Executor)
        ex.graph, ex.compiled, ex.memory_plan = self.graph, self.compiled, self.memory_plan
        ex.workspace_size, ex.opt_level, ex.platform = self.workspace_size, self.opt_level, self.platform
        ex.bindings = {name: args[i] for name, i in self.positions}
        ex.repeatable, ex.runs, ex.destroyed = False, 0, False
        ex.cached = True
        return ex


class ExecutorCache:
    """A bounded LRU map from cache keys to CompiledOp, safe under threads."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._items: "OrderedDict[tuple, CompiledOp]" = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: tuple) -> Optional[CompiledOp]:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item

    def put(self, key: tuple, item: CompiledOp) -> None:
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
