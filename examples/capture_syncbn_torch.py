"""Capture a SyncBatchNorm training step across gloo processes and replay it on new batches.

Each rank captures its layer's forward + backward once with ``opgraph.capture()`` (the
collectives on the process group are nodes of the program), then every step replays that
program on a new batch and upstream gradient (rebound by name: ``input``, ``gradOut``), next to
the same step run eagerly on a copy of the layer. Every step's output, input/weight/bias
gradients and running statistics are compared bit for bit on every rank, and the per-step
times of both are reported (medians over the steps, rank 0).

    python examples/capture_syncbn_torch.py                  # 2 ranks, 8x64x28x28 fp32, native
    python examples/capture_syncbn_torch.py --ranks 3 --shape 12,32,14,14 --dtype float16

    >>> parse(["--ranks", "2", "--shape", "4,3,5,5"]).shape
    (4, 3, 5, 5)
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any, Optional, Sequence

import torch

import opgraph
import opgraph.torch as ot
from backends import native


def batch(shape: Sequence[int], rank: int, world: int, step: int,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of step ``step``'s batch and upstream gradient (the batch split as
    ``tensor_split`` does)."""
    g = torch.Generator().manual_seed(1000 * step + 7)
    x, dy = (torch.randn(*shape, generator=g) * 2 + 0.5 for _ in range(2))
    return (x.tensor_split(world)[rank].contiguous().to(dtype),
            dy.tensor_split(world)[rank].contiguous().to(dtype))


def eager_step(bn: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """Forward + backward: the output and the input, weight and bias gradients."""
    x = x.clone().requires_grad_()
    y = bn(x)
    return [y, *torch.autograd.grad(y, (x, bn.weight, bn.bias), dy)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    words = torch.int16 if a.element_size() == 2 else torch.int32
    return a.shape == b.shape and bool(torch.equal(a.detach().view(words), b.detach().view(words)))


def rank_main(rank: int, world: int, shape: tuple[int, ...], steps: int, dtype: str,
              backend: str) -> dict[str, Any]:
    dt = getattr(torch, dtype)
    C = shape[1]
    eager = ot.SyncBatchNorm(C, backend=backend, platform="Ascend950" if dt == torch.bfloat16 else None)
    with torch.no_grad():
        eager.weight.copy_(torch.linspace(0.5, 2, C))
        eager.bias.copy_(torch.linspace(-1, 1, C))
    captured = copy.deepcopy(eager)
    x0, dy0 = batch(shape, rank, world, 0, dt)
    with opgraph.capture() as prog:  # every rank captures, in the same order
        outs = eager_step(captured, x0, dy0)
    equal, t_eager, t_replay = True, [], []
    for step in range(1, steps + 1):
        x, dy = batch(shape, rank, world, step, dt)
        start = time.perf_counter()
        want = eager_step(eager, x, dy)
        t_eager.append(time.perf_counter() - start)
        start = time.perf_counter()
        prog.replay(input=x, gradOut=dy)
        t_replay.append(time.perf_counter() - start)
        got = [*outs, captured.running_mean, captured.running_var]
        equal &= all(same_bits(a, b) for a, b in zip([*want, eager.running_mean, eager.running_var], got))
    return {"equal": equal, "eager": statistics.median(t_eager),
            "replay": statistics.median(t_replay), "program": repr(prog)}


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="gloo processes (at least 2)")
    ap.add_argument("--shape", default="8,64,28,28", help="the whole batch, N,C,...")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--backend", default="native" if native.available() else "numpy")
    args = ap.parse_args(argv)
    try:
        args.shape = tuple(int(n) for n in args.shape.split(","))
    except ValueError:
        ap.error(f"--shape: comma-separated integers, got {args.shape!r}")
    if args.ranks < 2:
        ap.error("--ranks: at least 2 (on one rank SyncBatchNorm is plain batch norm)")
    if len(args.shape) < 2 or min(args.shape) < 1 or args.shape[0] < args.ranks:
        ap.error(f"--shape: N,C,... with N >= --ranks and no zero dims, got {args.shape}")
    if args.steps < 1:
        ap.error("--steps: at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    results = ot.run_ranks(rank_main, args.ranks,
                           (args.shape, args.steps, args.dtype, args.backend), timeout=600)
    shape = "x".join(map(str, args.shape))
    r0 = results[0]
    print(f"{args.ranks} ranks, batch {shape} {args.dtype}, backend {args.backend}: "
          f"{r0['program']}")
    print(f"{args.steps} steps on new batches: eager {r0['eager'] * 1e3:.3f} ms/step, captured "
          f"replay {r0['replay'] * 1e3:.3f} ms/step ({r0['replay'] / r0['eager']:.2f}x), rank 0")
    ok = all(r["equal"] for r in results)
    print("every step bit-equal to the eager layer on every rank" if ok else
          "MISMATCH: the replay differs from the eager layer")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
