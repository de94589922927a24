"""Benchmark a SyncBatchNorm training step (forward + backward of one layer: five op_api calls
and two collectives, examples/capture_syncbn.py) replayed as one captured program against the
same calls one by one, on the numpy and native backends, in one process (the collectives on the
one-rank group, so that only opgraph's own work is timed). Reports kernel launches and
collectives, bytes the kernels move (a store's destination counted once) against what the step
must read and write, and time: variants interleaved, the first run of each not counted, medians
and min-max, ratios to the calls one by one. Nothing is asserted. In one process a sample is the
per-call time of a burst of ~5 ms after one untimed call, on inputs on huge pages
(``bench_common.steady_time``, ``on_huge_pages``), as in the other benchmarks. Timed as single
calls, each sample paid for the variant before it (the level-1 program's 18 ms of numpy evicts
the tensors from the cache): native's step measured 1.1-1.6 ms against 0.6-0.7 ms in bursts, and
the level-2 program 1.15-1.34x the calls instead of ~0.9x. The rank bench times single calls,
the same number on every rank (each call's collectives must meet).

What the step must move: x is read before the all_gather (the statistics need all of it) and
again after it, dy before the all_reduce (its sums) and after it (the input gradient); y and
grad_input are written once — 6 tensors of x's size. Touching every tensor only once (4) would
need the whole of x and dy kept across both collectives.

With ``--ranks N`` (needs torch) the same comparison runs through ``opgraph.torch.SyncBatchNorm``
on N gloo processes: the layer's forward + backward (autograd, torch.distributed's exchange)
against its step captured and replayed (the collectives inside the program); rank 0's figures.

    python benchmarks/bench_capture.py                # 32x64x28x28 and 8x64x56x56, fp32
    python benchmarks/bench_capture.py --quick        # one small shape, fewer repeats
    python benchmarks/bench_capture.py --ranks 2      # the torch layer on 2 gloo processes
"""
from __future__ import annotations

import argparse
import importlib.util
import platform as host
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

import opgraph
from bench_common import backends_here, interleaved, on_huge_pages, steady_time

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("capture_syncbn", ROOT / "examples" / "capture_syncbn.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

SHAPES = [(32, 64, 28, 28), (8, 64, 56, 56)]
QUICK_SHAPES = [(8, 32, 14, 14)]


def variants(shape: tuple[int, ...], backend: str) -> tuple[dict[str, Callable[[], None]], dict]:
    """name -> one training step; and the captured programs' figures."""
    inputs = {k: on_huge_pages(a) if isinstance(a, np.ndarray) else a
              for k, a in example.make_inputs(shape).items()}
    out: dict[str, Callable[[], None]] = {}
    figures = {}

    def one_by_one() -> None:
        with opgraph.use_backend(backend):
            example.step_on(**inputs)

    out["calls one by one"] = one_by_one  # at the current opt level (default 2)
    for level in (1, 2):
        with opgraph.use_backend(backend), opgraph.capture(level) as prog:
            example.step_on(**inputs)
        figures[level] = (prog.stats(), prog.stats_one_by_one())
        out[f"program, level {level}"] = (lambda p: lambda: p.replay())(prog)
    return out, figures


def measure(fns: dict[str, Callable[[], None]], reps: int, burst: bool = True
            ) -> dict[str, list[float]]:
    """``reps`` interleaved samples of each variant: per-call times of ~5 ms bursts, or of
    single calls (``burst=False``: on ranks, where every rank must make the same calls)."""
    for fn in fns.values():  # first run: compilation, caches
        fn()
    return interleaved(fns, reps, steady_time if burst else _one_call)


def _one_call(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def report(shape: tuple[int, ...], reps: int) -> None:
    x_bytes = int(np.prod(shape)) * 4
    print(f"\nshape {'x'.join(map(str, shape))} fp32 (x = {x_bytes / 2**20:.1f} MiB); the step must "
          f"move 6 x = {6 * x_bytes / 2**20:.1f} MiB")
    first = True
    for backend in backends_here():
        fns, figures = variants(shape, backend)
        if first:
            for level, (s, one) in figures.items():
                print(f"  level {level}: program {s.launches} launches + {s.collectives} "
                      f"collectives, {s.bytes_moved / 2**20:.1f} MiB ({s.bytes_moved / (6 * x_bytes):.2f}"
                      f"x the step's, {s.bytes_moved / (4 * x_bytes):.2f}x every tensor once); one "
                      f"by one {one.launches} + {one.collectives}, {one.bytes_moved / 2**20:.1f} MiB "
                      f"({one.bytes_moved / (6 * x_bytes):.2f}x)")
            first = False
        times = measure(fns, reps)
        base = statistics.median(times["calls one by one"])
        print(f"  {backend}:")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"    {name:<20} {med * 1e3:8.2f} ms  (min {min(ts) * 1e3:.2f}, max "
                  f"{max(ts) * 1e3:.2f})  x{med / base:.2f}")


def rank_bench(rank: int, world: int, shape: tuple[int, ...], reps: int) -> dict:
    """On each rank: the SyncBatchNorm layer eager vs its captured step replayed (interleaved)."""
    torch = importlib.import_module("torch")
    ot = importlib.import_module("opgraph.torch")
    mine = torch.arange(shape[0]).tensor_split(world)[rank]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(len(mine), *shape[1:], generator=g)
    dy = torch.randn(x.shape, generator=g)
    fns: dict[str, Callable[[], None]] = {}
    for backend in backends_here():
        bn = ot.SyncBatchNorm(shape[1], backend=backend)

        def eager(bn=bn) -> None:
            xe = x.clone().requires_grad_()
            torch.autograd.grad(bn(xe), (xe, bn.weight, bn.bias), dy)

        xc = x.clone().requires_grad_()
        with opgraph.capture(2) as prog:
            torch.autograd.grad(bn(xc), (xc, bn.weight, bn.bias), dy)
        fns[f"{backend}: layer eager"] = eager
        fns[f"{backend}: program replay"] = prog.replay
    times = measure(fns, reps, burst=False)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def report_ranks(world: int, shape: tuple[int, ...], reps: int) -> None:
    ot = importlib.import_module("opgraph.torch")
    res = ot.run_ranks(rank_bench, world, (shape, reps), timeout=600.0)[0]
    print(f"\nopgraph.torch.SyncBatchNorm on {world} gloo ranks, batch {'x'.join(map(str, shape))} "
          "split over them, fp32, rank 0 (forward + backward):")
    for name, (med, lo, hi) in res.items():
        base = res[name.split(":")[0] + ": layer eager"][0]
        print(f"    {name:<26} {med * 1e3:8.2f} ms  (min {lo * 1e3:.2f}, max {hi * 1e3:.2f})  "
              f"x{med / base:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="one small shape, 3 repeats")
    ap.add_argument("--ranks", type=int, default=0,
                    help="also the torch layer on this many gloo processes (needs torch)")
    args = ap.parse_args()
    shapes, reps = (QUICK_SHAPES, 3) if args.quick else (SHAPES, args.reps)
    print(f"bench_capture: {host.processor() or host.machine()}, Python {host.python_version()}, "
          f"numpy {np.__version__}; {reps} interleaved repeats, medians")
    for shape in shapes:
        report(shape, reps)
        if args.ranks:
            report_ranks(args.ranks, shape, reps)


if __name__ == "__main__":
    main()
