"""Direct calls: an op_api call on torch tensors whose every argument has the metadata of a call
seen before runs its compiled program straight from the tensors' memory — no opgraph Tensors,
no phase 1, no Pythonic layer — when the backend can run that program so
(:meth:`opgraph.core.backend.Executable.run_direct`: on numpy and native, any program without a
workspace, as SyncBatchNorm's five op_apis are at levels 1 and 2; native runs their one-kernel
programs from the tensors' addresses).

What phase 1 checks depends on the arguments' metadata, never on their values: on dtypes,
shapes, strides, which are NULL or the same tensor, the scalars, the platform and the opt level.
So the first call with given metadata runs the op_api as usual (:func:`call`'s ``slow``), which
checks everything and raises on bad input; a recorder watches its phase 1, and the call is
remembered when its program needs no workspace and binds the caller's own memory (no argument
copied).
A later call with the same metadata allocates the outputs as that call did and runs the
program; it checks only what depends on the tensors themselves — CPU memory, and no written
argument (BatchNormGatherStatsWithCounts' running statistics) sharing memory with another
argument. Anything else, a capture in progress included, takes ``slow``. The bits are the same:
the same compiled program runs on the same memory.

    >>> import torch
    >>> from backends.native import available
    >>> from opgraph.torch import kernels as K
    >>> x = torch.arange(8.).reshape(2, 2, 2)          # channel 0: 0 1 4 5, channel 1: 2 3 6 7
    >>> with K.on("native" if available() else "numpy"):  # learnt, then direct
    ...     runs = [K.batch_norm_stats(x, 1e-5)[0].tolist() for _ in range(2)]
    >>> runs
    [[2.5, 4.5], [2.5, 4.5]]
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from opgraph.aclnn.cache import CachedOp
from opgraph.core import capturing
from opgraph.core.backend import Executable, made
from opgraph.core.config import current_backend_ref, get_opt_level
from opgraph.core.platform import get_platform
from opgraph.core.tensor import Tensor as OpTensor, array_address
from .arrays import as_numpy

Tensor = torch.Tensor
_TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                 np.dtype(np.float64): torch.float64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.int64): torch.int64}


def _torch_dtype(d: np.dtype) -> Optional[torch.dtype]:
    return torch.bfloat16 if d.name == "bfloat16" else _TORCH_DTYPES.get(d)


class _Bound:
    """A torch tensor or numpy array as the executable reads a binding (``data_address``,
    ``view()``): the protocol :class:`opgraph.core.backend.Addressed`."""

    __slots__ = ("x", "data_address")

    def __init__(self, x: Any) -> None:
        self.x = x
        self.data_address = x.data_ptr() if isinstance(x, Tensor) else array_address(x)

    def view(self) -> np.ndarray:
        return as_numpy(self.x)


def _extent(x: Any) -> tuple[int, int]:
    """The bytes ``[first, past the last)`` a tensor or array spans."""
    if isinstance(x, Tensor):
        first, size, strides = x.data_ptr(), x.element_size(), x.stride()
    else:
        first, size, strides = array_address(x), x.itemsize, [s // x.itemsize for s in x.strides]
    if 0 in x.shape:
        return first, first
    return first, first + size * (1 + sum((n - 1) * s for n, s in zip(x.shape, strides)))


def call_key(name: str, args: Sequence[Any]) -> Optional[tuple]:
    """What phase 1 depends on for ``args`` (torch tensors, numpy arrays, None, numbers): the
    op_api, backend, platform and level, and per argument its metadata, the earlier argument it
    is, or its value; None when an argument is of another kind (never direct).

    >>> x = torch.zeros(2, 3)
    >>> call_key("op", (x, None, x, 0.5))[5:]
    (None, ('=', 0), (<class 'float'>, 0.5, 1.0))
    """
    parts: list[Any] = [name, current_backend_ref(), get_platform(), get_opt_level()]
    seen: dict[int, int] = {}
    for i, a in enumerate(args):
        kind = type(a)
        if a is None:
            parts.append(None)
        elif kind is float:
            parts.append((kind, a, math.copysign(1.0, a)))
        elif kind is bool or kind is int:
            parts.append((kind, a))
        elif seen.setdefault(id(a), i) != i:
            parts.append(("=", seen[id(a)]))
        elif isinstance(a, Tensor):  # (a conjugate view is of a complex dtype: never learnt)
            if not a.is_cpu or a.is_neg():
                return None
            parts.append((a.dtype, a.shape, a.stride()))
        elif kind is np.ndarray:
            parts.append((a.dtype, a.shape, a.strides))
        elif isinstance(a, float):  # np.float64 & co.
            parts.append((float, float(a), math.copysign(1.0, a)))
        else:
            return None
    return tuple(parts)


class _Entry:
    """A learnt call: the executable that runs it direct, the argument position each graph
    input binds (outputs after the caller's arguments), each output's (shape, strides, dtype)
    or None (a NULL output), and the written caller arguments (checked for shared memory)."""

    __slots__ = ("exe", "positions", "outputs", "written")

    def __init__(self, exe: Optional[Executable], positions: dict[str, int], outputs: tuple,
                 written: tuple) -> None:
        self.exe, self.positions, self.outputs, self.written = exe, positions, outputs, written

    def run(self, args: tuple) -> Optional[list]:
        """The outputs, new torch tensors the program wrote; None when it did not run (an
        executable that does not run direct is not asked again)."""
        written, exe = self.written, self.exe
        if exe is None or (written and not _apart([args[i] for i in written])):
            return None
        outs = [None if o is None else _EMPTY(o[0], o[1], dtype=o[2]) for o in self.outputs]
        if not exe.run_direct(_Bindings((*args, *outs), self.positions)):
            self.exe = None
            return None
        return outs


def _apart(written: list) -> bool:
    """Whether the written arguments can be written as phase 1 compiled them: writable, and no
    two sharing memory (phase 1 compiles such a call as recorded: :func:`writes_shared_memory`)."""
    if any(type(a) is np.ndarray and not a.flags.writeable for a in written):
        return False
    spans = [_extent(a) for a in written if a is not None]
    return not any(_overlaps(a, b) for k, a in enumerate(spans) for b in spans[k + 1:])


class _Bindings(Mapping):
    """The graph inputs by name, each argument at its position as :class:`_Bound`, made when
    the executable asks for it."""

    __slots__ = ("args", "positions")

    def __init__(self, args: tuple, positions: dict[str, int]) -> None:
        self.args, self.positions = args, positions

    def __getitem__(self, name: str) -> _Bound:
        return _Bound(self.args[self.positions[name]])

    def __iter__(self) -> Iterator[str]:
        return iter(self.positions)

    def __len__(self) -> int:
        return len(self.positions)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]


_EMPTY = torch.empty_strided  # (a test fills the outputs with NaN instead: every one is written)


class _Watch:
    """A capture recorder that only watches: the phase 1 calls made inside it, run as usual."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple]] = []

    def on_phase1(self, executor: Any, args: Sequence[Any]) -> None:
        self.calls.append((executor, tuple(args)))

    def on_phase2(self, executor: Any) -> bool:
        return False


def _learn(watch: _Watch, args: tuple) -> Optional[_Entry]:
    """The entry of the one phase 1 call ``watch`` saw, or None when it cannot run direct: not
    exactly one call, a workspace, a backend without a direct run, or an argument the op_api
    did not bind in place (an opgraph copy, another object than the caller's)."""
    if len(watch.calls) != 1:
        return None
    ex, pargs = watch.calls[0]
    program, n = ex.program, len(args)
    exe = program.built_executable(made(current_backend_ref())) if program is not None else None
    if exe is None or program.workspace_size or len(pargs) < n \
            or type(exe).run_direct is Executable.run_direct:
        return None
    for a, p in zip(args, pargs):
        if (a is None) != (p is None) or (isinstance(p, OpTensor) and (
                p.copied or p.data_address != _Bound(a).data_address)):
            return None
    outputs = []
    for p in pargs[n:]:
        if p is None:
            outputs.append(None)
            continue
        dtype = _torch_dtype(p.dtype.np) if isinstance(p, OpTensor) else None
        if dtype is None:
            return None
        outputs.append((p.shape, p.strides, dtype))
    cached = CachedOp.of(ex, pargs)
    written = tuple(i for i in cached.written if i < n)
    return _Entry(exe, dict(cached.positions), tuple(outputs), written)


class DirectCalls:
    """The learnt calls, by :func:`call_key` (an entry None: that call does not run direct).
    Bounded (LRU, ``capacity`` entries) and thread-safe."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity, self.enabled = capacity, True
        self._entries: "OrderedDict[tuple, Optional[_Entry]]" = OrderedDict()
        self._lock = threading.Lock()

    def call(self, name: str, args: tuple, slow: Callable[[], list]) -> list:
        """The outputs of op_api ``name`` on ``args``: run direct when a call with their
        metadata was learnt, else ``slow()`` (the op_api's usual call, its outputs as torch
        tensors in the op_api's order), learnt from."""
        if not self.enabled or capturing.active() is not None:
            return slow()
        key = call_key(name, args)
        if key is None:
            return slow()
        with self._lock:
            known = key in self._entries
            entry = self._entries.get(key)
            if known:
                self._entries.move_to_end(key)
        if entry is not None:
            outs = entry.run(args)
            if outs is not None:
                return outs
        if known:
            return slow()
        watch = _Watch()
        with capturing.recording(watch):
            outs = slow()
        learnt = _learn(watch, args)
        with self._lock:
            self._entries[key] = learnt
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return outs

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


DIRECT_CALLS = DirectCalls()

__all__ = ["DIRECT_CALLS", "DirectCalls", "call_key"]
