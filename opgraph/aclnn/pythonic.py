"""What the Pythonic API (``opgraph.ops``) shares: numpy arrays in, numpy arrays out, both phases
run, :class:`AclnnError` raised on any failure (with the op_api's status and message). Each
op_api module defines its torch-named function with these helpers; ``opgraph.ops`` re-exports
them.

    >>> import numpy as np
    >>> as_tensor("x", np.zeros(2, np.float32)).shape
    (2,)
    >>> as_tensor("x", "abc")
    Traceback (most recent call last):
    ...
    opgraph.core.status.AclnnError: ACLNN_ERR_PARAM_INVALID (161002): x: cannot be used as a tensor (str): ...
"""
from __future__ import annotations

from typing import Any, Callable, NoReturn, Optional

import numpy as np

from opgraph.core.dtypes import DataType
from opgraph.core.status import AclnnError, Status
from opgraph.core.tensor import Tensor, tensor
from .twophase import MASK_TYPES, recent_error, wrong_kind


def as_tensor(name: str, x: Any) -> Optional[Tensor]:
    """``x`` as an opgraph Tensor (None stays NULL); anything that is not array-like → 161002."""
    if x is None or isinstance(x, Tensor):
        return x
    try:
        return tensor(x)
    except (TypeError, ValueError) as e:
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"{name}: cannot be used as a tensor ({type(x).__name__}): {e}") from None


def mask(name: str, on: Any) -> bool:
    """An output mask (``input_g`` ...): a bool, or 161002 naming it — before the function
    decides from it which outputs to make (an array's truth value would be ambiguous).

        >>> mask("input_g", np.bool_(True)), mask("bias_g", False)
        (True, False)
    """
    if not isinstance(on, MASK_TYPES):
        raise wrong_kind(name, "a bool", on)
    return bool(on)


def output(name: str, out: Any, shape: tuple[int, ...], dtype: DataType) -> tuple[Any, Tensor]:
    """``(array to return, tensor to pass)`` for an output: ``out`` as given, or a new zeroed
    array (an op_api that writes nothing for an empty input, as the 910B family's do, returns
    zeros, never uninitialised memory)."""
    if out is None:
        out = np.zeros(shape, dtype=dtype.np)
    refuse_masked(name, out)
    t = as_tensor(name, out)
    assert t is not None
    return out, t


def refuse_masked(name: str, out: Any) -> None:
    """161002 for a masked array as output ``name``: its mask would still hide the results.

        >>> refuse_masked("out", np.zeros(2))  # a plain array is fine
    """
    if isinstance(out, np.ma.MaskedArray):
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID,
                         f"{name}: a masked array keeps its mask over the results; pass its "
                         ".data or a plain array")


def result(out: Any, t: Tensor) -> Any:
    """What a Pythonic function returns for an output: the caller's array, or the tensor's values."""
    return out if isinstance(out, np.ndarray) else t.numpy()


def run_op_api(get_workspace_size: Callable[..., Any], run: Callable[..., Any], *args: Any) -> None:
    """Phase 1 and phase 2 on ``args``; AclnnError (the op_api's own) on any failure."""
    status, ws, ex = get_workspace_size(*args)
    if status == Status.ACLNN_SUCCESS:
        status = run(bytearray(ws) if ws else None, ws, ex)
    if status != Status.ACLNN_SUCCESS:
        raise recent_error() or AclnnError(status, "failed without a message")


def refuse_null(get_workspace_size: Callable[..., Any], run: Callable[..., Any],
                *args: Any) -> NoReturn:
    """Phase 1 on ``args`` where a required tensor an output's shape comes from is NULL (the
    outputs passed as NULL too, having no shape): the op_api's own AclnnError, naming the first
    NULL in its own order, in its own words — what the Pythonic API raises for a missing tensor."""
    run_op_api(get_workspace_size, run, *args)
    raise AssertionError(f"{get_workspace_size.__name__} accepted a NULL required tensor")
