"""Direct calls on torch tensors (:mod:`opgraph.aclnn.direct`, whose rules they follow): an
op_api call on CPU torch tensors (and numpy arrays) whose every argument has the metadata of a
call seen before runs its compiled program straight from the tensors' memory, its outputs new
torch tensors of the layouts phase 1 gave them. A tensor off the CPU, with its negative bit
set or a ZeroTensor (no memory) is never keyed.

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

import functools
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np
import torch

from opgraph.aclnn.direct import Arrays, DirectCalls
from opgraph.core.dtypes import DataType
from opgraph.core.tensor import array_address
from .arrays import DTYPES, as_numpy

Tensor = torch.Tensor


def address_of(x: Any) -> int:
    """A CPU torch tensor's or numpy array's first element's address.

    >>> t = torch.zeros(2, 3)
    >>> address_of(t[1]) - address_of(t) == 3 * t.element_size()
    True
    """
    return x.data_ptr() if isinstance(x, Tensor) else array_address(x)


class TorchBound:
    """A torch tensor or numpy array as the executable reads a binding (``data_address``,
    ``view()``): the protocol :class:`opgraph.core.backend.Addressed`."""

    __slots__ = ("x", "data_address")

    def __init__(self, x: Any) -> None:
        self.x = x
        self.data_address = address_of(x)

    def view(self) -> np.ndarray:
        """A numpy array over the tensor's memory (bfloat16 through ml_dtypes)."""
        return as_numpy(self.x)


class TorchArrays(Arrays):
    """CPU torch tensors, and numpy arrays as :class:`~opgraph.aclnn.direct.Arrays` reads them;
    new outputs are torch tensors (:func:`torch.empty_strided`)."""

    kinds = (Tensor, np.ndarray)
    bound = TorchBound
    address = staticmethod(address_of)

    def metadata(self, a: Any) -> Optional[Hashable]:
        """A torch tensor's or numpy array's dtype, shape and strides (None: a subclass of
        ndarray, as in :class:`~opgraph.aclnn.direct.Arrays`; a torch tensor off the CPU, not
        strided (sparse, MKL-DNN), with its negative bit set or a ZeroTensor — memory that
        does not hold its values; a conjugate view is of a complex dtype, never learnt)."""
        if isinstance(a, np.ndarray):  # (a subclass has no is_cpu: it raised AttributeError)
            return super().metadata(a)
        if not a.is_cpu or a.layout is not _STRIDED or a.is_neg() or a._is_zerotensor():
            return None
        return a.dtype, a.shape, a.stride()

    def span(self, a: Any) -> tuple[int, int]:
        """A numpy array's ``byte_bounds``, or a torch tensor's bytes from its first element
        and its strides (never negative in torch)."""
        if type(a) is np.ndarray:
            return super().span(a)
        lo = a.data_ptr()
        if a.is_contiguous():  # (the common case)
            return lo, lo + a.nbytes
        if a.numel() == 0:
            return lo, lo
        return lo, lo + a.element_size() * (1 + sum((n - 1) * s for n, s in zip(a.shape, a.stride())))

    def writable(self, a: Any) -> bool:
        """True for a torch tensor (its memory is always writable), else numpy's flag."""
        return True if isinstance(a, Tensor) else super().writable(a)

    def maker(self, shape: tuple[int, ...], strides: tuple[int, ...],
              dtype: DataType) -> Optional[Callable[[], Tensor]]:
        """What makes a new uninitialised torch tensor of ``shape``, element ``strides`` and
        ``dtype``; None for a dtype torch cannot hold."""
        d = DTYPES.get(dtype.np.name)
        return None if d is None else functools.partial(_EMPTY, shape, strides, dtype=d)


_STRIDED = torch.strided
_EMPTY = torch.empty_strided  # (a test fills the outputs with NaN instead: every one is written)
TORCH = TorchArrays()
DIRECT_CALLS = DirectCalls(TORCH)


def call_key(name: str, args: Sequence[Any]) -> Optional[tuple]:
    """:meth:`DirectCalls.key` for torch tensors and numpy arrays.

    >>> x = torch.zeros(2, 3)
    >>> call_key("op", (x, None, x, 0.5))[4:]
    (None, ('=', 0), (<class 'float'>, 0.5, 1.0))
    """
    return DIRECT_CALLS.key(name, args)


__all__ = ["DIRECT_CALLS", "TORCH", "TorchArrays", "TorchBound", "address_of", "call_key"]
