"""The executor cache: phase 1 with the same argument metadata reuses the compiled program.

The key holds, per argument, the tensor metadata (shape, strides, dtype, format, as the
tensor's interned :attr:`~opgraph.core.tensor.Tensor.signature_id`) or None for a NULL,
scalars by value, which arguments are the same tensor, the platform and the opt level (paired
with "fast-math" when that is on: :func:`~opgraph.core.config.compile_setting`) —
everything phase 1 depends on except data pointers and whether the outputs are writable,
which a hit checks (:meth:`CachedOp.writable`). Phase 1 appends one more part when a tensor the
call writes shares memory with another argument (:func:`~.twophase.writes_shared_memory`:
compiled as recorded). Bounded
(LRU, 256 entries by default; the least recently used entry is evicted) and thread-safe.

    >>> import numpy as np, opgraph
    >>> t = opgraph.tensor(np.zeros((2, 3), np.float32))
    >>> key = cache_key("op", (t, None, t, 0.5), opgraph.get_platform(), 2)
    >>> key[3] == t.signature_id, key[4:]
    (True, (None, ('=', 0), (<class 'float'>, 0.5, 1.0)))
"""
from __future__ import annotations

import math
import operator
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generic, Hashable, Optional, Sequence, TypeVar

from opgraph.core.executor import CompiledProgram, Executor
from opgraph.core.tensor import Tensor


TensorMeta = Callable[[Any], Optional[Hashable]]


def call_key(name: Hashable, args: Sequence[Any], platform: Any, level: Hashable, meta: TensorMeta,
             kinds: Any = Tensor) -> Optional[tuple]:
    """``(name, platform, level, one part per argument)``: ``meta(tensor)`` for a tensor's
    first appearance (a tensor: an instance of ``kinds``, opgraph Tensors unless a caller keys
    other arrays), ``("=", i)`` for a tensor that is also argument ``i``, None for a NULL, a
    number by type and value (a float with its sign, so -0.0 is not 0.0). None when ``meta``
    gives None or an argument is neither a tensor nor a number (no key)."""
    parts: list[Any] = [name, platform, level]
    seen: dict[int, int] = {}
    for i, a in enumerate(args):
        if a is None:
            parts.append(None)
        elif isinstance(a, kinds):
            j = seen.setdefault(id(a), i)
            if j != i:
                parts.append(("=", j))
                continue
            m = meta(a)
            if m is None:
                return None
            parts.append(m)
        elif isinstance(a, float):  # np.float64 too
            parts.append((type(a), a, math.copysign(1.0, a)))
        elif isinstance(a, (int, float, bool)):
            parts.append((type(a), a))
        else:
            return None  # uncacheable argument
    return tuple(parts)


def cache_key(name: str, args: tuple, platform: Any, level: Hashable) -> Optional[tuple]:
    """The cache key, or None when an argument cannot be keyed (then nothing is cached). A
    tensor is keyed by its signature's id; whether an output is writable is checked on a hit
    (:meth:`CachedOp.writable`), not keyed."""
    return call_key(name, args, platform, level, _SIGNATURE_ID)


_SIGNATURE_ID = operator.attrgetter("signature_id")


def written_inputs(graph: Any) -> list[str]:
    """Names of the graph inputs (user tensors) some node writes: the op_api's outputs."""
    written = {n.inputs[k].name for n in graph.nodes for k in n.opdef.written(n)}
    return [v.name for v in graph.inputs if v.name in written]


@dataclass(frozen=True)
class CachedOp:
    """What a cache hit reuses: the compiled program, which argument position binds each
    graph input, and the positions of the arguments it writes."""

    program: CompiledProgram
    positions: tuple[tuple[str, int], ...]
    written: tuple[int, ...] = ()

    @classmethod
    def of(cls, ex: Executor, args: tuple) -> "CachedOp":
        """The entry for ``ex``'s compiled program: each bound tensor's position among ``args``, and
        the positions of those the graph writes."""
        pos = tuple((name, next(i for i, a in enumerate(args) if a is t))
                    for name, t in ex.bindings.items())
        assert ex.program is not None
        outs = set(written_inputs(ex.graph))
        return cls(ex.program, pos, tuple(i for name, i in pos if name in outs))

    def writable(self, args: tuple) -> bool:
        """Whether phase 2 can write every output among ``args`` where the caller sees it
        (if not, phase 1 records the call, which rejects it naming the output)."""
        return all(args[i].writeable for i in self.written)

    def instantiate(self, args: tuple) -> Executor:
        """A fresh single-use executor over the shared program, bound to ``args``."""
        return Executor.of_program(self.program, {name: args[i] for name, i in self.positions})


Entry = TypeVar("Entry")


class ExecutorCache(Generic[Entry]):
    """A bounded LRU map from cache keys to CachedOp (or another kind of entry: the torch
    layer's direct calls), safe under threads. The recency order is a circular doubly linked
    list of ``[prev, next, key, entry]`` links (as ``functools.lru_cache`` keeps it), so a hit
    hashes and compares its key once: a key is a tuple of every argument's metadata, whose hash
    and comparison are most of a lookup's cost.

        >>> c = ExecutorCache(capacity=2)
        >>> c.put(("a",), 1); c.put(("b",), 2); c.get(("a",)); c.put(("c",), 3)
        1
        >>> c.values(), ("b",) in c   # "b" was the least recently used: evicted
        ([1, 3], False)
    """

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._items: dict[tuple, list] = {}
        self._root: list = []  # the sentinel: its next link is the least recently used
        self._root[:] = [self._root, self._root, None, None]
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        _CACHES.add(self)

    def _to_end(self, link: list) -> None:
        """Link ``link`` (unlinked) in as the most recently used."""
        root = self._root
        last = root[0]
        last[1] = root[0] = link
        link[0], link[1] = last, root

    def get(self, key: tuple) -> Optional[Entry]:
        """The entry for ``key`` (now the most recently used), or None (a miss, counted)."""
        with self._lock:
            link = self._items.get(key)
            if link is None:
                self.misses += 1
                return None
            prev, nxt = link[0], link[1]
            prev[1], nxt[0] = nxt, prev
            self._to_end(link)
            self.hits += 1
            return link[3]

    def put(self, key: tuple, item: Entry) -> None:
        """Store ``item`` under ``key`` as the most recently used; the least recently used go past
        :attr:`capacity`."""
        with self._lock:
            link = self._items.get(key)
            if link is not None:  # a new entry for a known key: unlinked, then as a new one
                prev, nxt = link[0], link[1]
                prev[1], nxt[0] = nxt, prev
            link = self._items[key] = [None, None, key, item]
            self._to_end(link)
            root = self._root
            while len(self._items) > self.capacity:
                oldest = root[1]
                root[1], oldest[1][0] = oldest[1], root
                del self._items[oldest[2]]

    def clear(self) -> None:
        """Drop every entry and zero the hit and miss counts."""
        with self._lock:
            self._items.clear()
            self._root[:] = [self._root, self._root, None, None]
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: tuple) -> bool:
        return key in self._items

    def values(self) -> list[Entry]:
        """The entries, least recently used first."""
        with self._lock:
            out, link = [], self._root[1]
            while link is not self._root:
                out.append(link[3])
                link = link[1]
            return out


def clear_all_caches() -> None:
    """Empty every executor cache (phase 1's, the structures', the direct calls'): what they
    hold was compiled from op_apis as registered, and one was registered again."""
    for c in list(_CACHES):
        c.clear()


_CACHES: "weakref.WeakSet[ExecutorCache]" = weakref.WeakSet()
EXECUTOR_CACHE: ExecutorCache[CachedOp] = ExecutorCache()
