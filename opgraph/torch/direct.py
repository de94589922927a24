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

from collections.abc import Iterator, Mapping
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np
import torch

from opgraph.aclnn.cache import CachedOp, ExecutorCache, call_key as op_call_key
from opgraph.core import capturing
from opgraph.core.backend import Executable, made
from opgraph.core.config import current_backend_ref, get_opt_level
from opgraph.core.platform import get_platform
from opgraph.core.tensor import Tensor as OpTensor, array_address, spans_overlap
from .arrays import DTYPES, as_numpy

try:  # numpy 2
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy 1.x
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]

Tensor = torch.Tensor


class _Bound:
    """A torch tensor or numpy array as the executable reads a binding (``data_address``,
    ``view()``): the protocol :class:`opgraph.core.backend.Addressed`."""

    __slots__ = ("x", "data_address")

    def __init__(self, x: Any) -> None:
        self.x = x
        self.data_address = x.data_ptr() if isinstance(x, Tensor) else array_address(x)

    def view(self) -> np.ndarray:
        return as_numpy(self.x)


def call_key(name: str, args: Sequence[Any]) -> Optional[tuple]:
    """What phase 1 depends on for ``args`` (torch tensors, numpy arrays, None, numbers): the
    executor cache's key (:func:`opgraph.aclnn.cache.call_key`) with the op_api and backend as
    its name and each array's metadata; None when an argument is of another kind or a tensor
    not in CPU memory (never direct).

    >>> x = torch.zeros(2, 3)
    >>> call_key("op", (x, None, x, 0.5))[4:]
    (None, ('=', 0), (<class 'float'>, 0.5, 1.0))
    """
    return op_call_key((name, current_backend_ref()), args, get_platform(), get_opt_level(),
                       _metadata, _ARRAYS)


_ARRAYS = (Tensor, np.ndarray)


def _metadata(a: Any) -> Optional[Hashable]:
    """A torch tensor's or numpy array's dtype, shape and strides (None: a torch tensor off the
    CPU or with its negative bit set; a conjugate view is of a complex dtype, never learnt)."""
    if type(a) is np.ndarray:
        return a.dtype, a.shape, a.strides
    if not a.is_cpu or a.is_neg():
        return None
    return a.dtype, a.shape, a.stride()


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
    two sharing memory (phase 1 compiles such a call as recorded: :func:`writes_shared_memory`,
    by the same rule)."""
    if any(type(a) is np.ndarray and not a.flags.writeable for a in written):
        return False
    return not spans_overlap(_span(a) for a in written if a is not None)


def _span(a: Any) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` a numpy array (``byte_bounds``) or a torch tensor (from its first
    element and its strides, never negative in torch) spans."""
    if type(a) is np.ndarray:
        return byte_bounds(a)
    lo = a.data_ptr()
    if a.numel() == 0:
        return lo, lo
    return lo, lo + a.element_size() * (1 + sum((n - 1) * s for n, s in zip(a.shape, a.stride())))


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


_EMPTY = torch.empty_strided  # (a test fills the outputs with NaN instead: every one is written)
NOT_DIRECT = _Entry(None, {}, (), ())  # a learnt call that takes the usual path


class _Watch:
    """A capture recorder that only watches: the phase 1 calls made inside it, run as usual."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple]] = []

    def on_phase1(self, executor: Any, args: Sequence[Any]) -> None:
        self.calls.append((executor, tuple(args)))

    def on_phase2(self, executor: Any) -> bool:
        return False


def _learn(watch: _Watch, args: tuple) -> _Entry:
    """The entry of the one phase 1 call ``watch`` saw; one without an executable when it
    cannot run direct: not exactly one call, a workspace, a backend without a direct run, or an
    argument the op_api did not bind in place (an opgraph copy, another object than the
    caller's)."""
    if len(watch.calls) != 1:
        return NOT_DIRECT
    ex, pargs = watch.calls[0]
    program, n = ex.program, len(args)
    exe = program.built_executable(made(current_backend_ref())) if program is not None else None
    if exe is None or program.workspace_size or len(pargs) < n \
            or type(exe).run_direct is Executable.run_direct:
        return NOT_DIRECT
    for a, p in zip(args, pargs):
        if (a is None) != (p is None) or (isinstance(p, OpTensor) and (
                p.copied or p.data_address != _Bound(a).data_address)):
            return NOT_DIRECT
    outputs = []
    for p in pargs[n:]:
        if p is None:
            outputs.append(None)
            continue
        dtype = DTYPES.get(p.dtype.np.name) if isinstance(p, OpTensor) else None
        if dtype is None:
            return NOT_DIRECT
        outputs.append((p.shape, p.strides, dtype))
    cached = CachedOp.of(ex, pargs)
    written = tuple(i for i in cached.written if i < n)
    return _Entry(exe, dict(cached.positions), tuple(outputs), written)


class DirectCalls:
    """The learnt calls, by :func:`call_key`: an executor cache of entries (LRU, ``capacity``
    entries, thread-safe). ``enabled = False``: every call takes ``slow``."""

    def __init__(self, capacity: int = 256) -> None:
        self.entries: ExecutorCache[_Entry] = ExecutorCache(capacity)
        self.enabled = True

    def call(self, name: str, args: tuple, slow: Callable[[], list]) -> list:
        """The outputs of op_api ``name`` on ``args``: run direct when a call with their
        metadata was learnt, else ``slow()`` (the op_api's usual call, its outputs as torch
        tensors in the op_api's order), learnt from."""
        if not self.enabled or capturing.active() is not None:
            return slow()
        key = call_key(name, args)
        if key is None:
            return slow()
        entry = self.entries.get(key)
        if entry is None:
            watch = _Watch()
            with capturing.recording(watch):
                outs = slow()
            self.entries.put(key, _learn(watch, args))
            return outs
        outs = entry.run(args)
        return slow() if outs is None else outs

    def runs_direct(self) -> list[bool]:
        """Per learnt call, least recently used first, whether it runs direct."""
        return [entry.exe is not None for entry in self.entries.values()]

    def __contains__(self, key: tuple) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)


DIRECT_CALLS = DirectCalls()

__all__ = ["DIRECT_CALLS", "DirectCalls", "call_key"]
