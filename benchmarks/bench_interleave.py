"""Benchmark how opgraph's native SyncBatchNorm layer and torch's BatchNorm2d tax each other when
they alternate, as layers of one network do, with the native kernels on opgraph's own thread
team or on torch's OpenMP threads (``backends.native.team.share_openmp``).

One process (a one-rank gloo group, as in bench_syncbn; the layers of bench_syncbn.variants).
Blocks of rounds alternate between the two runtimes. A round is one torch step, three opgraph
steps, then three torch steps. Reported per runtime, medians over the rounds:
- opgraph's step right after torch's;
- opgraph's third step in a row;
- torch's step right after opgraph's;
- torch's third step in a row.
A runtime that spins after its calls shows as the gap between "right after" and "third in a
row" of the other side. Nothing is asserted.

    python benchmarks/bench_interleave.py                 # 8x64x28x28, 32x64x56x56; 3 dtypes
    python benchmarks/bench_interleave.py --quick         # one small shape, fp32, few rounds
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

from opgraph.torch import run_ranks
import bench_syncbn as syncbn_bench

RUNTIMES = ("team", "openmp")
COLUMNS = ("opgraph after torch", "opgraph 3rd in a row", "torch after opgraph",
           "torch 3rd in a row")


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rounds(ours: Callable[[], None], torch_bn: Callable[[], None], n: int) -> list[list[float]]:
    """``n`` rounds of [torch, ours x3, torch x3]: the four timings of each (see COLUMNS)."""
    out = []
    for _ in range(n):
        torch_bn()
        first = timed(ours)
        ours()
        third = timed(ours)
        t_first = timed(torch_bn)
        torch_bn()
        out.append([first, third, t_first, timed(torch_bn)])
    return out


def measure(rank: int, world: int, cases: list[tuple[tuple[int, ...], str]], blocks: int,
            per_block: int) -> list[dict[str, Any]]:
    """Per case: {runtime: [[four timings] per round]} (runtimes that cannot run here absent)."""
    results = []
    for shape, dtype in cases:
        fns = syncbn_bench.variants(shape, dtype, rank, world, ("native",), RUNTIMES)
        torch_bn = fns["torch BatchNorm2d"]
        ours = {rt: fns[f"opgraph SyncBatchNorm, native on {rt}"] for rt in RUNTIMES
                if f"opgraph SyncBatchNorm, native on {rt}" in fns}
        for fn in [torch_bn, *ours.values()]:  # compile, fill the caches
            fn()
        times: dict[str, list[list[float]]] = {rt: [] for rt in ours}
        for b in range(blocks):
            for rt in (list(ours) if b % 2 == 0 else list(reversed(ours))):
                ours[rt]()  # settle on this runtime before the block's rounds
                times[rt] += rounds(ours[rt], torch_bn, per_block)
        results.append({"shape": shape, "dtype": dtype, "times": times})
    return results


def report(results: list[dict[str, Any]]) -> None:
    for r in results:
        shape = "x".join(map(str, r["shape"]))
        print(f"\n{shape} {r['dtype']}, medians of {len(next(iter(r['times'].values()), []))} "
              "rounds per runtime:")
        print(f"  {'runtime':<10}" + "".join(f"{c:>24}" for c in COLUMNS))
        for rt, rows in r["times"].items():
            cols = [statistics.median(c) for c in zip(*rows)]
            print(f"  {rt:<10}" + "".join(f"{syncbn_bench.fmt_ms(c):>24}" for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small shape, fp32, few rounds")
    ap.add_argument("--dtypes", default=None,
                    help="comma-separated: fp32, fp16, bf16 (default all)")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per runtime x2 (default 6)")
    args = ap.parse_args()
    shapes = syncbn_bench.QUICK_SHAPES if args.quick else syncbn_bench.SHAPES
    dtypes = (args.dtypes or ("fp32" if args.quick else "fp32,fp16,bf16")).split(",")
    unknown = [d for d in dtypes if d not in syncbn_bench.DTYPES]
    if unknown:
        ap.error(f"--dtypes: unknown {', '.join(unknown)} (choose from "
                 f"{', '.join(syncbn_bench.DTYPES)})")
    blocks = args.blocks or (2 if args.quick else 6)
    cases = [(s, d) for s in shapes for d in dtypes]
    results = run_ranks(measure, 1, (cases, blocks, 3), timeout=1800, pg_timeout=300)[0]
    report(results)


if __name__ == "__main__":
    main()
