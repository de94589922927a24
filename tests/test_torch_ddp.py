"""DistributedDataParallel over 2 gloo processes with ``convert_sync_batchnorm``: a small CNN
trained for a few steps on an uneven split of each batch has the losses and parameters of the
same model trained in one process on the whole batch (within DDP_BOUND)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import opgraph.torch as ot  # noqa: E402

# max |loss - reference| <= DDP_BOUND * |reference| per step; parameters and running stats
# within DDP_BOUND * max(1, |reference|) after the last step (measured: 8.5e-8 and 1.0e-7)
DDP_BOUND = 1e-5
SIZES = [5, 3]
STEPS = 4
LR = 0.2


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def batches():
    """One batch, seen at every step (so that the loss goes down)."""
    g = torch.Generator().manual_seed(1)
    n = sum(SIZES)
    x, y = torch.randn(n, 3, 8, 8, generator=g) * 2 + 1, torch.randint(0, 4, (n,), generator=g)
    return [(x, y)] * STEPS


def train_ddp(rank: int, world: int) -> dict:
    net = ot.convert_sync_batchnorm(make_net())
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    lo, n = sum(SIZES[:rank]), sum(SIZES)
    losses = []
    for x, y in batches():
        out = model(x[lo:lo + SIZES[rank]])
        loss_sum = F.cross_entropy(out, y[lo:lo + SIZES[rank]], reduction="sum")
        opt.zero_grad()
        # DDP averages the gradients over the ranks: scaled so that the average is the
        # gradient of the whole batch's mean loss
        (loss_sum * world / n).backward()
        opt.step()
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / n)
    kinds = sorted({type(m).__module__ + "." + type(m).__name__ for m in net.modules()
                    if "BatchNorm" in type(m).__name__})
    return dict(losses=losses, state=net.state_dict(), kinds=kinds)


def train_single() -> dict:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in batches():
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return dict(losses=losses, state=net.state_dict())


@pytest.fixture(scope="module")
def trained():
    return ot.run_ranks(train_ddp, len(SIZES), timeout=90, pg_timeout=30), train_single()


def test_the_model_uses_opgraph_syncbatchnorm(trained):
    ranks, _ = trained
    assert all(r["kinds"] == ["opgraph.torch.syncbn.SyncBatchNorm"] for r in ranks)


def test_losses_match_single_process_training(trained):
    ranks, ref = trained
    for r in ranks:
        for step, (got, want) in enumerate(zip(r["losses"], ref["losses"])):
            assert abs(got - want) <= DDP_BOUND * abs(want), f"step {step}: {got} vs {want}"
    assert ref["losses"][-1] < ref["losses"][0]  # it does train


def test_parameters_and_running_stats_match(trained):
    ranks, ref = trained
    assert set(ranks[0]["state"]) == set(ref["state"])
    for r in ranks:
        for key, want in ref["state"].items():
            got = r["state"][key]
            if key.endswith("num_batches_tracked"):
                assert int(got) == int(want) == STEPS
                continue
            err = float((got.double() - want.double()).abs().max())
            assert err <= DDP_BOUND * max(1.0, float(want.abs().max())), f"{key}: {err:.3g}"
