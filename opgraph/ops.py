"""The Pythonic API: numpy arrays in, numpy array out, ``AclnnError`` on bad input.

    >>> import numpy as np
    >>> x = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    >>> c = lambda *v: np.float32(v)
    >>> y = batch_norm_elemt_backward(x, x, c(0, 0), c(1, 1), c(1, 1), c(0, 0), c(1, 1), c(5, 5))
    >>> np.allclose(y, 0.9 * x)
    True
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from opgraph.aclnn.batch_norm_elemt_backward import (aclnnBatchNormElemtBackward,
                                                     aclnnBatchNormElemtBackwardGetWorkspaceSize)
from opgraph.aclnn.twophase import recent_error
from opgraph.core.status import AclnnError, Status
from opgraph.core.tensor import Tensor, tensor


def _as_tensor(name: str, x: Any) -> Optional[Tensor]:
    """``x`` as an opgraph Tensor (None stays NULL); anything that is not array-like → 161002."""
    if x is None or isinstance(x, Tensor):
        return x
    try:
        return tensor(x)
    except (TypeError, ValueError) as e:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"{name}: cannot be used as a tensor ({type(x).__name__}): {e}") from None


def _raise(status: Status) -> None:
    raise recent_error() or AclnnError(status, "failed without a message")


def batch_norm_elemt_backward(grad_out: Any, input: Any, mean: Any, invstd: Any, weight: Any,
                              sum_dy: Any, sum_dy_xmu: Any, counter: Any,
                              out: "np.ndarray | Tensor | None" = None) -> np.ndarray:
    """SyncBatchNorm's element-wise input gradient on numpy arrays (or opgraph Tensors).

    ``out`` (any float dtype, may be a strided view) receives the result; by default a new array
    of input's shape and dtype. Raises :class:`AclnnError` (and writes nothing) on bad input.
    """
    names = ("grad_out", "input", "mean", "invstd", "weight", "sum_dy", "sum_dy_xmu", "counter")
    args = [_as_tensor(n, a) for n, a in zip(names, (grad_out, input, mean, invstd, weight, sum_dy,
                                                      sum_dy_xmu, counter))]
    if out is None:
        if args[1] is None:
            raise AclnnError(Status.ACLNN_ERR_PARAM_NULLPTR, "input: must not be NULL")
        out = np.empty(args[1].shape, dtype=args[1].dtype.np)
    out_t = _as_tensor("out", out)
    status, ws, ex = aclnnBatchNormElemtBackwardGetWorkspaceSize(*args, out_t)
    if status != Status.ACLNN_SUCCESS:
        _raise(status)
    status = aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex)
    if status != Status.ACLNN_SUCCESS:
        _raise(status)
    return out if isinstance(out, np.ndarray) else out_t.numpy()
