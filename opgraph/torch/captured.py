"""SyncBatchNorm inside ``opgraph.capture()``: torch.distributed process groups as collective
groups of the program (:class:`TorchGroup`), and the layer's forward and backward emitting
AllGather / AllReduce nodes instead of exchanging at once. The row layout and the single
exchange per direction are those of the eager path, so the program's bits are the eager ones.

In a capture nothing is computed, so what the eager path decides from data is decided when
capturing: every rank's sample count (shapes only) is exchanged once, and every rank must have
data. On one rank the collectives are those of the one-process group (``"local"``: no gloo
exchange, no process group needed), as the eager path skips them. The captured program reads
the layer's parameters and running statistics where they are when it runs, and updates the
running statistics on every replay; ``num_batches_tracked`` counts replays, not the capture
(:func:`opgraph.capture.on_replay`), and ``momentum=None`` (a cumulative average, whose factor
changes every step) is refused.

    >>> import numpy as np
    >>> TorchGroup.__name__, callable(group_of)
    ('TorchGroup', True)
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from opgraph.capture import CaptureError, all_gather, all_reduce
from opgraph.core.collective import register_group
from . import kernels as K

Tensor = torch.Tensor


class TorchGroup:
    """A torch.distributed process group as an opgraph collective group. A gather packs its
    arrays' bytes into one buffer (any dtypes, one exchange); a reduce sums the arrays of each
    dtype packed into one buffer (one exchange per dtype, in the order the dtypes first come:
    one for SyncBatchNorm's float32 sums, as the eager layer makes). bfloat16 travels as torch's
    bfloat16."""

    def __init__(self, pg: Any):
        self.pg = pg
        self.world_size = dist.get_world_size(pg)

    def all_gather(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Each array from every rank, stacked on a new leading rank axis (one gloo all_gather of
        their bytes)."""
        parts = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
        row = torch.from_numpy(np.concatenate(parts))
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        dist.all_gather(rows, row, self.pg)
        table = torch.stack(rows).numpy()  # [world, bytes]
        out, at = [], 0
        for a, part in zip(arrays, parts):
            rows_of_a = np.ascontiguousarray(table[:, at: at + part.size])
            out.append(rows_of_a.view(a.dtype).reshape((self.world_size,) + a.shape))
            at += part.size
        return out

    def all_reduce(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Each array summed over the ranks (one all_reduce per dtype)."""
        out: list[np.ndarray] = [np.empty(0)] * len(arrays)
        by_dtype: dict[np.dtype, list[int]] = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(a.dtype, []).append(i)
        for same in by_dtype.values():
            flat = torch.cat([K.to_torch(np.ascontiguousarray(arrays[i]).reshape(-1))
                              for i in same])
            dist.all_reduce(flat, dist.ReduceOp.SUM, self.pg)
            summed, at = K.as_numpy(flat), 0
            for i in same:
                out[i] = summed[at: at + arrays[i].size].reshape(arrays[i].shape)
                at += arrays[i].size
        return out


def group_of(pg: Any) -> str:
    """The collective-group name of process group ``pg`` (registered on first use):
    ``torch:`` and its global ranks, e.g. ``torch:0,1``."""
    name = "torch:" + ",".join(str(r) for r in dist.get_process_group_ranks(pg))
    return register_group(name, TorchGroup(pg))


def forward(ctx: Any, input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
            running_mean: Optional[Tensor], running_var: Optional[Tensor], eps: float,
            momentum: float, process_group: Any, world_size: int,
            where: dict[str, Any]) -> Tensor:
    """SyncBatchNormFunction.forward in a capture (the arguments already prepared by it)."""
    C = input.shape[1]
    per_channel = input.numel() // C
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.requires_grad and p.dtype != torch.float32:
            raise CaptureError(f"SyncBatchNorm in a capture: {name} is {p.dtype}; its gradient "
                               "is float32 and autograd would convert it outside the program "
                               "(keep the layer's parameters float32, e.g. with autocast)")
    with K.on(**where):
        refused = K.running_stats_refused(running_mean, torch.float32, input.dtype)
    if refused and running_mean is None:  # (a half-precision input on the 950, as eager)
        running_mean, running_var = K.scratch_running_stats(C)
    elif refused:
        raise CaptureError(f"SyncBatchNorm in a capture: running_mean is {running_mean.dtype}; "
                           "the Ascend950's gather keeps running statistics in float32, and "
                           "rounding them back would run outside the program (keep the layer's "
                           "buffers float32)")
    counts = torch.full((1,), per_channel, dtype=torch.float32)
    if world_size > 1:  # one rank: its own count, no process group needed (as the eager path)
        rows = [torch.empty_like(counts) for _ in range(world_size)]
        dist.all_gather(rows, counts, process_group)  # shapes only, once, when capturing
        counts = torch.cat(rows)
    if (counts < 1).any():
        raise CaptureError("SyncBatchNorm in a capture needs data on every rank; ranks "
                           f"{[i for i, c in enumerate(counts.tolist()) if c < 1]} have none")
    # one rank: the exchange returns the rank's own values, as the eager path skips it
    group = group_of(process_group) if world_size > 1 else "local"
    mean, invstd = K.batch_norm_stats(input, eps, **where)
    mean_all, invstd_all = (K.to_torch(a) for a in all_gather(mean, invstd, group=group))
    count = counts.reshape(-1, 1).to(torch.int32)  # backward's, before any rounding (as eager)
    if running_mean is not None and counts.dtype != running_mean.dtype:
        counts = counts.to(running_mean.dtype)
    mean, invstd = K.batch_norm_gather_stats_with_counts(
        input, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts, **where)
    ctx.save_for_backward(input, weight, mean, invstd, count)
    ctx.process_group, ctx.where, ctx.group = process_group, where, group
    return K.batch_norm_elemt(input, weight, bias, mean, invstd, eps, **where)


def backward(ctx: Any, grad_output: Tensor) -> tuple[Optional[Tensor], ...]:
    """SyncBatchNormFunction.backward in a capture."""
    input, weight, mean, invstd, count = ctx.saved_tensors
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_input = None
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = K.batch_norm_backward_reduce(
        grad_output, input, mean, invstd, weight, need_input, need_weight, need_bias, **ctx.where)
    if need_input:
        sum_dy, sum_dy_xmu = (K.to_torch(a) for a in all_reduce(sum_dy, sum_dy_xmu, group=ctx.group))
        # a half-precision (frozen) weight as it is: the op_api widens it in the program, the
        # same bits as torch's weight.to(mean.dtype), which made here would be a copy every
        # replay read
        grad_input = K.batch_norm_backward_elemt(grad_output, input, mean, invstd, weight, sum_dy,
                                                 sum_dy_xmu, count, **ctx.where)
    if weight is None or not need_weight:
        grad_weight = None
    if weight is None or not need_bias:
        grad_bias = None
    return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


__all__ = ["TorchGroup", "backward", "forward", "group_of"]
