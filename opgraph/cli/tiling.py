"""``opgraph tiling``: the DAV_2201 SyncBatchNormBackwardElemt kernel's tiling for a shape —
TilingData fields in order, blockDim, tiling key, per-core ranges, UB usage — and the safety
findings of a dry run of the ascend-sim kernel (padded GM reads/writes, UB overflow, coverage).

    >>> from opgraph.cli import main
    >>> main(["tiling", "--shape", "2,3,1,4", "--dtype", "float16"])  # doctest: +ELLIPSIS
    SyncBatchNormBackwardElemt tiling on Ascend910B (DAV_2201): 40 vector cores, UB 196608 B
    shape [2,3,1,4]: N=24 f16/f16 (direct path): E=256 elements per 512 B, L=256, ...
    0

Platforms whose kernel ascend-sim does not model (Ascend950, Ascend310P ...) get one line on
stderr and exit status 1.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

from backends.ascend_sim import NotModelledError, check_modelled, compute_tiling, run_kernel
from opgraph.aclnn.common import float_dtypes
from opgraph.core.backend import get
from opgraph.core.platform import DEFAULT as DEFAULT_PLATFORM
from opgraph.core.platform import PRESETS, lookup
from .common import CliError, check_memory, parse_dtype, parse_platform, parse_shape, positive_int

COUNTER_BYTES = 4  # the dry run counts the writes to every output element in an int32


def run(args: argparse.Namespace) -> int:
    """``opgraph tiling``: print the tiling for ``--shape`` and the findings of a dry run;
    returns 0, or raises CliError (an unmodelled platform, an unsupported dtype, 0 elements)."""
    p = lookup(args.platform)
    try:
        check_modelled(p)
    except NotModelledError as e:
        raise CliError(str(e)) from None
    T = args.dtype
    T1 = T if args.param_dtype is None else args.param_dtype
    for what, d in (("--dtype", T), ("--param-dtype", T1)):
        if d not in float_dtypes(p):
            raise CliError(f"{what} {d.name} is not supported on {p.soc} "
                           f"(supported: {', '.join(x.name for x in float_dtypes(p))})")
    cores = p.vector_cores if args.cores is None else args.cores
    ub = p.ub_size if args.ub is None else args.ub
    numel = math.prod(args.shape)
    if numel == 0:
        raise CliError(f"--shape {','.join(map(str, args.shape))}: 0 elements; an empty tensor "
                       f"launches no kernel, so it has no tiling", code=2)
    check_memory(args.shape, numel * COUNTER_BYTES, "the dry run's per-element write counters")
    try:
        t = compute_tiling(numel, T, T1, cores=cores)
    except ValueError as e:  # numel and cores are checked above: what is left is (T, T1)
        raise CliError(f"--dtype/--param-dtype: {e}") from None
    _, trace = run_kernel(t, None, ub_size=ub, soc=p.soc, arch=p.npu_arch)
    overrides = "".join(f" ({what} override)" for what, v in (("cores", args.cores), ("UB", args.ub))
                        if v is not None)
    print(f"SyncBatchNormBackwardElemt tiling on {p.soc} ({p.arch_name}): {cores} vector cores, "
          f"UB {ub} B{overrides}")
    print(f"shape [{','.join(map(str, args.shape))}]: " + t.describe(ub))
    print(f"GM traffic: {sum(c.bytes_in for c in trace.cores)} B in, "
          f"{sum(c.bytes_out for c in trace.cores)} B out (512-byte blocks, padding included)")
    print(f"findings (dry run of the ascend-sim kernel): {len(trace.findings) or 'none'}")
    for f in trace.findings:
        print(f"  {f}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``opgraph tiling`` and its options on ``subparsers``; returns its parser."""
    p = subparsers.add_parser(
        "tiling", help="print the 910B kernel's tiling of SyncBatchNormBackwardElemt for a shape",
        description="The DAV_2201 SyncBatchNormBackwardElemt kernel's tiling (as ascend-sim "
                    "computes it): TilingData fields in order, blockDim, tiling key, per-core "
                    "element ranges, UB usage per core, and the findings of a dry run (reads and "
                    "writes past a tensor's end from 512-byte rounding, UB overflow, coverage).",
        epilog="example: opgraph tiling --shape 32,64,56,56 --dtype float16 --cores 20")
    p.add_argument("--shape", type=parse_shape, required=True, metavar="N,C,...",
                   help="input shape (only the element count matters)")
    p.add_argument("--dtype", type=parse_dtype, default=parse_dtype("float32"), metavar="DTYPE",
                   help="T, dtype of gradOut/input/gradInput: float32, float16, bfloat16 "
                        "(default: float32)")
    p.add_argument("--param-dtype", type=parse_dtype, default=None, metavar="DTYPE",
                   help="T1, dtype of the five broadcast parameters (default: --dtype; "
                        "float32 with --dtype float16 is the mixed kernel)")
    p.add_argument("--platform", type=parse_platform, default=DEFAULT_PLATFORM, metavar="SOC",
                   help=f"SoC preset: {', '.join(PRESETS)} (default: {DEFAULT_PLATFORM})")
    p.add_argument("--cores", type=positive_int, default=None, metavar="R",
                   help="vector cores R (default: the platform's)")
    p.add_argument("--ub", type=positive_int, default=None, metavar="BYTES",
                   help="UB bytes per core (default: the platform's)")
    p.set_defaults(func=run)
    return p


def trace_report(backend_name: str) -> str:
    """What ``opgraph run --trace`` prints after phase 2: the backend's kernel traces of the last
    run (ascend-sim), or one line saying why there are none."""
    traces = getattr(get(backend_name), "traces", None)
    if traces is None:
        return f"trace: backend {backend_name!r} records no kernel trace (use --backend ascend-sim)"
    if not traces:
        return ("trace: no SyncBatchNormBackwardElemt kernel ran on the simulator "
                "(fused away at level 2? try --level 0 or 1)")
    return "\n\n".join(str(t) for t in traces)
