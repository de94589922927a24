"""``opgraph demo``: the article's example program (ops-nn examples/test_aclnn_batch_norm_elemt_
backward*.cpp), end to end, in FLOAT, FLOAT16 and BFLOAT16.

    >>> from opgraph.cli import main
    >>> main(["demo", "--dtype", "float32", "--no-graph"])  # doctest: +ELLIPSIS
    == aclnnBatchNormElemtBackward, FLOAT on Ascend910B ...
    ...
    result[7] is: 6.300000
    <BLANKLINE>
    0
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from opgraph import aclnn
from opgraph.core.dtypes import DataType
from opgraph.core.platform import DEFAULT as DEFAULT_PLATFORM
from opgraph.core.platform import get_platform, platform
from opgraph.core.status import Status
from opgraph.core.tensor import tensor
from .common import CliError, fmt_status, fmt_type, parse_dtype, parse_platform

VARIANTS = (DataType.FLOAT, DataType.FLOAT16, DataType.BF16)
SOURCES = {DataType.FLOAT: "test_aclnn_batch_norm_elemt_backward.cpp",
           DataType.FLOAT16: "test_aclnn_batch_norm_elemt_backward_half.cpp",
           DataType.BF16: "test_aclnn_batch_norm_elemt_backward_bfloat16.cpp"}


def article_arrays(dtype: DataType) -> dict[str, np.ndarray]:
    """The article's data: gradOut = input = 0..7 of shape (1,2,4), mean {0,0}, invstd {1,1},
    weight {1,1}, sumDy {0,0}, sumDyXmu {1,1}, counter {5,5} (FLOAT), gradInput zeros."""
    d = dtype.np
    x = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    ch = lambda *v: np.asarray(v, dtype=np.float32).astype(d)  # noqa: E731
    return {"gradOut": x.astype(d), "input": x.astype(d), "mean": ch(0, 0), "invstd": ch(1, 1),
            "weight": ch(1, 1), "sumDy": ch(0, 0), "sumDyXmu": ch(1, 1),
            "counter": np.float32([5, 5]), "gradInput": np.zeros((1, 2, 4), d)}


def run_variant(dtype: DataType, show_graph: bool = True) -> bool:
    """One example program; prints its flow and returns True when every status was success."""
    print(f"== aclnnBatchNormElemtBackward, {dtype.name} on {get_platform().soc} "
          f"(ops-nn examples/{SOURCES.get(dtype, '')}) ==")
    arrays = article_arrays(dtype)
    print("1. create tensors")
    tensors = {k: tensor(a) for k, a in arrays.items()}
    for k, t in tensors.items():
        print(f"   {k:<9} {fmt_type(t)} = {[float(v) for v in arrays[k].ravel()]}")

    ret, ws, executor = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*tensors.values())
    print(f"2. aclnnBatchNormElemtBackwardGetWorkspaceSize: ret = {fmt_status(ret)}, "
          f"workspaceSize = {ws}")
    if not _ok(ret):
        return False
    if show_graph:
        print("   recorded graph (executor.graph):")
        print(executor.graph)

    workspace: Any = bytearray(ws) if ws > 0 else None
    print(f"3. workspace: {'allocated ' + str(ws) + ' bytes' if workspace else 'none (size 0)'}")
    ret = aclnn.aclnnBatchNormElemtBackward(workspace, ws, executor, None)
    print(f"4. aclnnBatchNormElemtBackward: ret = {fmt_status(ret)}")
    if not _ok(ret):
        return False
    print(f"5. copy gradInput back ({dtype.name}, printed as float):")
    for i, v in enumerate(arrays["gradInput"].ravel()):
        print(f"result[{i}] is: {float(v):f}")
    print()
    return True


def _ok(ret: Status) -> bool:
    if ret != Status.ACLNN_SUCCESS:
        print(f"   CHECK_RET failed: {aclnn.aclGetRecentErrMsg()}")
        return False
    return True


def parse_variant(text: str) -> DataType:
    """A dtype the article has an example program for (float32, float16, bfloat16)."""
    d = parse_dtype(text)
    if d not in VARIANTS:
        raise argparse.ArgumentTypeError(
            f"the article's examples are {', '.join(v.name for v in VARIANTS)}; got {d.name}")
    return d


def run(args: argparse.Namespace) -> int:
    """Run the selected variants; a CliError (exit status 1) if any status was not success."""
    with platform(args.platform):
        failed = [d.name for d in args.dtype or VARIANTS
                  if not run_variant(d, show_graph=not args.no_graph)]
    if failed:
        raise CliError(f"--platform {args.platform}: the {', '.join(failed)} example failed "
                       f"(CHECK_RET above)")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``opgraph demo`` (``--dtype``, repeatable; ``--platform``; ``--no-graph``) on
    ``subparsers``; returns its parser."""
    p = subparsers.add_parser(
        "demo", help="run the article's example (FLOAT, FLOAT16, BFLOAT16) end to end",
        description="The article's example program: gradOut = input = 0..7 (shape 1,2,4), "
                    "mean 0, invstd 1, weight 1, sumDy 0, sumDyXmu 1, counter {5,5}. Phase 1 "
                    "prints the status, workspace size and the recorded graph; phase 2 the "
                    "status and result[i] = 0.9*i. Exit status 1 if any status is not success.")
    p.add_argument("--dtype", type=parse_variant, action="append", metavar="DTYPE",
                   help="run only this variant (float32, float16, bfloat16); repeatable")
    p.add_argument("--platform", type=parse_platform, default=DEFAULT_PLATFORM, metavar="SOC",
                   help=f"SoC preset (default: {DEFAULT_PLATFORM})")
    p.add_argument("--no-graph", action="store_true", help="do not print the recorded graphs")
    p.set_defaults(func=run)
    return p
