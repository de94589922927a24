"""opgraph: record, inspect, optimise and run CANN aclnn operator graphs in Python.

    >>> import numpy as np, opgraph
    >>> t = opgraph.tensor(np.zeros((2, 3), np.float16))
    >>> t.dtype, opgraph.get_platform().soc
    (<DataType.FLOAT16: 1>, 'Ascend910B')
"""
from .dtypes import DataType, Format, dtype_of, format_of, promote_types
from .status import AclnnError, Status
from .platform import Platform, get_platform, platform, set_platform
from .tensor import Tensor, is_contiguous, tensor
from .ir import Graph, GraphError, Node, TensorType, Value
from .executor import Executor
from .config import (get_backend_name, get_opt_level, opt_level, set_backend, set_opt_level,
                     use_backend)
import l0ops as _l0ops  # noqa: F401,E402  (registers the l0 ops)

_LAZY = ("aclnn", "ops", "passes", "serialize", "memory", "cli")


def __getattr__(name: str):
    """Submodules that import l0ops are loaded on first use (avoids an import cycle)."""
    if name in _LAZY:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'opgraph' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "DataType", "Format", "dtype_of", "format_of", "promote_types", "AclnnError", "Status",
    "Platform", "get_platform", "platform", "set_platform", "Tensor", "is_contiguous", "tensor",
    "Graph", "GraphError", "Node", "TensorType", "Value", "Executor", "get_backend_name",
    "get_opt_level", "opt_level", "set_backend", "set_opt_level", "use_backend", "aclnn", "ops",
    "passes", "__version__",
]
