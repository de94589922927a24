"""The structure cache: a new shape of a call seen before skips recording and the passes.

What phase 1 records and what the passes make of it depend on the arguments' dtypes, formats,
ranks, NULL pattern, scalars, aliasing, layout, platform and opt level — and on the sizes only
through which dims are 0, 1 or equal to each other (the op_api's checks are rules about those).
That is the *structure* key. (Whether the outputs are writable decides only whether phase 1
refuses the call: a hit checks it, as an executor-cache hit does.) The first call of a
structure records as usual; the cache then records the op_api once more on probe tensors
(virtual storage, no memory) whose independent dims are distinct primes (none dividing a dim of
the call: :func:`probe_primes`), so every size in the probe graphs factors into a monomial of
the dims (:mod:`opgraph.core.resize`). The template is kept only if, evaluated at the first
call's dims, it reproduces that call's recorded and optimised graphs exactly. A later call of
the same structure gets the optimised graph at its sizes, a fresh memory plan and (on first
access only) its recorded graph — in tens of microseconds instead of milliseconds.

Only calls whose tensors are all row-major contiguous take part; others use the exact-key
executor cache alone. Bounded (LRU, 128 structures) and thread-safe, like the executor cache.

    >>> import numpy as np, opgraph
    >>> a = opgraph.tensor(np.zeros((8, 3, 5), np.float32))
    >>> b = opgraph.tensor(np.zeros((2, 3, 7), np.float32))
    >>> k1, dims1 = structure_key("op", (a, None), "p", 2)
    >>> k2, dims2 = structure_key("op", (b, None), "p", 2)
    >>> k1 == k2, dims1, dims2
    (True, (8, 3, 5), (2, 3, 7))
"""
from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Optional

from opgraph.core.executor import CompiledProgram, Executor
from opgraph.core.memo import BoundedMemo
from opgraph.core.memory import plan_memory
from opgraph.core.resize import Resizer, graph_numbers, monomial, same_graph
from opgraph.core.tensor import Tensor, row_major_strides, virtual_tensor
from .cache import CachedOp, ExecutorCache, cache_key

# probe dims: primes far from the small constants graphs hold (axes, ranks, powers of two)
PRIMES = tuple(p for p in range(11, 1000) if all(p % q for q in range(2, int(p ** 0.5) + 1)))
MAX_PROBE_ELEMS = 1 << 24  # larger probes (high ranks, many distinct dims) are not templated
# signature id -> ((dtype, format, rank), shape), or () when the strides are not row-major
_KINDS = BoundedMemo(limit=4096)


def structure_key(name: str, args: tuple, platform: Any, level: Hashable,
                  key: Optional[tuple] = None) -> tuple[Optional[tuple], tuple[int, ...]]:
    """``(key, dims)``: the structure key (None when the call cannot take part) and the values
    of its independent dims, in order of first appearance. Built from the call's exact
    :func:`~.cache.cache_key` (``key``, computed when not given): each tensor's signature id
    becomes its dtype, format and rank, and the key ends with every dim of every tensor as 0,
    1 or its class. Whether the outputs are writable is not keyed (a hit checks it, as an
    exact hit does)."""
    if key is None:
        key = cache_key(name, args, platform, level)
    if key is None:
        return None, ()
    parts, sizes = list(key[:3]), []
    for a, part in zip(args, key[3:]):
        if type(part) is int:  # a tensor (first appearance): keyed by its signature id
            kind = _KINDS.get(part)
            if kind is None:
                kind = _KINDS.put(part, ((int(a.dtype), int(a.format), len(a.shape)), a.shape)
                                  if a.strides == row_major_strides(a.shape) else ())
            if not kind:
                return None, ()
            parts.append(kind[0])
            sizes += kind[1]
        else:
            parts.append(part)
    classes: dict[int, int] = {}
    parts.append(tuple([n if n <= 1 else -1 - classes.setdefault(n, len(classes)) for n in sizes]))
    if len(classes) > len(PRIMES):
        return None, ()
    return tuple(parts), tuple(classes)


def _probe_tensor(t: Tensor, dims: tuple[int, ...], primes: tuple[int, ...]) -> Tensor:
    """``t``'s structure with dim class k of size ``primes[k]``, over no memory."""
    shape = tuple(primes[dims.index(n)] if n > 1 else n for n in t.shape)
    return virtual_tensor(shape, t.storage.dtype, t.format, bool(t.storage.flags.writeable))


class Template:
    """A structure's probe graphs and the monomial of every size they hold."""

    def __init__(self, probe: Executor, primes: tuple[int, ...], binding: CachedOp):
        assert probe.program is not None
        self.recorded, self.compiled = probe.graph, probe.program.compiled
        self.level, self.platform = probe.program.opt_level, probe.platform
        self.fast_math = probe.program.fast_math
        self.positions, self.written = binding.positions, binding.written  # argument positions
        numbers = set(graph_numbers(self.recorded)) | set(graph_numbers(self.compiled))
        ints = {v for v in numbers if type(v) is int}
        ints |= {round(1 / v) for v in numbers if type(v) is float and 0 < v < 1}  # 1/n scales
        self.sizes = {v: e for v, e in ((v, monomial(v, primes)) for v in ints) if e is not None}
        # each size as the dims it multiplies (a dim repeated for its power): one dim, mostly
        self.factors = [(v, tuple(k for k, e in enumerate(exps) for _ in range(e)))
                        for v, exps in self.sizes.items()]
        # checked (types inferred again) when made; then only mapped: reproduces() has shown
        # that the mapping gives the graphs recording and the passes give
        self.resize_recorded = Resizer(self.recorded, self.sizes.__contains__)
        self.resize_compiled = (self.resize_recorded if self.compiled is self.recorded
                                else Resizer(self.compiled, self.sizes.__contains__))
        # a plan without workspace buffers holds no size (which value lives in which user
        # tensor, which aliases which): the same at every size; otherwise planned per size
        plan = plan_memory(self.compiled)
        self.memory_plan = None if plan.offsets or plan.lifetimes else plan
        self.executables: dict = {}  # per backend: the executable later sizes derive theirs from

    def size_map(self, dims: tuple[int, ...]) -> Callable[[int], int]:
        """Each probe size → its value at ``dims``."""
        return {v: dims[ks[0]] if len(ks) == 1 else math.prod([dims[k] for k in ks])
                for v, ks in self.factors}.__getitem__

    def at(self, dims: tuple[int, ...]) -> CachedOp:
        """The compiled program for these dims (the recorded graph is built on first access)."""
        f = self.size_map(dims)
        compiled = self.resize_compiled(f, check=False)
        recorded = (compiled if self.compiled is self.recorded
                    else (lambda: self.resize_recorded(f, check=False)))
        plan = self.memory_plan or plan_memory(compiled)
        return CachedOp(CompiledProgram(recorded, compiled, plan, self.level, self.platform,
                                        self.executables, self.fast_math),
                        self.positions, self.written)

    def reproduces(self, ex: Executor, dims: tuple[int, ...]) -> bool:
        """Whether the template at ``dims`` gives exactly ``ex``'s recorded and compiled graphs."""
        assert ex.program is not None
        f = self.size_map(dims)
        return (same_graph(self.resize_recorded(f), ex.graph)
                and same_graph(self.resize_compiled(f), ex.program.compiled))


def probe_primes(dims: tuple[int, ...]) -> tuple[int, ...]:
    """One probe prime per dim class, none dividing any of the call's ``dims``. A value the call
    passes (a momentum of 1/11, as torch's cumulative average gives at step 11) reads as a size
    in the probe graphs when it is 1/n of a probe size; the template is kept only if it gives the
    call's own graphs at ``dims``, and with no probe prime dividing a dim that check fails for
    such a value — with 11 a probe dim and 11 a real one, it passed, and a later size got
    momentum 1/N.

        >>> probe_primes((4, 11, 26))
        (17, 19, 23)
    """
    return tuple(p for p in PRIMES if all(d % p for d in dims))[:len(dims)]


def build_template(record: Callable[[tuple], "Executor | None"], args: tuple,
                   ex: Executor, dims: tuple[int, ...]) -> "Template | None":
    """Record ``args``' structure on probe tensors and keep it if it reproduces ``ex`` (the
    call just recorded at ``dims``); None when the structure cannot be templated."""
    primes = probe_primes(dims)
    if len(primes) < len(dims):
        return None
    probes: dict[int, Any] = {}
    probe_args = []
    for a in args:
        if isinstance(a, Tensor) and id(a) not in probes:
            if math.prod(primes[dims.index(n)] if n > 1 else n for n in a.shape) > MAX_PROBE_ELEMS:
                return None
            probes[id(a)] = _probe_tensor(a, dims, primes)
        probe_args.append(probes.get(id(a), a))
    try:
        probe = record(tuple(probe_args))
        if probe is None:
            return None
        template = Template(probe, primes, CachedOp.of(probe, tuple(probe_args)))
        return template if template.reproduces(ex, dims) else None
    except Exception:  # a structure the probe cannot stand for is simply not templated
        return None


UNTEMPLATED = object()  # marks a structure whose probe did not reproduce its first call
STRUCTURE_CACHE = ExecutorCache(capacity=128)

__all__ = ["STRUCTURE_CACHE", "Template", "UNTEMPLATED", "build_template", "structure_key"]
