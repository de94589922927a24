"""opgraph.torch.SyncBatchNorm's autograd function on a one-rank gloo group with the native
backend: no collective is made (they would return the rank's own values), the bits are the numpy
backend's (which runs the family's reductions in l0ops.ordered's order), and the result is
torch's batch norm within the fp32 bound — contiguous and channels_last inputs."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")

import torch.distributed as dist  # noqa: E402

from backends import native  # noqa: E402
from opgraph.torch import SyncBatchNormFunction, run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])
FP32_BOUND = 2e-6
SHAPE = (6, 5, 40, 33)  # 7920 values per channel: the C kernels run (not numpy's small path)


def _step(backend: str, channels_last: bool) -> list[np.ndarray]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SHAPE, generator=g) * 2 + 0.5
    dy = torch.randn(SHAPE, generator=g)
    if channels_last:
        x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
    C = SHAPE[1]
    w = (torch.rand(C, generator=g) + 0.5).requires_grad_()
    b = torch.randn(C, generator=g).requires_grad_()
    rm, rv = torch.zeros(C), torch.ones(C)
    xi = x.clone().requires_grad_()
    y = SyncBatchNormFunction.apply(xi, w, b, rm, rv, 1e-5, 0.1, dist.group.WORLD, 1,
                                    {"backend": backend})
    y.backward(dy)
    return [t.detach().numpy().copy() for t in (y, xi.grad, w.grad, b.grad, rm, rv)]


def one_rank(rank: int, world: int) -> dict:
    def refuse(*args, **kwargs):
        raise AssertionError("a collective on a one-rank group")
    dist.all_gather, dist.all_reduce = refuse, refuse
    out = {f"{be}/{cl}": _step(be, cl) for be in ("numpy", "native") for cl in (False, True)}
    g = torch.Generator().manual_seed(3)  # torch's batch norm on the same data, float64
    x = (torch.randn(SHAPE, generator=g) * 2 + 0.5).double().requires_grad_()
    dy = torch.randn(SHAPE, generator=g).double()
    w = (torch.rand(SHAPE[1], generator=g) + 0.5).double().requires_grad_()
    b = torch.randn(SHAPE[1], generator=g).double().requires_grad_()
    rm, rv = torch.zeros(SHAPE[1], dtype=torch.float64), torch.ones(SHAPE[1], dtype=torch.float64)
    y = torch.nn.functional.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
    y.backward(dy)
    out["torch"] = [t.detach().numpy().copy() for t in (y, x.grad, w.grad, b.grad, rm, rv)]
    return out


def test_one_rank_skips_collectives_and_matches_numpy_bits_and_torch():
    out = run_ranks(one_rank, 1, timeout=120.0)[0]
    names = ("output", "grad_input", "grad_weight", "grad_bias", "running_mean", "running_var")
    for cl in (False, True):
        nat, ref = out[f"native/{cl}"], out[f"numpy/{cl}"]
        for name, a, r, t in zip(names, nat, ref, out["torch"]):
            assert np.array_equal(a.view(np.uint32), r.view(np.uint32)), (name, cl)
            assert np.max(np.abs(a - t)) <= FP32_BOUND * max(1.0, np.max(np.abs(t))), (name, cl)
