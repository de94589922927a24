"""``opgraph emit-c OP``: record an op_api (same options as ``opgraph dump``), optimise it at
--level (default 2) and print the C kernel the ``native`` backend compiles for each FusedElementwise node.

    >>> from opgraph.cli import main
    >>> main(["emit-c", "aclnnBatchNormElemtBackward", "--shape", "2,3", "--dtype", "f16"])
    ... # doctest: +ELLIPSIS
    /* opgraph emit-c: aclnnBatchNormElemtBackward, node 0 (%...), level 2, ...
    0
"""
from __future__ import annotations

import argparse
from typing import Any

from backends.native import Unsupported, emit_c
from backends.native.build import BASE_FLAGS, OPTIONAL_FLAGS
from opgraph.passes import optimize
from .cases import add_op_subparsers, build_case, recorded_executor
from .common import CliError, write_output

LEVEL = 2


def run(args: argparse.Namespace) -> int:
    """``opgraph emit-c OP``: the C of every FusedElementwise node at ``--level`` (one the native
    backend cannot render: a comment saying why); CliError when there is none. Returns 0."""
    case = build_case(args)
    graph = optimize(recorded_executor(case).graph, case.level)
    chunks = []
    for i, node in enumerate(graph.nodes):
        if node.op != "FusedElementwise":
            continue
        head = (f"/* opgraph emit-c: {case.spec.name}, node {i} (%{node.outputs[0].name}), "
                f"level {case.level}, {case.platform}\n"
                f" * flags: {' '.join(BASE_FLAGS)} [+ {' '.join(OPTIONAL_FLAGS)} when accepted] */\n")
        try:
            chunks.append(head + emit_c(node))
        except Unsupported as e:
            chunks.append(head + f"/* not rendered (runs on numpy): {e} */\n")
    if not chunks:
        kernels = sorted({n.op for n in graph.nodes if not n.opdef.is_free(n)})
        why = ("fusion happens at --level 2" if case.level < LEVEL else
               f"its kernels: {', '.join(kernels) or 'none'}; emit-c prints FusedElementwise ones")
        raise CliError(f"no FusedElementwise node in the level-{case.level} graph of "
                       f"{case.spec.name} ({why})")
    text = "\n".join(chunks)
    return write_output(text, args.output, f"{len(chunks)} kernel(s)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``opgraph emit-c`` on ``subparsers``, one sub-parser per op_api; returns it."""
    p = subparsers.add_parser(
        "emit-c", help="print the C of the FusedElementwise kernels the native backend "
                  "compiles for an op_api",
        description="Record OP on random tensors of --shape/--dtype (phase 1 only), optimise at "
                    "--level (default 2) and print the C source of every FusedElementwise kernel.",
        epilog="example: opgraph emit-c aclnnBatchNormElemtBackward --shape 32,64,56,56 "
               "--dtype bfloat16 -o kernel.c")
    add_op_subparsers(p, _options, level_default=LEVEL)
    return p


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.set_defaults(func=run)
