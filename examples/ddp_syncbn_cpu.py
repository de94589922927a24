"""Train a small CNN with DistributedDataParallel and opgraph's SyncBatchNorm on CPU processes
(gloo), then compare with the same model trained in one process on the whole batch.

    torchrun --nproc-per-node 2 examples/ddp_syncbn_cpu.py
    python examples/ddp_syncbn_cpu.py --ranks 2          # spawns the processes itself

torch.nn.SyncBatchNorm refuses CPU tensors; ``opgraph.torch.convert_sync_batchnorm`` swaps every
BatchNorm for opgraph's, whose statistics are exchanged over torch.distributed exactly as
torch's are, with each primitive computed by its aclnn op_api (the NPU's arithmetic).
Options: --steps, --batch, --backend numpy|native, --seed.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import backends
import opgraph.torch as ot

CLASSES = 4
BAR = 24


def make_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, stride=2), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16 * 4, CLASSES))


def batch(step: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose label is the quadrant with the brightest first channel."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(n, 3, 16, 16, generator=g)
    label = torch.randint(0, CLASSES, (n,), generator=g)
    for i, q in enumerate(label.tolist()):
        r, c = divmod(q, 2)
        x[i, 0, 8 * r:8 * r + 8, 8 * c:8 * c + 8] += 1.5
    return x, label


def progress(step: int, steps: int, loss: float, seconds: float) -> None:
    done = BAR * step // steps
    print(f"step {step:3d}/{steps} [{'#' * done}{'.' * (BAR - done)}] loss {loss:.6f} "
          f"({seconds * 1e3:.0f} ms)", flush=True)


def train(rank: int, world: int, args: argparse.Namespace) -> dict:
    """This rank's part of DDP training; returns the whole batch's loss per step."""
    net = ot.convert_sync_batchnorm(make_net(args.seed), backend=args.backend)
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        x, y = batch(step, args.batch, args.seed)
        mine = torch.arange(args.batch).tensor_split(world)[rank]   # uneven when it must be
        loss_sum = F.cross_entropy(model(x[mine]), y[mine], reduction="sum")
        opt.zero_grad()
        (loss_sum * world / args.batch).backward()  # DDP averages: this gives the mean's grad
        opt.step()
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / args.batch)
        if rank == 0:
            progress(step + 1, args.steps, losses[-1], time.perf_counter() - start)
    return {"losses": losses, "state": net.state_dict()}


def reference(args: argparse.Namespace) -> dict:
    """The same model and optimiser in this process on the whole batch (torch's BatchNorm)."""
    net = make_net(args.seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(args.steps):
        x, y = batch(step, args.batch, args.seed)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": net.state_dict()}


def report(result: dict, args: argparse.Namespace, world: int, seconds: float) -> float:
    ref = reference(args)
    loss_diff = max(abs(a - b) for a, b in zip(result["losses"], ref["losses"]))
    param_diff = max(float((result["state"][k].double() - v.double()).abs().max())
                     for k, v in ref["state"].items())
    print(f"{world} ranks, {args.steps} steps of {args.batch} images in {seconds:.1f} s; "
          f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")
    print(f"largest difference from the single-process reference: loss {loss_diff:.3g}, "
          f"parameters and running stats {param_diff:.3g}")
    return max(loss_diff, param_diff)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes to spawn (without torchrun)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="images per step, all ranks together")
    p.add_argument("--backend", default=None, help="opgraph backend: numpy (default), native")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.ranks < 1 or args.steps < 1 or args.batch < args.ranks:
        p.error("need --ranks >= 1, --steps >= 1 and --batch >= --ranks")
    if args.backend is not None:
        try:  # here, once, rather than as a traceback from every rank
            backends.get(args.backend)
        except backends.BackendUnavailable as e:
            p.error(f"--backend: {e}")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    start = time.perf_counter()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        shared = max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"]))
        torch.set_num_threads(shared)
        os.environ.setdefault("OPGRAPH_NUM_THREADS", str(shared))  # as run_ranks shares them
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        try:
            rank, world = dist.get_rank(), dist.get_world_size()
            result = train(rank, world, args)
        finally:
            ot.leave_group()  # collects DDP's reference cycle first: exits cleanly
        if rank == 0:
            report(result, args, world, time.perf_counter() - start)
        return 0
    result = ot.run_ranks(train, args.ranks, (args,), timeout=300, pg_timeout=60)[0]
    report(result, args, args.ranks, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
