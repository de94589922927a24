"""Benchmark the SyncBatchNorm family's seven op_apis at level 2: the numpy backend (the
bit-faithful reference) against the native backend, as whole two-phase calls (phase 1 on a cache
hit + phase 2), on each op_api's own random valid inputs (its ``make_inputs``).

Per op_api, size and dtype the variants run interleaved in one process (each sample a burst
after an untimed call, ``bench_common.steady_time``; every array on huge pages,
``bench_common.on_huge_pages``); we report medians, the spread, native's speed-up over numpy,
native's phase 1 alone (a cache hit: what the call costs besides the kernels), and native
against the memory floor: ``c = a + b`` over raw bits compiled with the native backend's
compiler on its thread team (``bench_common.c_floor_variant``; 3 tensor passes), scaled to the
tensor passes the op_api needs at least (stats 2 reads, reduce 1, backward reduce 2, elemt 1
read + 1 write, elemt backward 2 + 1). The gather op_apis work on
[ranks, C] statistics: ``--ranks`` rows, C from the size. bfloat16 statistics exist on the 950
only, so bf16 runs on Ascend950; fp32/fp16 on Ascend910B (``--platform`` overrides).

    python benchmarks/bench_family.py                    # 8x64x28x28 and 32x64x56x56, 3 dtypes
    python benchmarks/bench_family.py --quick            # the small size, fp32, 5 repeats
    python benchmarks/bench_family.py --ops Stats,ElemtBackward --dtypes fp16 --reps 15
"""
from __future__ import annotations

import argparse
import platform as host
import statistics
from typing import Callable, Optional

import numpy as np

import backends
import opgraph
from backends.native import build, launch
from opgraph.cli.cases import Case, execute, record
from opgraph.core.dtypes import DataType
from opgraph.core.opapi import InputConfig, get_op_api
from opgraph.core.status import Status
from bench_common import held_floor, interleaved, on_huge_pages

OPS = {  # op_api -> tensor passes at least (None: statistics only, no big tensor)
    "aclnnBatchNormStats": 2, "aclnnBatchNormReduce": 1, "aclnnBatchNormReduceBackward": 2,
    "aclnnBatchNormElemt": 2, "aclnnBatchNormElemtBackward": 3,
    "aclnnBatchNormGatherStatsWithCounts": None, "aclnnSyncBatchNormGatherStats": None}
DTYPES = {"fp32": DataType.FLOAT, "fp16": DataType.FLOAT16, "bf16": DataType.BF16}
SIZES = [(8, 64, 28, 28), (32, 64, 56, 56)]


def make_case(op: str, shape: tuple[int, ...], dtype: DataType, platform: str, backend: str,
              ranks: int) -> Case:
    """The op_api's random valid inputs at ``shape`` (the gathers: ``ranks`` × C statistics)."""
    spec = get_op_api(op)
    options = {o.name: o.default for o in spec.options}
    if op == "aclnnSyncBatchNormGatherStats":
        shape = (ranks, shape[1])
    if "ranks" in options:
        options["ranks"] = ranks
    cfg = InputConfig(tuple(shape), dtype, options)
    arrays = {name: on_huge_pages(a) if isinstance(a, np.ndarray) else a
              for name, a in spec.make_inputs(cfg, np.random.default_rng(0)).items()}
    return Case(spec, arrays, platform, 2, backend, dict(spec.formats(cfg)))


def call(case: Case) -> Callable[[], None]:
    """One whole two-phase call on the case's tensors."""
    def run() -> None:
        rec = record(case)
        if rec.status != Status.ACLNN_SUCCESS or execute(case, rec) != Status.ACLNN_SUCCESS:
            raise RuntimeError(f"{case.spec.name} failed: {opgraph.aclnn.aclGetRecentErrMsg()}")
    return run


def phase1(case: Case) -> Callable[[], None]:
    return lambda: record(case)


def fmt(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def bench(op: str, shape: tuple[int, ...], dname: str, platform: Optional[str], reps: int,
          ranks: int, floor: Optional[Callable[[], None]]) -> Optional[dict]:
    """The variants of one op_api at one size and dtype, interleaved; None if it does not
    support the dtype on that platform."""
    dtype = DTYPES[dname]
    soc = platform or ("Ascend950" if dtype == DataType.BF16 else "Ascend910B")
    cases = {be: make_case(op, shape, dtype, soc, be, ranks) for be in ("numpy", "native")}
    if record(cases["numpy"]).status != Status.ACLNN_SUCCESS:
        return None
    variants = {"numpy": call(cases["numpy"]), "native": call(cases["native"]),
                "native phase 1": phase1(cases["native"])}
    if floor is not None and OPS[op]:
        variants["floor"] = floor
    for fn in variants.values():  # compiles kernels and fills the caches
        fn()
    times = interleaved(variants, reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    at_floor = med["floor"] * OPS[op] / 3 if "floor" in med else None
    return {"op": op[5:], "size": "x".join(map(str, shape)), "dtype": dname, "soc": soc, "med": med,
            "spread": {k: (min(v), max(v)) for k, v in times.items()}, "at_floor": at_floor}


def report(rows: list[dict]) -> None:
    head = (f"{'op_api':<30}{'size':>13}{'dtype':>6}{'numpy':>11}{'native':>11}{'min-max':>21}"
            f"{'x faster':>9}{'phase 1':>10}{'floor':>10}{'x floor':>8}")
    print(head)
    for r in rows:
        m, (lo, hi) = r["med"], r["spread"]["native"]
        floor = r["at_floor"]
        print(f"{r['op']:<30}{r['size']:>13}{r['dtype']:>6}{fmt(m['numpy']):>11}"
              f"{fmt(m['native']):>11}{fmt(lo) + '-' + fmt(hi):>21}{m['numpy'] / m['native']:>9.1f}"
              f"{fmt(m['native phase 1']):>10}{fmt(floor) if floor else '-':>10}"
              f"{m['native'] / floor if floor else float('nan'):>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small size, fp32, 5 repeats")
    ap.add_argument("--reps", type=int, default=None, help="timed repeats (default 9; quick 5)")
    ap.add_argument("--dtypes", default=None, help="comma-separated: fp32, fp16, bf16 (default all)")
    ap.add_argument("--ops", default=None, help="comma-separated op_api names or parts of them")
    ap.add_argument("--ranks", type=int, default=8, help="rows of the gathers' statistics (8)")
    ap.add_argument("--platform", default=None, help="SoC for every dtype (default: see above)")
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 9)
    dnames = (args.dtypes or ("fp32" if args.quick else "fp32,fp16,bf16")).split(",")
    sizes = SIZES[:1] if args.quick else SIZES
    ops = [op for op in OPS if not args.ops or any(w in op for w in args.ops.split(","))]
    if "native" not in backends.available():
        raise SystemExit("opgraph: error: the native backend needs a C compiler")
    print(f"opgraph {opgraph.__version__}, {host.machine()}, Python {host.python_version()}; "
          f"{build.describe()}; {launch.vector_isa()}; level 2, whole two-phase calls, {reps} interleaved repeats\n")
    rows = []
    for shape in sizes:
        for dname in dnames:
            floor = held_floor(shape, DTYPES[dname].np)
            for op in ops:
                row = bench(op, shape, dname, args.platform, reps, args.ranks, floor)
                if row is not None:
                    rows.append(row)
    report(rows)


if __name__ == "__main__":
    main()
