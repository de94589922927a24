"""The Pythonic API: torch's names and argument orders, numpy arrays in and out, ``AclnnError``
on bad input. Each function lives next to its op_api (``opgraph/aclnn/<op_api>.py``).

    >>> import numpy as np
    >>> x = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    >>> c = lambda *v: np.float32(v)
    >>> y = batch_norm_elemt_backward(x, x, c(0, 0), c(1, 1), c(1, 1), c(0, 0), c(1, 1), c(5, 5))
    >>> np.allclose(y, 0.9 * x)
    True
"""
from opgraph.aclnn.batch_norm_elemt_backward import batch_norm_elemt_backward

__all__ = ["batch_norm_elemt_backward"]
