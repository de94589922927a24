"""aclTensor analogs: a strided view (element strides, offset, format) over flat numpy storage.

    >>> import numpy as np
    >>> t = tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    >>> t.shape, t.strides, t.is_contiguous
    ((2, 3), (3, 1), True)
    >>> u = Tensor(t.storage, (3, 2), (1, 3))      # the transpose, sharing memory
    >>> u.numpy().tolist()
    [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]

Metadata is immutable after construction (so the bounds check made there stays true):

    >>> t.strides = (1 << 40, 1)
    Traceback (most recent call last):
    ...
    AttributeError: Tensor metadata is immutable: cannot set 'strides'
"""
from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Iterable, Sequence

import numpy as np

from .dtypes import DataType, Format, dtype_of, format_of
from .foreign import array_address, foreign_array
from .memo import BoundedMemo


MAX_RANK = 64  # numpy's limit on array dimensions
_INT64_MAX = (1 << 63) - 1  # aclCreateTensor takes dims, strides and offset as int64_t


_ROW_MAJOR = BoundedMemo(limit=4096)  # shape tuple -> row-major strides


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of ``shape`` (remembered per shape tuple).

    >>> row_major_strides((2, 0, 3))
    (3, 3, 1)
    """
    key = shape if type(shape) is tuple else None
    got = _ROW_MAJOR.get(key) if key is not None else None
    if got is not None:
        return got
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    got = tuple(reversed(strides))
    return got if key is None else _ROW_MAJOR.put(key, got)


def is_contiguous(shape: Sequence[int], strides: Sequence[int], fmt: Format = Format.ND) -> bool:
    """``op::IsContiguous`` (opbase tensor_view_utils.cpp): private format, ≤ 1 element, or
    row-major strides when dims of size 1 are skipped. The view offset is ignored."""
    if fmt.is_private or math.prod(shape) <= 1:
        return True
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 1:
            continue
        if s != expected:
            return False
        expected *= n
    return True


def _ints(what: str, values: Any) -> tuple[int, ...]:
    """A tuple of Python ints; floats, bools and other non-integers are refused, not truncated."""
    try:
        items = tuple(values)
    except TypeError:
        raise ValueError(f"{what} must be a sequence of integers, got {values!r}") from None
    out = []
    for v in items:
        if isinstance(v, (bool, np.bool_)):
            raise ValueError(f"{what} {items!r}: {v!r} is not an integer")
        try:
            out.append(operator.index(v))
        except TypeError:
            raise ValueError(f"{what} {items!r}: {v!r} is not an integer") from None
    return tuple(out)


def _int(what: str, v: Any) -> int:
    return _ints(what, (v,))[0]


class _Slots:
    """The fields of a :class:`Tensor` (its storage layout)."""

    __slots__ = ("storage", "shape", "strides", "offset", "format", "storage_shape", "dtype",
                 "copied", "_view", "_signature", "_signature_id", "_address", "_extent")


class _NewTensor(_Slots):
    """A Tensor being built: plain attribute stores (a quarter of the slot setters' cost), then
    ``__class__ = Tensor`` (same layout) makes it the immutable Tensor."""

    __slots__ = ()


class Tensor(_Slots):
    """A strided view over a flat 1-D numpy ``storage`` (element strides ≥ 0, element offset).

    Reads go through :meth:`numpy`; kernels that write the tensor (ViewCopy) write into
    ``storage`` and touch only the view's elements. ``copied`` is True when :func:`tensor` had to
    copy the caller's array (writes to this tensor would not reach the caller), so op_apis refuse
    such a tensor as an output.
    """

    __slots__ = ()

    def __init__(self, storage: np.ndarray, shape: Sequence[int], strides: Sequence[int],
                 offset: int = 0, format: "Format | str" = "ND",
                 storage_shape: "Sequence[int] | None" = None, *, copied: bool = False):
        storage = np.asarray(storage)
        if storage.ndim != 1:
            raise ValueError(f"storage must be a flat 1-D array, got shape {storage.shape}")
        # numpy 2 gives 0- and 1-element arrays stride 0, so only check longer storages
        if storage.size > 1 and storage.strides[0] != storage.itemsize:
            raise ValueError("storage must be a contiguous 1-D array")
        dtype = dtype_of(storage.dtype)
        shape, strides = _ints("shape", shape), _ints("strides", strides)
        offset = _int("offset", offset)
        if len(shape) != len(strides):
            raise ValueError(f"shape {shape} and strides {strides} have different ranks")
        problem = shape_error(shape)
        if problem is not None:
            raise ValueError(problem)
        if any(s < 0 for s in strides):
            raise ValueError(f"strides {strides} must be >= 0")
        if offset < 0:
            raise ValueError(f"offset {offset} must be >= 0")
        if max((*strides, offset)) > _INT64_MAX:
            raise ValueError(f"strides {strides}, offset {offset}: they must fit in an int64_t, as "
                             "aclCreateTensor takes them")
        if math.prod(shape) > 0:
            last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
            if last >= storage.size:
                raise ValueError(
                    f"view shape={shape} strides={strides} offset={offset} reaches element {last}, "
                    f"outside storage of {storage.size} elements")
        fmt = format_of(format)
        sshape = _ints("storage_shape", storage_shape) if storage_shape is not None else (storage.size,)
        for name, value in (("storage", storage), ("dtype", dtype), ("shape", shape),
                            ("strides", strides), ("offset", offset), ("format", fmt),
                            ("storage_shape", sshape), ("copied", bool(copied)), ("_address", None),
                            ("_extent", None)):
            object.__setattr__(self, name, value)

    @classmethod
    def _unchecked(cls, storage: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...],
                   fmt: Format, storage_shape: tuple[int, ...], copied: bool, view: np.ndarray,
                   dtype: "DataType | None" = None, signature_id: "int | None" = None,
                   address: "int | None" = None) -> "Tensor":
        """A tensor without the checks of ``__init__``, for :func:`tensor`, whose numpy array
        guarantees them (flat contiguous storage, Python-int shape/strides >= 0 in bounds,
        offset 0), with ``view`` (the array itself, as a new view object) as its live view;
        ``dtype`` and ``signature_id`` when the caller knows them already, and ``address`` (of
        a row-major view over its whole storage: its extent follows). Built with plain stores
        on a :class:`_NewTensor`, then made a Tensor (a quarter of the slot setters' cost)."""
        if dtype is None:
            dtype = _DTYPES.get(storage.dtype)
            if dtype is None:  # (a dict of numpy dtypes seen so far: dtype_of costs more)
                dtype = _DTYPES.setdefault(storage.dtype, dtype_of(storage.dtype))
        t = _NewTensor()
        t.storage, t.dtype, t.shape, t.strides, t.offset = storage, dtype, shape, strides, 0
        t.format, t.storage_shape, t.copied, t._view, t._address = fmt, storage_shape, copied, view, address
        t._extent = None if address is None else (address, address + storage.nbytes)
        if signature_id is not None:
            t._signature_id = signature_id
        t.__class__ = Tensor
        return t  # type: ignore[return-value]

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Tensor metadata is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Tensor metadata is immutable: cannot delete {name!r}")

    # --- metadata -------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """The number of dims (0 for a scalar tensor); ``dim`` is the same."""
        return len(self.shape)

    dim = ndim

    @property
    def numel(self) -> int:
        """The number of elements (1 for a scalar tensor, 0 when a dim is 0)."""
        return math.prod(self.shape)

    @property
    def is_empty(self) -> bool:
        """True when a dim is 0 (no elements)."""
        return self.numel == 0

    @property
    def is_contiguous(self) -> bool:
        """``op::IsContiguous`` of the view (:func:`is_contiguous`; the offset is ignored)."""
        return is_contiguous(self.shape, self.strides, self.format)

    @property
    def writeable(self) -> bool:
        """True when phase 2 can write this tensor and the caller sees the result."""
        return bool(self.storage.flags.writeable) and not self.copied

    @property
    def signature(self) -> tuple:
        """``(shape, strides, dtype, format)`` as one hashable tuple, built once (the metadata
        is immutable): what phase 1's executor cache keys a tensor argument by."""
        try:
            return self._signature
        except AttributeError:
            sig = (self.shape, self.strides, int(self.dtype), int(self.format))
            _SET_SIGNATURE(self, sig)
            return sig

    @property
    def signature_id(self) -> int:
        """A small int naming :attr:`signature` in this process (equal ints, equal signatures),
        built once: phase 1's executor cache keys a tensor by it, so a cache probe hashes and
        compares ints rather than nested tuples."""
        try:
            return self._signature_id
        except AttributeError:
            sid = _intern_signature(self.signature)
            _SET_SIGNATURE_ID(self, sid)
            return sid

    # --- data -----------------------------------------------------------------------------
    @property
    def data_address(self) -> int:
        """The address of the view's first element (``offset`` elements into ``storage``),
        built once: a numpy array's buffer never moves, so compiled kernels can take it as is.

        >>> a = np.zeros(4, np.float32); t = Tensor(a, (2,), (1,), offset=2)
        >>> t.data_address - a.ctypes.data
        8
        """
        address = self._address  # None until first asked (every constructor sets it so)
        if address is None:
            address = array_address(self.storage) + self.offset * self.storage.itemsize
            _SET_ADDRESS(self, address)
        return address

    def view(self) -> np.ndarray:
        """A live numpy view of the tensor (writes go to ``storage``); built once."""
        try:
            return self._view
        except AttributeError:
            object.__setattr__(self, "_view", self._make_view())
            return self._view

    def _make_view(self) -> np.ndarray:
        item = self.storage.itemsize
        base = self.storage[self.offset:] if self.numel else self.storage[:0]
        # a stride past numpy's (an int64 of bytes) steps nowhere: the view checked in bounds
        # has it only on a dim of size 1 or in an empty view
        strides = tuple(s * item if s * item <= _INT64_MAX else 0 for s in self.strides)
        return np.lib.stride_tricks.as_strided(
            base, shape=self.shape, strides=strides, writeable=self.storage.flags.writeable)

    def numpy(self) -> np.ndarray:
        """The view's values as a new C-contiguous array."""
        return np.array(self.view(), copy=True, order="C")

    def __repr__(self) -> str:
        return (f"Tensor({self.dtype.short}{list(self.shape)}, strides={list(self.strides)}, "
                f"offset={self.offset}, format={self.format.name}"
                f"{', copied' if self.copied else ''})")


# the slots' own setters, for fields filled in lazily (Tensor.__setattr__ refuses)
_SET_SIGNATURE, _SET_SIGNATURE_ID, _SET_ADDRESS, _SET_EXTENT = (
    _Slots.__dict__[name].__set__ for name in ("_signature", "_signature_id", "_address", "_extent"))
_DTYPES: dict[np.dtype, DataType] = {}


MAX_SIGNATURE_IDS = 1 << 16
_SIGNATURE_IDS = BoundedMemo(MAX_SIGNATURE_IDS)
# (numpy dtype, shape) of a C-contiguous ND array -> (DataType, strides, signature id) of its tensor
_CONTIGUOUS = BoundedMemo(MAX_SIGNATURE_IDS)
_NEXT_ID = itertools.count(1)


def _intern_signature(sig: tuple) -> int:
    """The id of ``sig`` (a new one the first time). Ids are never reused, so two signatures
    never share one; when the table is full it starts afresh (a signature seen before may then
    get a second id, which only costs a cache miss)."""
    got = _SIGNATURE_IDS.get(sig)
    return _SIGNATURE_IDS.put(sig, next(_NEXT_ID)) if got is None else got


_SPANS = BoundedMemo(MAX_SIGNATURE_IDS)  # signature id -> bytes from the first element to past the last


def shape_error(shape: tuple[int, ...]) -> "str | None":
    """Why no tensor has ``shape`` — more than :data:`MAX_RANK` dims, a negative dim, an element
    count no int64_t holds (aclCreateTensor's type) — or None when one can.

    >>> shape_error((2, 3)), shape_error((2, -1))
    (None, 'shape (2, -1) has a negative dim')
    """
    if len(shape) > MAX_RANK:
        return f"shape {shape} has rank {len(shape)} > {MAX_RANK}"
    if any(n < 0 for n in shape):
        return f"shape {shape} has a negative dim"
    if math.prod(shape) > _INT64_MAX:
        return f"shape {shape}: its element count does not fit in an int64_t (aclCreateTensor's)"
    return None


def extent(t: Tensor) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` the tensor's elements span (empty for no elements); kept on
    the tensor, its length per signature.

    >>> a = np.zeros(8, np.float32); t = Tensor(a, (2, 2), (4, 1), offset=1)
    >>> lo, hi = extent(t); lo - a.ctypes.data, hi - lo
    (4, 24)
    """
    got = t._extent
    if got is not None:
        return got
    lo, sid = t.data_address, t.signature_id
    span = _SPANS.get(sid)
    if span is None:
        span = _SPANS.put(sid, 0 if t.numel == 0 else t.storage.itemsize * (
            1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides))))
    _SET_EXTENT(t, (lo, lo + span))
    return lo, lo + span


def overlaps_itself(t: Tensor) -> bool:
    """Whether two of ``t``'s elements may share memory: a stride of 0 on a dimension longer than
    1, or strides that interleave (conservative: dims taken innermost first, each stride must
    step past everything the inner dims span).

    >>> x = np.zeros(6, np.float32)
    >>> overlaps_itself(Tensor(x, (2, 3), (3, 1))), overlaps_itself(Tensor(x, (2, 3), (0, 1)))
    (False, True)
    """
    span = 1  # elements the inner dims span
    for s, n in sorted((s, n) for n, s in zip(t.shape, t.strides) if n > 1):
        if s < span:
            return True
        span = s * (n - 1) + span
    return False


def same_view(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory in the same order and
    dtype (two Tensors over one array, say).

    >>> x = np.zeros(4, np.float32)
    >>> same_view(tensor(x), tensor(x)), same_view(tensor(x[1:]), tensor(x[:3]))
    (True, False)
    """
    return (a.data_address == b.data_address and a.shape == b.shape and a.strides == b.strides
            and a.dtype == b.dtype)


def spans_overlap(spans: Iterable[tuple[int, int]]) -> bool:
    """Whether any two of the byte ranges ``[lo, hi)`` intersect (an empty one intersects none).

    >>> spans_overlap([(0, 8), (8, 16)]), spans_overlap([(0, 9), (8, 16)]), spans_overlap([(4, 4), (0, 8)])
    (False, True, False)
    """
    seen: list[tuple[int, int]] = []
    for lo, hi in spans:
        if lo == hi:
            continue
        if any(lo < hi2 and lo2 < hi for lo2, hi2 in seen):
            return True
        seen.append((lo, hi))
    return False


def virtual_tensor(shape: Sequence[int], dtype: Any, format: "Format | str" = "ND",
                   writeable: bool = True) -> Tensor:
    """A contiguous tensor of ``shape`` over no memory (every element aliases one): only its
    metadata may be used — for recording a graph at sizes that are never run.

    >>> t = virtual_tensor((1000, 1000, 1000), np.float32)   # 4 GB of metadata, 4 bytes of data
    >>> t.shape, t.strides, t.is_contiguous
    ((1000, 1000, 1000), (1000000, 1000, 1), True)
    """
    shape = _ints("shape", shape)
    n = math.prod(shape)
    storage = np.lib.stride_tricks.as_strided(np.zeros(1, np.dtype(dtype)), shape=(n,), strides=(0,),
                                              writeable=writeable)
    view = np.lib.stride_tricks.as_strided(storage, shape=shape, strides=(0,) * len(shape),
                                           writeable=writeable)
    return Tensor._unchecked(storage, shape, row_major_strides(shape), format_of(format), (n,),
                             False, view)


def _wrappable(a: np.ndarray) -> bool:
    """True when ``a``'s memory can be described with element strides ≥ 0 (no copy needed)."""
    return all(s >= 0 and s % a.itemsize == 0 for s in a.strides)


def tensor(array: "np.ndarray | Sequence", format: "Format | str" = "ND", dtype: Any = None) -> Tensor:
    """An aclTensor over a numpy array, sharing its memory when possible.

    A non-contiguous array with non-negative strides (e.g. ``a.T`` or ``a[:, ::2]``) becomes a
    strided view over the same memory. Other arrays (negative strides, strides that are not a
    multiple of the item size, a dtype conversion) are copied and the tensor is marked
    ``copied``: fine as an input, refused as an output. A 0-d array is a rank-0 tensor. A CPU
    torch tensor (any object exporting DLPack) is viewed the same way (:func:`foreign_array`),
    so phase 2 writes into a torch output in place.

    >>> tensor(np.float32(2.5)).shape
    ()
    >>> tensor(np.zeros(4, np.float32)[::-1]).copied
    True
    """
    if type(array) is np.ndarray and dtype is None and (format is Format.ND or format == "ND"):
        # the hot path
        a = array
        if a.flags.c_contiguous:
            key = (a.dtype, a.shape)  # the tensor's metadata follows from these: remembered
            known = _CONTIGUOUS.get(key)
            if known is not None:
                dt, strides, sid = known  # (every tensor's extent is checked in phase 1)
                return Tensor._unchecked(a.reshape(-1), a.shape, strides, Format.ND, a.shape,
                                         False, a.view(), dt, sid, array_address(a))
            if 0 < a.ndim <= MAX_RANK and a.size:
                t = Tensor._unchecked(a.reshape(-1), a.shape, row_major_strides(a.shape),
                                      Format.ND, a.shape, False, a.view(), address=array_address(a))
                _CONTIGUOUS.put(key, (t.dtype, t.strides, t.signature_id))
                return t
    if not isinstance(array, np.ndarray) and hasattr(array, "__dlpack__"):
        return tensor(foreign_array(array), format, dtype)  # a numpy view: the hot path may take it
    a = np.asarray(array, dtype=None if dtype is None else dtype_of(dtype).np)
    # a new array that owns its memory is a copy the caller does not hold (a list, a scalar, a
    # dtype conversion); an array that is the caller's or views other memory is not
    copied = a is not array and a.flags.owndata
    flags = a.flags
    if not flags.c_contiguous and not _wrappable(a):  # C-contiguous: wrappable as it is
        a, copied = np.ascontiguousarray(a), True
        flags = a.flags
    item = a.itemsize
    if a.size == 0:
        return Tensor(np.empty(0, a.dtype), a.shape, row_major_strides(a.shape), 0, format,
                      copied=copied)
    if a.ndim == 0:
        return Tensor(a.reshape(1), (), (), 0, format, storage_shape=(), copied=copied)
    if a.ndim > MAX_RANK:
        raise ValueError(f"shape {a.shape} has rank {a.ndim} > {MAX_RANK}")
    fmt = Format.ND if format == "ND" else format_of(format)
    strides = tuple(s // item for s in a.strides)
    if flags.c_contiguous:  # a flat view, no as_strided, row-major strides
        if 1 in a.shape:  # numpy may give a size-1 dim any stride, even a negative one
            strides = row_major_strides(a.shape)
        return Tensor._unchecked(a.reshape(-1), a.shape, strides, fmt, a.shape, copied, a.view())
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, strides))
    storage = np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(item,),
                                              writeable=a.flags.writeable)
    return Tensor._unchecked(storage, a.shape, strides, fmt, (span,), copied, a.view())
