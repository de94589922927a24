"""``opgraph plan OP``: record an op_api, optimise it and print its aclnn call plan (the public
C API calls the aclnn backend makes) as JSON or a readable listing.

    >>> from opgraph.cli import main
    >>> main(["plan", "aclnnBatchNormElemtBackward", "--shape", "2,3", "--level", "2"])
    ... # doctest: +ELLIPSIS
    plan aclnnBatchNormElemtBackward (level 2): 1 calls, ...
    0
"""
from __future__ import annotations

import argparse
from typing import Any

from backends.aclnn.lower import LoweringError, lower_executor
from backends.aclnn.plan import CallPlan
from opgraph.core.executor import Executor
from .cases import Case, add_op_subparsers, build_case, recorded_executor
from .common import CliError, write_output


def case_plan(args: argparse.Namespace) -> tuple[Case, Executor, CallPlan]:
    """``(case, executor, plan)`` for the op options (phase 1, then the lowering)."""
    case = build_case(args)
    ex = recorded_executor(case)
    try:
        return case, ex, lower_executor(ex)
    except LoweringError as e:
        raise CliError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    """``opgraph plan OP``: the op's call plan as a listing or JSON (``--format``); returns 0."""
    _, _, plan = case_plan(args)
    text = plan.to_json() if args.format == "json" else plan.listing()
    return write_output(text + "\n", args.output)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``opgraph plan`` on ``subparsers``, one sub-parser per op_api; returns it."""
    p = subparsers.add_parser(
        "plan", help="print the aclnn call plan of an op_api (json or listing)",
        description="Record OP on random tensors, optimise at --level and lower the graph to "
                    "public aclnn C API calls (tensors, buffers, calls in order).",
        epilog="example: opgraph plan aclnnBatchNormElemtBackward --shape 2,3,1,4 --level 1 "
               "--format json")
    add_op_subparsers(p, _options, level_default=2)
    return p


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("listing", "json"), default="listing",
                   help="output format (default: listing)")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.set_defaults(func=run)
