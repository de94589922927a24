"""opgraph: record, inspect, optimise and run CANN aclnn operator graphs in Python.

    >>> import numpy as np, opgraph
    >>> t = opgraph.tensor(np.zeros((2, 3), np.float16))
    >>> t.dtype, opgraph.get_platform().soc
    (<DataType.FLOAT16: 1>, 'Ascend910B')

The package is built in layers that import one way (see README "Architecture"):
``opgraph.core`` ← ``l0ops`` ← ``opgraph.passes`` ← ``opgraph.aclnn`` (op_apis) and
``opgraph.ops`` ← ``backends`` ← ``opgraph.cli`` / ``opgraph.torch``. This module only
re-exports the public names, loading the layers in that order.
"""
from .core import (AclnnError, Backend, BackendUnavailable, DataType, Executor, Format, Graph,
                   GraphError, Node, Platform, Status, Tensor, TensorType, Value, dtype_of,
                   fast_math, format_of, get_backend_name, get_fast_math, get_opt_level,
                   get_platform, is_contiguous, opt_level, platform, promote_types, set_backend,
                   set_fast_math, set_opt_level, set_platform, tensor, use_backend)
import l0ops  # noqa: E402,F401  (registers the l0 ops)
from . import passes, aclnn, ops, testing  # noqa: E402
from .capture import Program, capture  # noqa: E402  (the function shadows the package name)

__version__ = "0.2.0"

__all__ = [
    "DataType", "Format", "dtype_of", "format_of", "promote_types", "AclnnError", "Status",
    "Platform", "get_platform", "platform", "set_platform", "Tensor", "is_contiguous", "tensor",
    "Graph", "GraphError", "Node", "TensorType", "Value", "Executor", "Backend",
    "BackendUnavailable", "get_backend_name", "get_opt_level", "opt_level", "set_backend",
    "set_opt_level", "use_backend", "fast_math", "get_fast_math", "set_fast_math", "aclnn", "ops",
    "passes", "testing", "capture", "Program", "__version__",
]
