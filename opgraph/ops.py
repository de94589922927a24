"""The Pythonic API: torch's names and argument orders, numpy arrays in and out, ``AclnnError``
on bad input. Each function lives next to its op_api (``opgraph/aclnn/<op_api>.py``). A call
repeated with arrays of the same metadata runs its compiled program straight from their memory
(:mod:`opgraph.aclnn.direct`: the same program, the same bits, none of phase 1's work).

    >>> import numpy as np
    >>> x = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    >>> c = lambda *v: np.float32(v)
    >>> y = batch_norm_elemt_backward(x, x, c(0, 0), c(1, 1), c(1, 1), c(0, 0), c(1, 1), c(5, 5))
    >>> np.allclose(y, 0.9 * x)
    True

The SyncBatchNorm chain on one process: statistics, the element-wise forward, its gradient.

    >>> x = np.float32([[1, 2], [3, 6]])                        # N = 2, C = 2
    >>> mean, invstd = batch_norm_stats(x, 0.0)
    >>> mean.tolist(), invstd.tolist()
    ([2.0, 4.0], [1.0, 0.5])
    >>> batch_norm_elemt(x, None, None, mean, invstd, 0.0).tolist()
    [[-1.0, -1.0], [1.0, 1.0]]
"""
from opgraph.aclnn.batch_norm_elemt import batch_norm_elemt
from opgraph.aclnn.batch_norm_elemt_backward import batch_norm_elemt_backward
from opgraph.aclnn.batch_norm_gather_stats_with_counts import batch_norm_gather_stats_with_counts
from opgraph.aclnn.batch_norm_reduce import batch_norm_reduce
from opgraph.aclnn.batch_norm_reduce_backward import batch_norm_backward_reduce
from opgraph.aclnn.batch_norm_stats import batch_norm_stats
from opgraph.aclnn.sync_batch_norm_gather_stats import sync_batch_norm_gather_stats

batch_norm_backward_elemt = batch_norm_elemt_backward  # torch's name (round 1 named it as the op_api)

__all__ = ["batch_norm_backward_elemt", "batch_norm_backward_reduce", "batch_norm_elemt",
           "batch_norm_elemt_backward", "batch_norm_gather_stats_with_counts", "batch_norm_reduce",
           "batch_norm_stats", "sync_batch_norm_gather_stats"]
