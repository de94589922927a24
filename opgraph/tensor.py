"""aclTensor analogs: a strided view (element strides, offset, format) over flat numpy storage.

    >>> import numpy as np
    >>> t = tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    >>> t.shape, t.strides, t.is_contiguous
    ((2, 3), (3, 1), True)
    >>> u = Tensor(t.storage, (3, 2), (1, 3))      # the transpose, sharing memory
    >>> u.numpy().tolist()
    [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .dtypes import DataType, Format, dtype_of, format_of


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


def is_contiguous(shape: Sequence[int], strides: Sequence[int], fmt: Format = Format.ND) -> bool:
    """``op::IsContiguous`` (reference §2.3): private format, ≤ 1 element, or row-major
    strides when dims of size 1 are skipped. The view offset is ignored."""
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


class Tensor:
    """A strided view over a flat 1-D numpy ``storage`` (element strides ≥ 0, element offset).

    Reads go through :meth:`numpy`; kernels that write the tensor (ViewCopy) write into
    ``storage`` and touch only the view's elements.
    """

    __slots__ = ("storage", "shape", "strides", "offset", "format", "storage_shape", "dtype", "_view")

    def __init__(self, storage: np.ndarray, shape: Sequence[int], strides: Sequence[int],
                 offset: int = 0, format: "Format | str" = "ND",
                 storage_shape: "Sequence[int] | None" = None):
        storage = np.asarray(storage)
        if storage.ndim != 1:
            raise ValueError(f"storage must be a flat 1-D array, got shape {storage.shape}")
        # numpy 2 gives 0- and 1-element arrays stride 0, so only check longer storages
        if storage.size > 1 and storage.strides[0] != storage.itemsize:
            raise ValueError("storage must be a contiguous 1-D array")
        shape, strides = tuple(int(n) for n in shape), tuple(int(s) for s in strides)
        if len(shape) != len(strides):
            raise ValueError(f"shape {shape} and strides {strides} have different ranks")
        if any(n < 0 for n in shape):
            raise ValueError(f"shape {shape} has a negative dim")
        if any(s < 0 for s in strides):
            raise ValueError(f"strides {strides} must be >= 0")
        if offset < 0:
            raise ValueError(f"offset {offset} must be >= 0")
        if math.prod(shape) > 0:
            last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
            if last >= storage.size:
                raise ValueError(
                    f"view shape={shape} strides={strides} offset={offset} reaches element {last}, "
                    f"outside storage of {storage.size} elements")
        self.storage = storage
        self.dtype: DataType = dtype_of(storage.dtype)
        self.shape, self.strides, self.offset = shape, strides, int(offset)
        self.format: Format = format_of(format)
        self.storage_shape = tuple(storage_shape) if storage_shape is not None else (storage.size,)

    # --- metadata -------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    dim = ndim

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_empty(self) -> bool:
        return self.numel == 0

    @property
    def is_contiguous(self) -> bool:
        return is_contiguous(self.shape, self.strides, self.format)

    # --- data -----------------------------------------------------------------------------
    def view(self) -> np.ndarray:
        """A live numpy view of the tensor (writes go to ``storage``); built once."""
        try:
            return self._view
        except AttributeError:
            self._view = self._make_view()
            return self._view

    def _make_view(self) -> np.ndarray:
        item = self.storage.itemsize
        base = self.storage[self.offset:] if self.numel else self.storage[:0]
        return np.lib.stride_tricks.as_strided(
            base, shape=self.shape, strides=tuple(s * item for s in self.strides),
            writeable=self.storage.flags.writeable)

    def numpy(self) -> np.ndarray:
        """The view's values as a new C-contiguous array."""
        return np.array(self.view(), copy=True, order="C")

    def __repr__(self) -> str:
        return (f"Tensor({self.dtype.short}{list(self.shape)}, strides={list(self.strides)}, "
                f"offset={self.offset}, format={self.format.name})")


def tensor(array: "np.ndarray | Sequence", format: "Format | str" = "ND", dtype=None) -> Tensor:
    """An aclTensor over a numpy array, sharing its memory when possible.

    A non-contiguous array with non-negative strides (e.g. ``a.T`` or ``a[:, ::2]``) becomes a
    strided view over the same memory; other arrays are copied first.
    """
    a = np.asarray(array, dtype=None if dtype is None else dtype_of(dtype).np)
    item = a.itemsize
    if a.ndim == 0:
        a = np.ascontiguousarray(a)
    if any(s < 0 or s % item for s in a.strides):
        a = np.ascontiguousarray(a)
    strides = tuple(s // item for s in a.strides)
    if a.size == 0:
        return Tensor(np.empty(0, a.dtype), a.shape, row_major_strides(a.shape), 0, format)
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, strides))
    storage = np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(item,),
                                              writeable=a.flags.writeable)
    storage_shape = a.shape if a.flags.c_contiguous else None
    return Tensor(storage, a.shape, strides, 0, format, storage_shape=storage_shape)
