"""opgraph for PyTorch (extra ``opgraph[torch]``): SyncBatchNorm on CPU across torch.distributed
processes, with the NPU's arithmetic, and CPU kernels for the five aten primitives it is built
from. ``opgraph.tensor(t)`` views CPU torch tensors without copying (any module can pass them).

    >>> import torch, opgraph.torch as ot
    >>> net = ot.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(4)))
    >>> isinstance(net[0], ot.SyncBatchNorm)
    True
    >>> ot.register_cpu_kernels()                      # idempotent
    >>> torch.batch_norm_stats(torch.ones(2, 4, 3), 1e-5)[0].tolist()
    [1.0, 1.0, 1.0, 1.0]

Multi-process: :func:`run_ranks` spawns N gloo ranks on 127.0.0.1 (or use ``torchrun``);
see ``examples/ddp_syncbn_cpu.py`` and ``opgraph syncbn --ranks 2``.
"""
try:
    import torch  # noqa: F401
except ImportError as e:  # the optional dependency is missing: say what to install
    raise ImportError("opgraph.torch needs PyTorch: pip install 'opgraph[torch]' "
                      "(tested with torch==2.13.0)") from e

from backends.native import team as _native_team
from .kernels import (PRIMITIVES, TorchViews, batch_norm_backward_elemt,
                      batch_norm_backward_reduce, batch_norm_elemt,
                      batch_norm_gather_stats_with_counts, batch_norm_stats, register_cpu_kernels)
from .launch import RankError, free_port, init_gloo, leave_group, run_ranks
from .syncbn import SyncBatchNorm, SyncBatchNormFunction, convert_sync_batchnorm

# torch runs its CPU ops on OpenMP: native kernels share those threads rather than spin
# against them (backends.native.team.share_openmp_if_spinning; a team started later decides
# so itself)
if _native_team.started():
    _native_team.share_openmp_if_spinning()

__all__ = ["PRIMITIVES", "RankError", "SyncBatchNorm", "SyncBatchNormFunction", "TorchViews",
           "batch_norm_backward_elemt", "batch_norm_backward_reduce", "batch_norm_elemt",
           "batch_norm_gather_stats_with_counts", "batch_norm_stats", "convert_sync_batchnorm",
           "free_port", "init_gloo", "leave_group", "register_cpu_kernels", "run_ranks"]
