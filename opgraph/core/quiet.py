"""numpy's floating-point warnings off around a run, cheaply: the NPU computes the IEEE result
(inf, NaN) of a division by zero or an overflow and does not warn, so neither do the numpy
parts of opgraph's backends.

``with np.errstate(all="ignore")`` does this, but on numpy 2 an entry costs ~0.9 µs (a Python
object, its checks, then the context variable), which is 4% of a cached small call on the numpy
backend. :func:`silence` sets numpy's error-state context variable directly (~0.3 µs with
:func:`restore`), keeping the caller's other settings (``bufsize``, ``errcall``) as errstate
does. On a numpy without that variable (1.x) it enters an ``np.errstate`` instead. Both are
per thread and nest, as ``np.errstate`` is and does.

    >>> import numpy as np
    >>> token = silence()
    >>> try:
    ...     print(np.float32(1) / np.float32(0), np.geterr()["divide"])
    ... finally:
    ...     restore(token)
    inf ignore
    >>> np.geterr()["divide"]   # the caller's setting again
    'warn'
"""
from __future__ import annotations

from typing import Any

import numpy as np

try:  # numpy 2: the error state is a context variable holding an "extobj"
    from numpy._core._ufunc_config import _extobj_contextvar
    from numpy._core.umath import _make_extobj
except ImportError:  # numpy 1.x: np.errstate itself (numpy's public way)
    _extobj_contextvar = _make_extobj = None


def silence() -> Any:
    """Turn every floating-point warning off in this thread; returns the token
    :func:`restore` takes (call it in a ``finally``)."""
    if _extobj_contextvar is None:
        state = np.errstate(all="ignore")
        state.__enter__()
        return state
    return _extobj_contextvar.set(_make_extobj(all="ignore"))


def restore(token: Any) -> None:
    """The error state as it was before :func:`silence` returned ``token``."""
    if _extobj_contextvar is None:
        token.__exit__(None, None, None)
    else:
        _extobj_contextvar.reset(token)


__all__ = ["restore", "silence"]
