"""Backends: ``numpy`` (the bit-faithful reference), ``native`` (compiled C), ``ascend-sim`` (the
Ascend kernel and tiling, simulated) and ``aclnn`` (real aclnn C API calls). The protocol and the
registry live in :mod:`opgraph.core.backend`; this package re-exports them.

    >>> import backends
    >>> backends.get("numpy").name
    'numpy'
"""
from opgraph.core.backend import (Backend, BackendUnavailable, Executable, LoweringTable, available,
                                  get, names, register, status)

__all__ = ["Backend", "BackendUnavailable", "Executable", "LoweringTable", "available", "get",
           "names", "register", "status"]
