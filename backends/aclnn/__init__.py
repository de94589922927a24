"""The aclnn backend: lower opgraph graphs to real aclnn C API calls.

- :mod:`backends.aclnn.plan` — the JSON-able call plan;
- :mod:`backends.aclnn.lower` — the lowering table and the lowering of a graph to a plan;
- :mod:`backends.aclnn.emit_cpp` — a complete C++ host program from a plan;
- :mod:`backends.aclnn.runtime` — run a plan through ctypes on the CANN libraries
  (registered as backend ``"aclnn"``).

    >>> from backends.aclnn import ACLNN_LOWERINGS
    >>> ACLNN_LOWERINGS.lookup("RealDiv").__name__
    'lower_div'
"""
from .plan import Arg, Call, CallPlan, PlanBuffer, TensorDesc, UserBuffer
from .lower import ACLNN_LOWERINGS, LoweringError, lower, lower_executor

__all__ = ["ACLNN_LOWERINGS", "Arg", "Call", "CallPlan", "LoweringError", "PlanBuffer",
           "TensorDesc", "UserBuffer", "lower", "lower_executor"]
