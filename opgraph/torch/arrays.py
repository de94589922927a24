"""CPU torch tensors and numpy arrays as each other, sharing memory (bfloat16, which numpy
lacks, through 16-bit words as ml_dtypes' bfloat16).

    >>> t = to_torch(as_numpy(torch.arange(3.)))
    >>> t.tolist(), t.dtype
    ([0.0, 1.0, 2.0], torch.float32)
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from opgraph.core.dtypes import DataType

Tensor = torch.Tensor
_BF16 = DataType.BF16.np
# torch dtypes by numpy dtype name (ml_dtypes' bfloat16 is named so too): the floating dtypes
# the SyncBatchNorm family computes in
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def as_numpy(t: Any) -> Any:
    """A CPU torch tensor as a numpy array sharing its memory (``Tensor.numpy()`` on the
    detached tensor; bfloat16 through its 16-bit words) — a few µs, where DLPack costs tens;
    anything else (None, arrays, tensors on other devices: opgraph names the device; a sparse or
    MKL-DNN tensor, one with its negative or conjugate bit set: opgraph refuses it, naming the
    argument) unchanged.

    >>> a = as_numpy(torch.ones(2, 3, dtype=torch.bfloat16).t())
    >>> a.dtype.name, a.shape, a.strides
    ('bfloat16', (3, 2), (2, 6))
    """
    if not isinstance(t, Tensor) or not t.is_cpu:
        return t
    if t.requires_grad:
        t = t.detach()
    try:
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(_BF16)
        return t.numpy()
    except (TypeError, RuntimeError):  # not a strided tensor numpy can view as it is
        return t


def to_torch(a: Optional[np.ndarray]) -> Optional[Tensor]:
    """A numpy result as a torch tensor sharing its memory, its shape and strides kept (a 0-d
    array too; bfloat16 through 16-bit words); copied only where torch cannot view it (negative
    strides).

    >>> a = np.zeros((2, 3), np.float32)
    >>> t = to_torch(a.T)
    >>> t.shape, t.stride(), t.data_ptr() == a.ctypes.data, to_torch(np.float32(2)).shape
    (torch.Size([3, 2]), (1, 3), True, torch.Size([]))
    """
    if a is None or isinstance(a, Tensor):
        return a
    a = np.asarray(a)
    bf16 = a.dtype == _BF16
    words = a.view(np.int16) if bf16 else a
    try:
        t = torch.from_numpy(words)
    except ValueError:  # negative strides: torch has none
        t = torch.from_numpy(words.copy())
    return t.view(torch.bfloat16) if bf16 else t


__all__ = ["DTYPES", "as_numpy", "to_torch"]
