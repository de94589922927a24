"""Foreign memory as numpy arrays: a numpy array's address, and a CPU array from another
library (a torch tensor, anything exporting DLPack) viewed without a copy — duck-typed, so the
core never imports torch. :func:`opgraph.tensor` builds its tensors over what this gives.

    >>> import numpy as np
    >>> a = np.zeros(4, np.float32)
    >>> array_address(a[1:]) - array_address(a)
    4
"""
from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from .dtypes import DataType

BF16_NP = DataType.BF16.np
_VOID_P = ctypes.c_void_p


def _data_pointer_offset() -> "int | None":
    """Where a numpy array object keeps its data pointer, as an offset from ``id(array)``: right
    after the object header, as numpy's C API lays out ``PyArrayObject`` (``PyObject_HEAD``,
    then ``char *data``), if arrays of several layouts in this interpreter agree with
    ``ctypes.data`` there; None if not (another object header: a debug or free-threaded
    build)."""
    offset = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)  # refcount, type
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    probes = (base, base[1:, 2:], base[::-1, ::2], base.T, np.zeros((), np.int8), base.view(np.uint8)[3:])
    agree = all(_VOID_P.from_address(id(p) + offset).value == p.ctypes.data for p in probes)
    return offset if agree else None


_DATA_AT = _data_pointer_offset()


def array_address(x: np.ndarray) -> int:
    """The address of a numpy array's first element, for any dtype, layout or flags: the
    array's data pointer read from the array object (~0.2 µs, where ``x.ctypes.data`` takes
    ~1.5 µs and the buffer protocol ~0.6 µs — a native call reads one per operand), where
    :func:`_data_pointer_offset` found it; else ``x.ctypes.data``.

        >>> a = np.zeros(4, np.float32)
        >>> array_address(a[1:]) - a.ctypes.data, array_address(a[::2]) == a.ctypes.data
        (4, True)
    """
    if _DATA_AT is not None and isinstance(x, np.ndarray):
        return _VOID_P.from_address(id(x) + _DATA_AT).value or 0
    return x.ctypes.data


def array_extent(x: np.ndarray) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` a numpy array spans, as offsets from its first element (a
    negative stride reaches below it); an empty array spans none, ``(0, 0)``.

        >>> a = np.zeros((3, 4), np.float32)
        >>> array_extent(a), array_extent(a[::-1, 1:3]), array_extent(a[:0])
        ((0, 48), (-32, 8), (0, 0))
    """
    if x.flags.c_contiguous:  # (the common case; an empty array is contiguous)
        return 0, x.nbytes
    if x.size == 0:
        return 0, 0
    lo, hi = 0, x.itemsize
    for n, s in zip(x.shape, x.strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi


def array_span(x: np.ndarray) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` a numpy array spans, as addresses: numpy's ``byte_bounds`` from
    :func:`array_address` and :func:`array_extent` (~0.5 µs; ``byte_bounds`` builds the array
    interface, ~2.5 µs).

        >>> a = np.zeros((3, 4), np.float32)
        >>> lo, hi = array_span(a[::-1, 1:3])
        >>> (lo - array_address(a), hi - array_address(a))
        (4, 44)
    """
    at = array_address(x)
    lo, hi = array_extent(x)
    return at + lo, at + hi


DLPACK_CPU = 1  # DLDeviceType kDLCPU


class _RawMemory:
    """A torch-like tensor's memory as unsigned words of its item size, through numpy's array
    interface (for dtypes DLPack-to-numpy cannot carry, i.e. bfloat16); holds the tensor alive."""

    __slots__ = ("owner", "__array_interface__")

    def __init__(self, t: Any) -> None:
        item = int(t.element_size())
        self.owner = t
        self.__array_interface__ = {
            "version": 3, "shape": tuple(int(n) for n in t.shape), "typestr": f"<u{item}",
            "data": (int(t.data_ptr()), False),
            "strides": tuple(int(s) * item for s in t.stride())}


def _device_name(obj: Any, dl_device: Any) -> str:
    return str(getattr(obj, "device", None) or f"DLPack device {dl_device}")


# torch's lazy tensors: the test, what it is, what makes its memory hold its values (a
# ZeroTensor has none: DLPack exported whatever its NULL data pointer became)
_LAZY = (("is_neg", "with its neg bit set", "resolve_neg"),
         ("is_conj", "with its conj bit set", "resolve_conj"),
         ("_is_zerotensor", "that is a ZeroTensor", "clone"))


def foreign_array(obj: Any) -> np.ndarray:
    """A numpy view of a DLPack-exporting array on the CPU (a torch tensor, ...), sharing memory.

    Duck-typed, so the core never imports torch: a CPU torch tensor through its own ``numpy()``
    view when that is its memory, else DLPack; a tensor that requires grad through
    ``obj.detach()`` (same memory); bfloat16 through its raw 16-bit storage, viewed as
    ``ml_dtypes.bfloat16``. Memory on another device is a ValueError naming the device.
    """
    own = _own_cpu_view(obj)
    if own is not None:
        return own
    for bit, what, resolve in _LAZY:  # DLPack would export the memory, not the values
        lazy = getattr(obj, bit, None)
        if callable(lazy) and lazy():
            raise ValueError(f"{type(obj).__name__} {what}: its memory does not hold its values "
                             f"(resolve it first with .{resolve}())")
    try:
        dl_device = obj.__dlpack_device__()
        on_cpu = int(dl_device[0]) == DLPACK_CPU
    except (ValueError, TypeError, RuntimeError, BufferError, IndexError) as e:
        dl_device, on_cpu = e, False
        if str(getattr(obj, "device", "")) == "cpu":  # on the CPU but not strided (MKL-DNN ...)
            raise ValueError(f"cannot view {type(obj).__name__} of layout {getattr(obj, 'layout', '?')} "
                             f"as an array: {e}") from None
    if not on_cpu:
        raise ValueError(f"{type(obj).__name__} on device {_device_name(obj, dl_device)!r}: opgraph "
                         "views CPU memory only (move it with .cpu() first)")
    if getattr(obj, "requires_grad", False):
        obj = obj.detach()
    if str(getattr(obj, "dtype", "")).endswith("bfloat16"):
        if math.prod(obj.shape) == 0:
            return np.empty(tuple(obj.shape), BF16_NP)
        return np.asarray(_RawMemory(obj)).view(BF16_NP)
    try:
        return np.from_dlpack(obj)
    except (BufferError, RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"cannot view {type(obj).__name__} of dtype "
                         f"{getattr(obj, 'dtype', '?')} as an array: {e}") from None


def _own_cpu_view(obj: Any) -> "np.ndarray | None":
    """A CPU torch tensor's own numpy view (``obj.numpy()``, about half DLPack's cost), checked to
    share ``obj``'s memory; None for anything else (a dtype numpy lacks, another device, another
    kind of array), which DLPack then takes."""
    if getattr(obj, "is_cpu", None) is not True or not callable(getattr(obj, "data_ptr", None)) \
            or str(getattr(obj, "dtype", "")).endswith("bfloat16"):  # .numpy() would raise, slowly
        return None
    view = obj.detach() if getattr(obj, "requires_grad", False) else obj
    try:
        a = view.numpy()
        shared = type(a) is np.ndarray and (a.size == 0 or array_address(a) == int(obj.data_ptr()))
    except (TypeError, RuntimeError, ValueError, AttributeError):
        return None
    return a if shared else None
