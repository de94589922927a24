"""The aclnn backend: lower opgraph graphs to real aclnn C API calls.

- :mod:`backends.aclnn.plan` — the lowering to a JSON-able call plan;
- :mod:`backends.aclnn.emit_cpp` — a complete C++ host program from a plan;
- :mod:`backends.aclnn.runtime` — run a plan through ctypes on the CANN libraries
  (registered as backend ``"aclnn"``).

    >>> from backends.aclnn import LOWERINGS
    >>> LOWERINGS["RealDiv"].__name__
    'lower_div'
"""
from .plan import (LOWERINGS, Arg, Call, CallPlan, LoweringError, TensorDesc, UserBuffer, lower,
                   lower_executor)

__all__ = ["LOWERINGS", "Arg", "Call", "CallPlan", "LoweringError", "TensorDesc", "UserBuffer",
           "lower", "lower_executor"]
