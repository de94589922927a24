"""``opgraph syncbn``: one SyncBatchNorm forward and backward across N CPU processes (gloo on
127.0.0.1, opgraph.torch.SyncBatchNorm), and the errors against single-process batch norm on
the whole batch. Needs torch (``pip install 'opgraph[torch]'``); without it, one line.

    opgraph syncbn --ranks 2 --shape 8,16,14,14 --dtype float16
    opgraph syncbn --ranks 3 --dtype bfloat16 --backend native   # on Ascend950's op_apis

The command's parser alone (no process starts until ``run``):

    >>> import argparse
    >>> p = add_parser(argparse.ArgumentParser(prog="opgraph").add_subparsers())
    >>> a = p.parse_args(["--ranks", "3", "--dtype", "bfloat16"])
    >>> a.ranks, a.dtype, a.shape, a.platform, a.timeout, a.func is run
    (3, 'bfloat16', (8, 16, 14, 14), None, 120, True)
"""
from __future__ import annotations

import argparse
import importlib
import math
from typing import Any

from opgraph.core.platform import DEFAULT as DEFAULT_PLATFORM
from opgraph.core.platform import PRESETS
from .common import (CliError, check_memory, parse_backend, parse_platform, parse_seed,
                     parse_shape, positive_int)

DTYPES = ("float32", "float16", "bfloat16")
MAX_RANKS = 64
BF16_PLATFORM = "Ascend950"  # the SoC whose BatchNormStats takes bfloat16
BYTES_PER_ELEMENT = 4 * 8  # float32 input, grad, output, grad_input and the reference's copies


def _check_module() -> Any:
    """opgraph.torch.check, imported only when the command runs: it needs torch, an optional
    dependency the rest of the CLI must not pay for (nor fail without)."""
    try:
        return importlib.import_module("opgraph.torch.check")
    except ImportError as e:
        raise CliError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    """``opgraph syncbn``: spawn ``--ranks`` processes, run SyncBatchNorm on them and print the
    errors against single-process batch norm; returns 0, or raises CliError (no torch, a bad
    shape, a rank that failed or timed out)."""
    shape = args.shape
    if len(shape) < 2 or shape[0] < 1 or shape[1] < 1 or math.prod(shape) == 0:
        raise CliError(f"--shape {','.join(map(str, shape))}: expected N,C[,...] with every dim "
                       ">= 1", code=2)
    if math.prod(shape) // shape[1] < 2:  # torch's BatchNorm refuses it in training
        raise CliError(f"--shape {','.join(map(str, shape))}: training batch norm needs more than "
                       "one value per channel (N times the spatial dims must be at least 2)",
                       code=2)
    check_memory(shape, math.prod(shape) * BYTES_PER_ELEMENT, "the tensors of all ranks")
    check = _check_module()
    soc = args.platform or (BF16_PLATFORM if args.dtype == "bfloat16" else DEFAULT_PLATFORM)
    try:
        r = check.compare(args.ranks, shape, args.dtype, seed=args.seed, backend=args.backend,
                          platform=soc, timeout=args.timeout)
    except check.RankError as e:
        raise CliError(e.summary) from None
    sizes = "+".join(map(str, r["sizes"]))
    print(f"SyncBatchNorm over {args.ranks} gloo ranks on 127.0.0.1, batch {sizes} of "
          f"[{','.join(map(str, shape))}] {args.dtype}, opgraph backend "
          f"{args.backend or 'numpy'} on {soc}")
    print("vs single-process batch norm (float32) on the whole batch:")
    print(f"  {'quantity':<14}{'max abs error':>15}{'relative':>12}")
    for name, (abs_err, rel_err) in r["errors"].items():
        print(f"  {name:<14}{abs_err:>15.3g}{rel_err:>12.3g}")
    print(f"rank 0, first call (records and compiles the graphs): forward "
          f"{r['forward_s'] * 1e3:.1f} ms, backward {r['backward_s'] * 1e3:.1f} ms")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``opgraph syncbn`` and its options on ``subparsers``; returns its parser."""
    p = subparsers.add_parser(
        "syncbn", help="SyncBatchNorm across N CPU processes vs single-process batch norm",
        description="Spawns N processes in a gloo group on 127.0.0.1, splits the batch over them "
                    "(unevenly when N does not divide it; ranks may be empty), runs "
                    "opgraph.torch.SyncBatchNorm forward and backward, and prints the largest "
                    "errors of the output, running stats and gradients against single-process "
                    "batch norm on the whole batch. Needs torch (pip install 'opgraph[torch]').",
        epilog="example: opgraph syncbn --ranks 2 --shape 8,16,14,14 --dtype float16")
    p.add_argument("--ranks", type=_ranks, default=2, metavar="N",
                   help=f"number of processes, 2..{MAX_RANKS} (default: 2)")
    p.add_argument("--shape", type=parse_shape, default=(8, 16, 14, 14), metavar="N,C,...",
                   help="the whole batch's shape (default: 8,16,14,14)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="input and gradient dtype (default: float32)")
    p.add_argument("--backend", type=parse_backend, default=None, metavar="NAME",
                   help="opgraph backend the op_apis run on: any registered one (default: numpy)")
    p.add_argument("--platform", type=parse_platform, default=None, metavar="SOC",
                   help=f"SoC preset of the op_apis: {', '.join(PRESETS)} (default: "
                        f"{BF16_PLATFORM} for bfloat16, whose statistics only it takes; else "
                        f"{DEFAULT_PLATFORM})")
    p.add_argument("--seed", type=parse_seed, default=0, metavar="N",
                   help="random seed, 0 to 2**63-1 (default: 0)")
    p.add_argument("--timeout", type=positive_int, default=120, metavar="SECONDS",
                   help="give up (and stop every process) when the ranks have run this long; "
                        "starting them, a few seconds, is not counted (default: 120)")
    p.set_defaults(func=run)
    return p


def _ranks(text: str) -> int:
    n = positive_int(text)
    if not 2 <= n <= MAX_RANKS:
        raise argparse.ArgumentTypeError(
            f"expected 2..{MAX_RANKS} (one rank is ordinary batch norm), got {text!r}")
    return n
