"""SyncBatchNorm on CPU tensors across torch.distributed processes: torch's algorithm (reference
syncbn-family.md §8) with each primitive one op_api call (:mod:`opgraph.torch.kernels`).

Forward per rank: batch_norm_stats → all_gather of [mean, invstd, count] → drop ranks with
count < 1 → batch_norm_gather_stats_with_counts (running stats updated in place) →
batch_norm_elemt. Backward: batch_norm_backward_reduce → all_reduce of [sum_dy, sum_dy_xmu] →
batch_norm_backward_elemt. On a one-rank group the collectives, which would return the rank's
own values, are skipped. Without an initialised process group, with one rank, or in eval mode
it is ordinary batch norm (``F.batch_norm``), as in torch — but in an ``opgraph.capture()``,
which records only op_api calls, a one-rank training step takes the op_apis (their exchanges
local) and eval mode is refused, as is a backward outside the capture of its forward. Two
differences: an empty rank sends float32 zeros, the dtype the other ranks' statistics have
(torch sends the input's dtype, which gloo cannot gather together with float32 rows when the
input is half precision); and where the gather refuses half-precision running stats (the
Ascend950's, 561103) they are updated in float32 copies and rounded back (and where it refuses
none next to a half-precision input, 561002, it gets float32 ones whose update is dropped).

    >>> import torch
    >>> bn = SyncBatchNorm(3)
    >>> sorted(bn.state_dict())
    ['bias', 'num_batches_tracked', 'running_mean', 'running_var', 'weight']
    >>> y = bn(torch.randn(4, 3, 2, 2))           # no process group: plain batch norm
    >>> int(bn.num_batches_tracked)
    1
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from opgraph.capture import (CaptureError, active as capturing, current as current_capture,
                              on_replay)
from opgraph.core.config import BackendRef, fast_math, get_fast_math
from . import captured, kernels as K
from .kernels import PlatformRef

Tensor = torch.Tensor
# batch_norm_stats' mean/invstd are float32 for every input dtype (torch_npu allocates them so),
# and so are the rows every rank contributes to the gather, an empty rank's included
STATS_DTYPE = torch.float32


# why a backward is refused where its forward did not run: [forward captured, forward eager]
_SPLIT_STEP = ("SyncBatchNorm's forward was captured in an opgraph.capture() block and its "
               "backward runs outside it (or in another one): the captured forward computed "
               "nothing, its statistics are the program's; capture the forward and the backward "
               "in one block",
               "SyncBatchNorm's forward ran eagerly and its backward runs in an opgraph.capture() "
               "block: its exchange would run now, when capturing, not in the program; capture "
               "the forward and the backward in one block")


def _keep_layout(t: Tensor) -> Tensor:
    """``t`` contiguous in its layout (channels_last(-3d) kept, PTF:39-45)."""
    return t.contiguous(memory_format=K.memory_format(t))


class SyncBatchNormFunction(torch.autograd.Function):
    """The autograd function of :class:`SyncBatchNorm` (one call per rank and step).

    ``apply(input, weight, bias, running_mean, running_var, eps, momentum, process_group,
    world_size, where)``; ``where`` = ``{"backend": ..., "platform": ...}`` for the op_apis
    (see :func:`opgraph.torch.kernels.on`; ``{}``: the current ones). The backward keeps the
    forward's backend, platform and :func:`opgraph.fast_math` setting (``loss.backward()`` may
    run outside their blocks).
    """

    @staticmethod
    @K.eager_under_compile
    def forward(ctx: Any, input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                running_mean: Optional[Tensor], running_var: Optional[Tensor], eps: float,
                momentum: float, process_group: Any, world_size: int,
                where: Optional[dict[str, Any]] = None) -> Tensor:
        """The normalised input: per-rank statistics (BatchNormStats), gathered over the group
        (GatherStatsWithCounts updates the running stats), then BatchNormElemt."""
        where = where or {}
        per_channel = input.numel() // input.shape[1]
        if per_channel == 1 and world_size < 2:
            raise ValueError("Expected more than 1 value per channel when training, got input "
                             f"size {per_channel}")
        step = K.pinned(**where)  # the backward's op_apis run where the forward's ran
        K.check_input_dtype(input.dtype, step["platform"])  # on every rank, before any exchange
        K.check_parameter_dtypes(weight=weight, bias=bias, running_mean=running_mean,
                                 running_var=running_var)
        ctx.capture = current_capture()  # the backward must run in the same one (or none)
        if ctx.capture is not None:  # opgraph.capture(): collectives become nodes of the program
            # the caller's tensors as they are (the op_apis' Contiguous is in the program): a
            # copy made now would be what every replay reads
            return captured.forward(ctx, input, weight, bias, running_mean, running_var, eps,
                                    momentum, process_group, world_size, step)
        input = _keep_layout(input)
        weight = weight.contiguous() if weight is not None else None
        ctx.process_group, ctx.where, ctx.world_size = process_group, step, world_size
        ctx.fast_math = get_fast_math()
        with K.on(**where):  # once for the step's op_apis
            return SyncBatchNormFunction._forward(ctx, input, weight, bias, running_mean,
                                                  running_var, eps, momentum)

    @staticmethod
    def _forward(ctx: Any, input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                 running_mean: Optional[Tensor], running_var: Optional[Tensor], eps: float,
                 momentum: float) -> Tensor:
        C, process_group, world_size = input.shape[1], ctx.process_group, ctx.world_size
        per_channel = input.numel() // C
        views = ctx.views = K.TorchViews()  # each tensor viewed once, backward included
        # the per-channel bookkeeping in numpy: a torch op on C values costs several µs
        if input.numel() > 0:
            mean, invstd = K.batch_norm_stats(input, eps, views=views)
            row = np.concatenate([K.as_numpy(mean), K.as_numpy(invstd),
                                  np.full(1, per_channel, np.float32)])
        else:  # an empty rank still takes part in the gather, with count 0 (dropped below)
            row = np.zeros(2 * C + 1, np.float32)
        if world_size > 1:
            rows = [torch.empty(2 * C + 1, dtype=STATS_DTYPE) for _ in range(world_size)]
            dist.all_gather(rows, torch.from_numpy(row), process_group)
            table = torch.stack(rows).numpy()
        else:  # one rank: the gather would return its own row
            table = row[None]
        if table[:, 2 * C].min() < 1:  # ranks with data only (a test costs a third of a mask)
            table = table[table[:, 2 * C] >= 1]
        mean_all, invstd_all, count_all = table[:, :C], table[:, C:2 * C], table[:, 2 * C:]
        counts = count_all.reshape(-1)
        if running_mean is not None and running_mean.dtype != STATS_DTYPE:  # torch's rounding
            counts = K.as_numpy(torch.from_numpy(counts).to(running_mean.dtype))
        if len(table):
            # a half-precision model's running stats where the op refuses them (the 950):
            # updated in float32 copies, then rounded back as torch's kernels store them; none
            # with a half-precision input there: float32 ones, updated and dropped
            widen = K.running_stats_refused(running_mean, STATS_DTYPE, input.dtype)
            rm, rv = running_mean, running_var
            if widen and running_mean is None:
                rm, rv = K.scratch_running_stats(C)
            elif widen:
                rm, rv = running_mean.float(), None if running_var is None else running_var.float()
            mean, invstd = K.batch_norm_gather_stats_with_counts(
                input, mean_all, invstd_all, rm, rv, momentum, eps, counts, views=views)
            if widen and running_mean is not None:
                running_mean.copy_(rm)
                if running_var is not None:
                    running_var.copy_(rv)
        else:  # no rank has data: nothing to normalise, running stats untouched
            mean = invstd = torch.zeros(C, dtype=STATS_DTYPE)
        ctx.count = count_all.astype(np.int32)  # per rank, as batch_norm_backward_elemt takes it
        ctx.save_for_backward(input, weight, mean, invstd)
        if input.numel() == 0:
            return torch.empty_like(input)
        return K.batch_norm_elemt(input, weight, bias, mean, invstd, eps, views=views)

    @staticmethod
    @K.eager_under_compile
    @once_differentiable  # its gradients are not differentiable: a second backward says so
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Optional[Tensor], ...]:
        """The input, weight and bias gradients: per-rank sums (BatchNormReduceBackward), summed
        over the group, then BatchNormElemtBackward; None for the other arguments."""
        if current_capture() is not ctx.capture:
            raise CaptureError(_SPLIT_STEP[ctx.capture is None])
        if ctx.capture is not None:  # (grad_output as it is, as the forward's input)
            return captured.backward(ctx, grad_output)
        grad_output = _keep_layout(grad_output)
        with K.on(**ctx.where), fast_math(ctx.fast_math):  # once for the step's op_apis
            return SyncBatchNormFunction._backward(ctx, grad_output)

    @staticmethod
    def _backward(ctx: Any, grad_output: Tensor) -> tuple[Optional[Tensor], ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        # the forward's views, released as autograd releases the saved tensors: a graph kept
        # after its backward (``loss`` kept until the next step) must not keep the activations
        views, ctx.views = ctx.views, None
        views = views or K.TorchViews()  # (a second backward, retain_graph=True: views afresh)
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_input = grad_weight = grad_bias = None
        C = input.shape[1]
        if input.numel() > 0:
            sum_dy, sum_dy_xmu, grad_weight, grad_bias = K.batch_norm_backward_reduce(
                grad_output, input, mean, invstd, weight, need_input, need_weight, need_bias,
                views=views)
            if need_input:
                if ctx.world_size > 1:  # one rank: the sum over ranks is its own
                    sums = torch.cat([sum_dy, sum_dy_xmu])
                    dist.all_reduce(sums, dist.ReduceOp.SUM, ctx.process_group)
                    sum_dy, sum_dy_xmu = sums[:C], sums[C:]
                if weight is not None and weight.dtype != mean.dtype:
                    weight = weight.to(mean.dtype)
                grad_input = K.batch_norm_backward_elemt(
                    grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, ctx.count,
                    views=views)
            if weight is None or not need_weight:
                grad_weight = None
            if weight is None or not need_bias:
                grad_bias = None
        elif need_input and ctx.world_size > 1:  # take part so that the peers are not blocked
            dist.all_reduce(torch.zeros(2 * C, dtype=mean.dtype), dist.ReduceOp.SUM,
                            ctx.process_group)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """A drop-in for ``torch.nn.SyncBatchNorm`` that runs on CPU (gloo): same arguments,
    state-dict keys, ``momentum=None`` cumulative average and eval behaviour. Keyword only:
    ``backend``, the opgraph backend of its op_apis, and ``platform``, their SoC (bfloat16
    inputs need ``"Ascend950"``); None: the ones current at each call.

    >>> SyncBatchNorm(8, momentum=None, backend="native", platform="Ascend950")
    SyncBatchNorm(8, eps=1e-05, momentum=None, ..., backend=native, platform=Ascend950)
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, device: Any = None, dtype: Any = None, *,
                 bias: bool = True, backend: Optional[BackendRef] = None,
                 platform: PlatformRef = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, bias=bias)
        with K.on(backend, platform):  # an unknown backend or platform fails here, not at a step
            pass
        self.process_group = process_group
        self.backend, self.platform = backend, platform

    def extra_repr(self) -> str:
        """BatchNorm's repr, plus the backend and platform when set."""
        where = (("backend", self.backend), ("platform", self.platform))
        extra = [f"{k}={getattr(v, 'name', getattr(v, 'soc', v))}"
                 for k, v in where if v is not None]
        return ", ".join([super().extra_repr(), *extra])

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def forward(self, input: Tensor) -> Tensor:
        """SyncBatchNorm over the process group in training (torch's algorithm), batch norm with
        the running stats in eval, as ``torch.nn.SyncBatchNorm``."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        world_size = self._world_size() if bn_training and self.training else 1
        in_capture = capturing()
        if in_capture and not self.training:  # (before anything moves)
            raise CaptureError("SyncBatchNorm in eval mode in a capture: that is torch's "
                               "F.batch_norm, which a capture does not record (its replays "
                               "would skip the layer); capture a training step")
        if self.training and self.track_running_stats:
            if in_capture:  # a step of the program: counted on every replay
                if self.momentum is None:
                    raise CaptureError("SyncBatchNorm(momentum=None) in a capture: its cumulative "
                                       "average takes 1/num_batches_tracked afresh every step, "
                                       "which a captured program would fix; give a momentum")
                on_replay(functools.partial(self.num_batches_tracked.add_, 1))
            else:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:  # cumulative moving average
                    factor = 1.0 / float(self.num_batches_tracked)
        if world_size < 2 and not in_capture:  # (captured: the op_apis, their exchanges local)
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, factor, self.eps)
        if input.device.type != "cpu":
            raise ValueError(f"opgraph.torch.SyncBatchNorm runs on CPU tensors, got one on "
                             f"{input.device} (use torch.nn.SyncBatchNorm there)")
        return SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                           running_var, self.eps, factor, self._group(),
                                           world_size,
                                           {"backend": self.backend, "platform": self.platform})

    def _group(self) -> Any:
        return self.process_group or dist.group.WORLD

    def _world_size(self) -> int:
        """The ranks to synchronise with: 1 without an initialised process group."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self._group())

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Any = None, *,
                               backend: Optional[BackendRef] = None,
                               platform: PlatformRef = None) -> torch.nn.Module:
        """See :func:`convert_sync_batchnorm`."""
        return convert_sync_batchnorm(module, process_group, backend=backend, platform=platform)


def convert_sync_batchnorm(module: torch.nn.Module, process_group: Any = None, *,
                           backend: Optional[BackendRef] = None,
                           platform: PlatformRef = None) -> torch.nn.Module:
    """``module`` with every ``BatchNorm*d`` (any ``_BatchNorm``, torch's SyncBatchNorm
    included) replaced by an opgraph :class:`SyncBatchNorm` sharing its parameters, running
    stats and ``num_batches_tracked``, with the same training flag (and qconfig); an opgraph
    SyncBatchNorm keeps its ``backend`` and ``platform`` unless others are given.

    >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    >>> type(convert_sync_batchnorm(net)[1]).__name__
    'SyncBatchNorm'
    """
    out = module
    if isinstance(module, _BatchNorm):
        if isinstance(module, SyncBatchNorm):  # re-converted: its own unless others are given
            backend = module.backend if backend is None else backend
            platform = module.platform if platform is None else platform
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group,
                            bias=module.bias is not None, backend=backend, platform=platform)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group, backend=backend,
                                                    platform=platform))
    return out


__all__ = ["STATS_DTYPE", "SyncBatchNorm", "SyncBatchNormFunction", "convert_sync_batchnorm"]
