"""``opgraph dump OP``: record an op_api on random tensors and dump its graph as text, JSON or DOT,
as recorded (level 0) or after ``opgraph.passes.optimize(graph, level)``.

    >>> from opgraph.cli import main
    >>> main(["dump", "aclnnBatchNormElemtBackward", "--shape", "2,3", "--format", "text"])
    ... # doctest: +ELLIPSIS
    graph aclnnBatchNormElemtBackward(%gradOut: f32[2,3], ...
    0
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ..ir import Graph
from ..passes import optimize
from .common import CliError, add_op_options, build_case, check, record

FORMATS = ("text", "json", "dot")


def render(graph: Graph, fmt: str) -> str:
    """The graph in ``fmt`` (text / json / dot), ending with a newline."""
    text = {"text": str, "json": Graph.to_json, "dot": Graph.to_dot}[fmt](graph)
    return text if text.endswith("\n") else text + "\n"


def run(args: argparse.Namespace) -> int:
    case = build_case(args)
    rec = record(case)
    check(rec.status, f"{case.spec.name}GetWorkspaceSize")
    graph = rec.executor.graph
    if case.level > 0:
        graph = optimize(graph, case.level)
    text = render(graph, args.format)
    if args.output in (None, "-"):
        sys.stdout.write(text)
        return 0
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise CliError(f"cannot write {args.output}: {e.strerror or e}") from None
    print(f"wrote {args.output}: {args.format}, {len(graph.nodes)} nodes (level {case.level})")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "dump", help="record an op_api and dump its graph (text, json, dot)",
        description="Record OP on random tensors of --shape/--dtype (phase 1 only) and print "
                    "executor.graph (--level 0) or opgraph.passes.optimize(graph, level).",
        epilog="example: opgraph dump aclnnBatchNormElemtBackward --shape 2,3,1,4 "
               "--dtype float16 --format dot -o g.dot")
    add_op_options(p, level_default=0)
    p.add_argument("--format", choices=FORMATS, default="text", help="dump format (default: text)")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.set_defaults(func=run)
    return p
