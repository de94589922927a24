"""The core layer: dtypes, tensors, status codes, platforms, the IR, the l0-op and op_api
protocols and registries, serialization, memory planning, the pass infrastructure and the
backend protocol and registry. It imports nothing above it (l0ops, passes, op_apis, backends,
CLI); everything else builds on it.

    >>> from opgraph.core import DataType, Graph, TensorType
    >>> Graph("g").add_input("x", TensorType((2,), DataType.FLOAT)).type.nbytes
    8
"""
from .dtypes import DataType, Format, dtype_of, format_of, promote_types
from .status import AclnnError, Status
from .platform import Platform, get_platform, platform, set_platform
from .tensor import Tensor, is_contiguous, tensor
from .types import GraphError, RecordedCall, TensorType
from .opdef import Fidelity, L0Error, OpAttrs, OpDef
from .ir import Graph, Node, Value
from .memory import MemoryPlan, plan_memory
from .backend import Backend, BackendUnavailable, Executable, LoweringTable
from .config import (current_backend, fast_math, get_backend_name, get_fast_math, get_opt_level,
                     opt_level, set_backend, set_fast_math, set_opt_level, use_backend)
from .executor import CompiledProgram, Executor
from .opapi import InputConfig, OpApiSpec, Option, Param, get_op_api, op_apis

__all__ = ["DataType", "Format", "dtype_of", "format_of", "promote_types", "AclnnError", "Status",
           "Platform", "get_platform", "platform", "set_platform", "Tensor", "is_contiguous",
           "tensor", "GraphError", "RecordedCall", "TensorType", "Fidelity", "L0Error", "OpAttrs",
           "OpDef", "Graph", "Node", "Value", "MemoryPlan", "plan_memory", "Backend",
           "BackendUnavailable", "Executable", "LoweringTable", "current_backend",
           "get_backend_name", "get_opt_level", "opt_level", "set_backend", "set_opt_level",
           "fast_math", "get_fast_math", "set_fast_math",
           "use_backend", "CompiledProgram", "Executor", "InputConfig", "OpApiSpec", "Option",
           "Param", "get_op_api", "op_apis"]
