"""Benchmark opgraph.torch.SyncBatchNorm on CPU: forward + backward per rank with the numpy and
native backends, on 1 (default) or more gloo ranks, the collectives alone (all_gather of [mean,
invstd, count] + all_reduce of [sum_dy, sum_dy_xmu] at the same sizes), against
torch.nn.BatchNorm2d forward + backward on the same per-rank batch in the same processes, for
fp32, fp16 and bf16 (bf16 statistics run on the Ascend950 op_apis). The floor row is seven tensor
passes (what batch norm's forward + backward must read and write at least) at the speed of the
compiled 2-thread ``c = a + b`` of bench_elemt_backward (when that is available); the
"empty autograd.Function" row is a forward + backward through a Python-defined autograd
function that computes nothing (:class:`EmptyFunction`), what the eager layer pays before its
first op_api call. The
"captured step" rows run the same forward + backward captured once with ``opgraph.capture()``
and replayed on the same tensors rebound by name (the CUDA-Graphs way: one program, no Python
per op_api; the parameter gradients' accumulation into ``.grad``, torch ops outside the
program, is not replayed — 2·C floats); "captured, new tensors" replays on two pairs of
tensors in turn, a new object every step as in training (each replay rebinds the nodes that
touch them, backends/native/bound.py).

One session of processes per rank count (torch's threads shared out over the ranks); inside it
the variants run interleaved, the first call of each (compilation, caches) not counted. A sample
is the per-call time of a burst of ~5 ms (the same number of calls on every rank) after one
untimed call; the data sit on huge pages, as in bench_elemt_backward. Rank 0's medians and
min–max are reported, and the ratio to torch's BatchNorm2d; nothing is asserted.
One rank runs the distributed path too (the autograd function on a one-rank group), although
the module itself would fall back to plain batch norm there.

    python benchmarks/bench_syncbn.py                   # 8x64x28x28, 32x64x56x56; 3 dtypes; 1 rank
    python benchmarks/bench_syncbn.py --quick           # one small shape, fewer repeats
    python benchmarks/bench_syncbn.py --dtypes fp32 --ranks 1,2 --reps 15
    python benchmarks/bench_syncbn.py --omp-passive      # torch's OpenMP threads sleep when idle
    python benchmarks/bench_syncbn.py --runtimes team,openmp   # native on each runtime, interleaved

torch's OpenMP workers spin for milliseconds after each parallel region (libgomp's default wait
policy). opgraph's native kernels run on those same threads once torch is imported
(``backends.native.team.share_openmp_if_spinning``; ``OPGRAPH_RUNTIME=team`` for its own team
instead, whose workers and torch's then spin against each other on few cores). ``--runtimes team,openmp``
times the native layer on each of the two as separate, interleaved variants of one run (the
runtime switched before each call). ``--omp-passive`` sets ``OMP_WAIT_POLICY=PASSIVE`` for the
rank processes: torch's threads sleep when idle, and the native kernels keep their own team
(unless ``--runtimes`` says otherwise).
"""
from __future__ import annotations

import argparse
import functools
import os
import platform as host
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import opgraph
from opgraph.torch import SyncBatchNormFunction, run_ranks
from opgraph.torch.kernels import as_numpy, to_torch
from backends.native import launch, team
from bench_common import backends_here, held_floor, interleaved, on_huge_pages

DTYPES = {"fp32": (torch.float32, None), "fp16": (torch.float16, None),
          "bf16": (torch.bfloat16, "Ascend950")}
SHAPES = [(8, 64, 28, 28), (32, 64, 56, 56)]
FLOOR = "floor: 7 tensor passes"
FLOOR_PASSES = 7  # forward: read x (stats), read x + write y; backward: read dy, x; read dy, x + write dx
EMPTY = "empty autograd.Function"  # the fixed cost of a Python-defined layer (EmptyFunction)
QUICK_SHAPES = [(8, 32, 14, 14)]
BURST_SECONDS = 0.005


def variants(shape: tuple[int, ...], dtype: str, rank: int, world: int,
             use: tuple[str, ...] = ("numpy", "native"),
             runtimes: tuple[str, ...] = ()) -> dict[str, Callable]:
    """name -> one forward + backward (or the collectives) on this rank's part of the batch;
    with ``runtimes`` (``"team"``, ``"openmp"``) the native layer once per thread runtime."""
    dt, plat = DTYPES[dtype]
    mine = torch.arange(shape[0]).tensor_split(world)[rank]
    g = torch.Generator().manual_seed(rank)
    x = pinned(torch.randn(len(mine), *shape[1:], generator=g).to(dt))
    dy = pinned(torch.randn(x.shape, generator=g).to(dt))
    C = shape[1]
    w, b = torch.ones(C, requires_grad=True), torch.zeros(C, requires_grad=True)
    rm, rv = torch.zeros(C), torch.ones(C)
    group = dist.group.WORLD

    def syncbn(backend: str) -> Callable[[], None]:
        where = {"backend": backend, "platform": plat}

        def step() -> None:
            xi = x.detach().requires_grad_()
            y = SyncBatchNormFunction.apply(xi, w, b, rm, rv, 1e-5, 0.1, group, world, where)
            y.backward(dy)
        return step

    bn = torch.nn.BatchNorm2d(C).to(dt)

    def torch_bn() -> None:
        xi = x.detach().requires_grad_()
        bn(xi).backward(dy)

    row, sums = torch.zeros(2 * C + 1), torch.zeros(2 * C)

    def collectives() -> None:
        rows = [torch.empty_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        dist.all_reduce(sums)

    out = {f"opgraph SyncBatchNorm, {be}": syncbn(be) for be in backends_here()
           if be in use and not (be == "native" and runtimes)}
    if not runtimes:
        for be in backends_here():
            if be in use:
                out[f"captured step, {be}"], out[f"captured, new tensors, {be}"] = captured(
                    x, dy, w, b, rm, rv, group, world, plat, be, pinned(x.clone()), pinned(dy.clone()))
    if "native" in use and "native" in backends_here():
        for runtime in runtimes:
            openmp = runtime == "openmp"
            if team.share_openmp(openmp) == openmp:
                step = on_runtime(openmp, syncbn("native"))
                out[f"opgraph SyncBatchNorm, native on {runtime}"] = step
            elif rank == 0:
                print(f"  (no OpenMP runtime to share here: native on {runtime} skipped)")
    out["collectives alone"] = collectives

    def empty_function() -> None:
        xi = x.detach().requires_grad_()
        EmptyFunction.apply(xi, w, b).backward(dy)
    out[EMPTY] = empty_function
    out["torch BatchNorm2d"] = torch_bn
    floor = held_floor(tuple(x.shape), f"u{x.element_size()}")  # scaled to FLOOR_PASSES in report()
    if floor is not None:
        out[FLOOR] = floor
    return out


class EmptyFunction(torch.autograd.Function):
    """What any layer written as an ``autograd.Function`` pays before it computes anything: the
    autograd machinery of a forward and a backward, and its output and gradients allocated
    (the input's gradient not written; the parameters' zeroed, as they accumulate into
    ``.grad``)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        return torch.empty_like(input)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        input, weight = ctx.saved_tensors
        return torch.empty_like(input), torch.zeros_like(weight), torch.zeros_like(weight)


def captured(x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
             rm: torch.Tensor, rv: torch.Tensor, group: Any, world: int, plat: Any,
             backend: str, x2: torch.Tensor, dy2: torch.Tensor
             ) -> tuple[Callable[[], None], Callable[[], None]]:
    """The same forward + backward captured once (``opgraph.capture()``, the collectives as
    nodes of the program): a replay on ``x`` and ``dy`` rebound by name, what a CUDA-Graphs
    style training step runs (every rank captures here, in the same order), and a replay on
    (x, dy) and (x2, dy2) in turn: a new tensor object every step,
    as the layer's input is in training (on native each replay rebinds the nodes that touch
    them)."""
    where = {"backend": backend, "platform": plat}
    with opgraph.capture() as prog:
        xi = x.detach().clone().requires_grad_()
        SyncBatchNormFunction.apply(xi, w, b, rm, rv, 1e-5, 0.1, group, world, where).backward(dy)
    pairs = [(x2, dy2), (x, dy)]

    def replay() -> None:
        prog.replay(input=x, gradOut=dy)

    def alternating() -> None:
        pairs.reverse()
        prog.replay(input=pairs[0][0], gradOut=pairs[0][1])
    return replay, alternating


def on_runtime(openmp: bool, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the native kernels switched to OpenMP (or the team) first: a dict store."""
    def switched() -> None:
        team.share_openmp(openmp)
        step()
    return switched


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in memory advised onto huge pages (:func:`bench_common.on_huge_pages`)."""
    return to_torch(on_huge_pages(as_numpy(t)))


def burst_lengths(fns: dict[str, Callable[[], None]]) -> dict[str, int]:
    """Calls per sample of each variant: enough for ~5 ms, the largest any rank needs (every
    rank must make the same calls, the collectives in them meet)."""
    out = {}
    for name, fn in fns.items():
        dist.barrier()
        start = time.perf_counter()
        fn()
        n = torch.tensor([max(1, int(BURST_SECONDS / max(time.perf_counter() - start, 1e-6)))])
        dist.all_reduce(n, dist.ReduceOp.MAX)
        out[name] = int(n)
    return out


def burst(fn: Callable[[], None], calls: int) -> float:
    """Seconds per call of ``calls`` calls of ``fn``, after a barrier and one untimed call (the
    same calls on every rank: their collectives meet)."""
    dist.barrier()
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(rank: int, world: int, cases: list[tuple[tuple[int, ...], str]], reps: int,
            use: tuple[str, ...] = ("numpy", "native"),
            runtimes: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every case's variants, interleaved, on this rank: [{case, name: [seconds per call...]}].
    A sample is a burst of calls after one untimed call, which absorbs what the previous
    variant left spinning (torch's OpenMP workers, opgraph's thread team)."""
    results = []
    for shape, dtype in cases:
        fns = variants(shape, dtype, rank, world, use, runtimes)
        for fn in fns.values():  # the first call compiles and fills the caches
            dist.barrier()
            fn()
        calls = burst_lengths(fns)
        bursts = {name: functools.partial(burst, fn, calls[name]) for name, fn in fns.items()}
        results.append({"shape": shape, "dtype": dtype,
                        "times": interleaved(bursts, reps, sample=lambda timed: timed())})
    return results


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def report(world: int, results: list[dict[str, Any]]) -> None:
    for r in results:
        shape = "x".join(map(str, r["shape"]))
        per_rank = "+".join(str(len(c)) for c in torch.arange(r["shape"][0]).tensor_split(world))
        print(f"\n{world} rank(s), {shape} {r['dtype']} (batch {per_rank}), rank 0:")
        base = statistics.median(r["times"]["torch BatchNorm2d"])
        print(f"  {'variant':<40}{'median':>11}{'min-max':>22}{'x torch':>9}")
        for name, ts in r["times"].items():
            ts = [t * FLOOR_PASSES / 3 for t in ts] if name == FLOOR else ts
            med = statistics.median(ts)
            spread = f"{fmt_ms(min(ts))}-{fmt_ms(max(ts))}"
            print(f"  {name:<40}{fmt_ms(med):>11}{spread:>22}{med / base:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small shape, 5 repeats")
    ap.add_argument("--reps", type=int, default=None, help="timed repeats (default 9; quick 5)")
    ap.add_argument("--dtypes", default="fp32,fp16,bf16", help="comma-separated: fp32, fp16, bf16")
    ap.add_argument("--shapes", default=None, help="e.g. 8,64,28,28;32,64,56,56 (default: both)")
    ap.add_argument("--ranks", default="1", help="comma-separated rank counts (default 1)")
    ap.add_argument("--backends", default="numpy,native", help="opgraph backends (default both)")
    ap.add_argument("--runtimes", default="",
                    help="comma-separated native thread runtimes to compare: team, openmp")
    ap.add_argument("--omp-passive", action="store_true",
                    help="OMP_WAIT_POLICY=PASSIVE in the rank processes (see above)")
    args = ap.parse_args()
    if args.omp_passive:  # read by libgomp when the ranks' fork server imports torch
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    reps = args.reps or (5 if args.quick else 9)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(n) for n in sh.split(",")) for sh in args.shapes.split(";")]
    cases = [(s, d) for s in shapes for d in args.dtypes.split(",")]
    runtimes = tuple(r for r in args.runtimes.split(",") if r)
    if any(r not in ("team", "openmp") for r in runtimes):
        ap.error(f"--runtimes: choose from team, openmp (got {args.runtimes})")
    print(f"opgraph {opgraph.__version__}, torch {torch.__version__}, {host.machine()}, "
          f"{host.python_version()}; backends: {', '.join(backends_here())} (native kernels: "
          f"{launch.vector_isa()}); {reps} repeats; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    for world in (int(n) for n in args.ranks.split(",")):
        use = tuple(args.backends.split(","))
        results = run_ranks(measure, world, (cases, reps, use, runtimes),
                            timeout=1800, pg_timeout=300)
        report(world, results[0])


if __name__ == "__main__":
    main()
