"""One SyncBatchNorm forward and backward across N gloo processes, compared with single-process
batch norm on the whole batch (what ``opgraph syncbn`` prints).

The batch is split over the ranks as ``torch.tensor_split`` does (uneven; a rank may get one
sample or none). The reference is ``F.batch_norm`` in float32 on the same (rounded) inputs;
weight and bias gradients are summed over the ranks, as DDP would.

    >>> split_sizes(5, 3), split_sizes(1, 3)
    ([2, 2, 1], [1, 0, 0])
"""
from __future__ import annotations

import math
import time
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from .arrays import DTYPES
from .launch import RankError, run_ranks
from .syncbn import SyncBatchNorm

QUANTITIES = ("output", "running_mean", "running_var", "grad_input", "grad_weight", "grad_bias")


def split_sizes(n: int, parts: int) -> list[int]:
    """The batch sizes of ``torch.tensor_split`` of ``n`` samples into ``parts``."""
    return [len(c) for c in torch.arange(n).tensor_split(parts)]


def make_case(shape: Sequence[int], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Input, output gradient (``dtype``), weight and bias (float32), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    x = torch.randn(*shape, generator=g) * 2 + 0.5
    return {"input": x.to(dtype), "grad": torch.randn(*shape, generator=g).to(dtype),
            "weight": torch.rand(C, generator=g) + 0.5, "bias": torch.randn(C, generator=g)}


def _rank(rank: int, world_size: int, shape: Sequence[int], dtype: str, seed: int,
          backend: Optional[str], platform: Optional[str] = None) -> dict[str, Any]:
    """One rank: SyncBatchNorm on its shard, forward and backward, timed."""
    case = make_case(shape, DTYPES[dtype], seed)
    x = case["input"].tensor_split(world_size)[rank].clone().requires_grad_()
    dy = case["grad"].tensor_split(world_size)[rank]
    bn = SyncBatchNorm(shape[1], backend=backend, platform=platform)
    with torch.no_grad():
        bn.weight.copy_(case["weight"])
        bn.bias.copy_(case["bias"])
    t0 = time.perf_counter()
    y = bn(x)
    t1 = time.perf_counter()
    y.backward(dy)
    t2 = time.perf_counter()
    return {"output": y.detach(), "grad_input": x.grad, "grad_weight": bn.weight.grad,
            "grad_bias": bn.bias.grad, "running_mean": bn.running_mean,
            "running_var": bn.running_var, "forward_s": t1 - t0, "backward_s": t2 - t1}


def reference(shape: Sequence[int], dtype: str, seed: int) -> dict[str, torch.Tensor]:
    """Single-process batch norm (float32) on the whole batch: outputs, running stats, grads."""
    case = make_case(shape, DTYPES[dtype], seed)
    x = case["input"].float().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    b = case["bias"].clone().requires_grad_()
    rm, rv = torch.zeros(shape[1]), torch.ones(shape[1])
    y = F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
    y.backward(case["grad"].float())
    return {"output": y.detach(), "grad_input": x.grad, "grad_weight": w.grad,
            "grad_bias": b.grad, "running_mean": rm, "running_var": rv}


def gather(results: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The ranks' results as one: outputs and input grads concatenated over the batch, running
    stats from rank 0, weight/bias grads summed over the ranks that have them."""
    out = {k: torch.cat([r[k] for r in results if r[k] is not None])  # empty ranks: no grad
           for k in ("output", "grad_input")}
    out.update({k: results[0][k] for k in ("running_mean", "running_var")})
    for k in ("grad_weight", "grad_bias"):
        out[k] = sum(r[k] for r in results if r[k] is not None)
    return out


def errors(got: dict[str, torch.Tensor],
           want: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """(max abs error, max abs error / max |reference|) per quantity, in float64."""
    errs = {}
    for k in QUANTITIES:
        a, b = got[k].double(), want[k].double()
        abs_err = float((a - b).abs().max()) if a.numel() else 0.0
        scale = float(b.abs().max()) if b.numel() else 0.0
        errs[k] = (abs_err, abs_err / scale if scale else abs_err)
    return errs


def compare(world_size: int, shape: Sequence[int], dtype: str = "float32", *, seed: int = 0,
            backend: Optional[str] = None, platform: Optional[str] = None,
            timeout: float = 120.0) -> dict[str, Any]:
    """Run :func:`_rank` on ``world_size`` processes; the errors against :func:`reference`,
    the batch sizes, and rank 0's forward/backward times."""
    if len(shape) < 2 or shape[1] < 1 or math.prod(shape) == 0:
        raise ValueError(f"shape {list(shape)}: expected N,C,... with N >= 1 and C >= 1")
    results = run_ranks(_rank, world_size, (tuple(shape), dtype, seed, backend, platform),
                        timeout=timeout)
    return {"errors": errors(gather(results), reference(shape, dtype, seed)),
            "sizes": split_sizes(shape[0], world_size),
            "forward_s": results[0]["forward_s"], "backward_s": results[0]["backward_s"]}


__all__ = ["DTYPES", "QUANTITIES", "RankError", "compare", "errors", "gather", "make_case",
           "reference", "split_sizes"]
