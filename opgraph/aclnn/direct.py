"""Direct calls: an op_api call whose every argument has the metadata of a call seen before runs
its compiled program straight from the arrays' memory — no opgraph Tensors, no phase 1, no
Pythonic layer — when the backend can run that program so
(:meth:`opgraph.core.backend.Executable.run_direct`: on numpy and native, any program without a
workspace, as the SyncBatchNorm family's op_apis are at level 2, the default (at level 1 most
of them need one); native runs their one-kernel programs from the arrays' addresses).

What phase 1 checks depends on the arguments' metadata, never on their values: on dtypes,
shapes, strides, which are NULL or the same array, the scalars, the platform and the opt level
(with the fast-math setting).
So the first call with given metadata runs the op_api as usual (:meth:`DirectCalls.call`'s
``slow``), which checks everything and raises on bad input; a recorder watches its phase 1, and
the call is remembered when its program needs no workspace (or its backend runs it without one:
:attr:`~opgraph.core.backend.Executable.direct_without_workspace`) and binds the caller's own
memory (no argument copied). A later call with the same metadata allocates the outputs as that call
did and runs the program; it checks only what depends on the arrays themselves — no written
argument (BatchNormGatherStatsWithCounts' running statistics) read-only or sharing memory with
another argument. Anything else, a capture in progress included, takes ``slow``. The bits are
the same: the same compiled program runs on the same memory.

:class:`Arrays` says how a kind of array is read (numpy arrays here; :mod:`opgraph.torch` adds
torch tensors); :data:`NUMPY_CALLS` serves the Pythonic API (``opgraph.ops``).

    >>> import numpy as np
    >>> from opgraph.aclnn.batch_norm_stats import batch_norm_stats
    >>> x = np.arange(8, dtype=np.float32).reshape(2, 2, 2)  # channel 0: 0 1 4 5, channel 1: 2 3 6 7
    >>> [batch_norm_stats(x, 1e-5)[0].tolist() for _ in range(2)]  # learnt, then direct
    [[2.5, 4.5], [2.5, 4.5]]
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np

from opgraph.core import capturing
from opgraph.core.backend import Executable, made
from opgraph.core.config import compile_setting, current_backend_ref
from opgraph.core.dtypes import DataType
from opgraph.core.platform import get_platform
from opgraph.core.foreign import array_span
from opgraph.core.tensor import Tensor as OpTensor, array_address, is_contiguous, spans_overlap
from .cache import CachedOp, ExecutorCache, call_key as op_call_key

class Bound:
    """A numpy array as the executable reads a binding: the protocol
    :class:`opgraph.core.backend.Addressed` (its address made only when asked: native reads
    it, numpy does not)."""

    __slots__ = ("x",)

    def __init__(self, x: np.ndarray) -> None:
        self.x = x

    @property
    def data_address(self) -> int:
        """The address of the array's first element."""
        return array_address(self.x)

    def view(self) -> np.ndarray:
        """The array itself (a direct call binds it as it is)."""
        return self.x


class Arrays:
    """How direct calls read and make one kind of array — here numpy arrays (a subclass of
    ``np.ndarray`` is never keyed: its operators may differ).

        >>> a = np.zeros((2, 3), np.float32)
        >>> NUMPY.metadata(a)
        (dtype('float32'), (2, 3), (12, 4))
        >>> out = NUMPY.maker((3, 2), (1, 3), DataType.FLOAT)()  # column-major
        >>> out.shape, out.strides
        ((3, 2), (4, 12))
    """

    kinds: tuple[type, ...] = (np.ndarray,)
    bound: Callable[[Any], Any] = Bound  # a binding of an argument or output
    address: Callable[[Any], int] = staticmethod(array_address)  # its first element's address

    def metadata(self, a: Any) -> Optional[Hashable]:
        """What phase 1 depends on of array ``a``: dtype, shape, strides (None: never direct)."""
        return (a.dtype, a.shape, a.strides) if type(a) is np.ndarray else None

    def span(self, a: Any) -> tuple[int, int]:
        """The bytes ``[lo, hi)`` ``a`` spans."""
        return array_span(a)

    def writable(self, a: Any) -> bool:
        """Whether ``a`` may be written (numpy's WRITEABLE flag)."""
        return bool(a.flags.writeable)

    def maker(self, shape: tuple[int, ...], strides: tuple[int, ...],
              dtype: DataType) -> Optional[Callable[[], Any]]:
        """What makes a new uninitialised output like phase 1's (element ``strides``, never
        negative in a new output); None for a dtype this kind cannot hold."""
        d = dtype.np
        if is_contiguous(shape, strides):  # (so never empty below)
            return functools.partial(np.empty, shape, d)
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        return functools.partial(_strided, shape, d, tuple(s * d.itemsize for s in strides), extent)


def _strided(shape: tuple[int, ...], d: np.dtype, strides: tuple[int, ...], extent: int) -> np.ndarray:
    return np.lib.stride_tricks.as_strided(np.empty(extent, d), shape, strides)


NUMPY = Arrays()


class _Bindings(Mapping):
    """The graph inputs by name, each argument at its position as its kind's binding
    (:attr:`Arrays.bound`), made when the executable asks for it — or only the arguments'
    addresses (:meth:`data_addresses`), with no binding made."""

    __slots__ = ("args", "positions", "bound", "address")

    def __init__(self, args: tuple, positions: dict[str, int], arrays: "Arrays") -> None:
        self.args, self.positions, self.bound, self.address = args, positions, arrays.bound, arrays.address

    def __getitem__(self, name: str) -> Any:
        return self.bound(self.args[self.positions[name]])

    def data_addresses(self, names: Sequence[str]) -> list[int]:
        """The named bindings' addresses, read off the arguments
        (:func:`opgraph.core.backend.data_addresses`)."""
        args, positions, address = self.args, self.positions, self.address
        return [address(args[positions[n]]) for n in names]

    def __iter__(self) -> Iterator[str]:
        return iter(self.positions)

    def __len__(self) -> int:
        return len(self.positions)


class _Entry:
    """A learnt call: the executable that runs it direct, the argument position each graph
    input binds (outputs after the caller's arguments), each output's :meth:`Arrays.maker` or
    None (a NULL output), and the written caller arguments (checked before a run)."""

    __slots__ = ("exe", "positions", "outputs", "written")

    def __init__(self, exe: Optional[Executable], positions: dict[str, int], outputs: tuple,
                 written: tuple) -> None:
        self.exe, self.positions, self.outputs, self.written = exe, positions, outputs, written

    def run(self, args: tuple, arrays: Arrays) -> Optional[list]:
        """The outputs, new arrays the program wrote; None when it did not run (an executable
        that does not run direct is not asked again)."""
        written, exe = self.written, self.exe
        if exe is None or (written and not _apart(args, written, arrays)):
            return None
        outs = [None if make is None else make() for make in self.outputs]
        if not exe.run_direct(_Bindings((*args, *outs), self.positions, arrays)):
            self.exe = None
            return None
        return outs


def _apart(args: tuple, written: tuple, arrays: Arrays) -> bool:
    """Whether the written arguments (positions ``written`` in ``args``) can be written as
    phase 1 compiled them: writable, and none sharing memory with another argument (phase 1
    compiles such a call as recorded: :func:`~.twophase.writes_shared_memory`, by the same
    rule; direct calls write only in-out arguments, never an in-place op_api's output)."""
    present = [args[i] for i in written if args[i] is not None]
    if not all(map(arrays.writable, present)):
        return False
    spans = [arrays.span(a) for a in present]
    others = [arrays.span(a) for i, a in enumerate(args)
              if i not in written and isinstance(a, arrays.kinds)]
    return not spans_overlap(spans) and not any(
        lo < hi2 and lo2 < hi and lo2 < hi2 for lo, hi in spans if lo < hi for lo2, hi2 in others)


NOT_DIRECT = _Entry(None, {}, (), ())  # a learnt call that takes the usual path


class _Watch:
    """A capture recorder that only watches: the phase 1 calls made inside it, run as usual."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple]] = []

    def on_phase1(self, executor: Any, args: Sequence[Any]) -> None:
        self.calls.append((executor, tuple(args)))

    def on_phase2(self, executor: Any) -> bool:
        return False


def _learn(watch: _Watch, args: tuple, arrays: Arrays) -> _Entry:
    """The entry of the one phase 1 call ``watch`` saw; one without an executable when it
    cannot run direct: not exactly one call, a workspace (unless the executable does without
    it), a backend without a direct run, or an argument the op_api did not bind in place (an
    opgraph copy, another object than the caller's)."""
    if len(watch.calls) != 1:
        return NOT_DIRECT
    ex, pargs = watch.calls[0]
    program, n = ex.program, len(args)
    exe = program.built_executable(made(current_backend_ref())) if program is not None else None
    if exe is None or (program.workspace_size and not exe.direct_without_workspace) or len(pargs) < n \
            or type(exe).run_direct is Executable.run_direct:
        return NOT_DIRECT
    for a, p in zip(args, pargs):
        if (a is None) != (p is None) or (isinstance(p, OpTensor) and (
                p.copied or p.data_address != arrays.bound(a).data_address)):
            return NOT_DIRECT
    outputs = []
    for p in pargs[n:]:
        if p is None:
            outputs.append(None)
            continue
        make = arrays.maker(p.shape, p.strides, p.dtype) if isinstance(p, OpTensor) else None
        if make is None:
            return NOT_DIRECT
        outputs.append(make)
    cached = CachedOp.of(ex, pargs)
    written = tuple(i for i in cached.written if i < n)
    return _Entry(exe, dict(cached.positions), tuple(outputs), written)


class DirectCalls:
    """The learnt calls on one kind of array (``arrays``), by :meth:`key`: an executor cache of
    entries (LRU, ``capacity`` entries, thread-safe). ``enabled = False``: every call takes
    ``slow``."""

    def __init__(self, arrays: Arrays = NUMPY, capacity: int = 256) -> None:
        self.arrays = arrays
        self.entries: ExecutorCache[_Entry] = ExecutorCache(capacity)
        self.enabled = True

    def key(self, name: str, args: Sequence[Any]) -> Optional[tuple]:
        """What phase 1 depends on for ``args`` (arrays of this kind, None, numbers): the
        executor cache's key (:func:`~.cache.call_key`) with the op_api and backend as its name
        and each array's metadata; None when an argument is of another kind or gives no
        metadata (never direct).

            >>> x = np.zeros((2, 3), np.float32)
            >>> NUMPY_CALLS.key("op", (x, None, x, 0.5))[4:]
            (None, ('=', 0), (<class 'float'>, 0.5, 1.0))
        """
        arrays = self.arrays
        return op_call_key((name, current_backend_ref()), args, get_platform(), compile_setting(),
                           arrays.metadata, arrays.kinds)

    def call(self, name: str, args: tuple, slow: Callable[[], Sequence[Any]]) -> Sequence[Any]:
        """The outputs of op_api ``name`` on ``args`` (its arguments before its outputs): run
        direct when a call with their metadata was learnt, else ``slow()`` (the op_api's usual
        call, its outputs in the op_api's order, None for a NULL one), learnt from."""
        if not self.enabled or capturing.active() is not None:
            return slow()
        key = self.key(name, args)
        if key is None:
            return slow()
        entry = self.entries.get(key)
        if entry is None:
            watch = _Watch()
            with capturing.recording(watch):
                outs = slow()
            self.entries.put(key, _learn(watch, args, self.arrays))
            return outs
        outs = entry.run(args, self.arrays)
        return slow() if outs is None else outs

    def runs_direct(self) -> list[bool]:
        """Per learnt call, least recently used first, whether it runs direct."""
        return [entry.exe is not None for entry in self.entries.values()]

    def __contains__(self, key: tuple) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)


NUMPY_CALLS = DirectCalls(NUMPY)  # the Pythonic API's (opgraph.ops) on numpy arrays

__all__ = ["Arrays", "Bound", "DirectCalls", "NOT_DIRECT", "NUMPY", "NUMPY_CALLS"]
