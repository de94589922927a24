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
import os
from typing import Any

from opgraph.core.ir import Graph
from opgraph.passes import (DumpInstrument, PassManager, PrintInstrument, graph_stats, optimize,
                            pipeline)
from .cases import add_op_subparsers, build_case, recorded_executor
from .common import CliError, write_output

FORMATS = ("text", "json", "dot")


def render(graph: Graph, fmt: str) -> str:
    """The graph in ``fmt`` (text / json / dot), ending with a newline."""
    text = {"text": str, "json": Graph.to_json, "dot": Graph.to_dot}[fmt](graph)
    return text if text.endswith("\n") else text + "\n"


def print_stats(graph: Graph, fast_math: bool = False) -> None:
    """Levels 0/1/2 side by side: nodes, kernel launches, bytes moved, workspace bytes."""
    rows = [("level", "nodes", "launches", "bytes moved", "workspace")]
    for level in (0, 1, 2):
        st = graph_stats(optimize(graph, level, fast_math=fast_math and level == 2))
        rows.append((str(level), str(st.nodes), str(st.launches), str(st.bytes_moved), str(st.workspace)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def fusion_note(graph: Graph) -> "str | None":
    """A line saying level 2 fused nothing, and which kernels could not be fused (None when it
    fused something or there was nothing to fuse)."""
    fused = optimize(graph, 2)
    if any(n.op == "FusedElementwise" for n in fused.nodes):
        return None
    stuck = sorted({n.op for n in fused.nodes if not n.opdef.is_free(n) and n.opdef.expand is None
                    and not n.opdef.has_effects})
    if not stuck:
        return None
    return (f"note: level 2 fused nothing: {', '.join(stuck)} define no expansion into elementwise "
            "primitives (see README 'Define an l0 op')")


def check_dump_dir(path: str) -> None:
    """CliError naming --dump-dir unless ``path`` is a directory or could become one."""
    if not path:
        raise CliError("--dump-dir: empty path", code=2)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CliError(f"--dump-dir {path!r}: exists and is not a directory", code=2)


def run_passes(graph: Graph, args: argparse.Namespace, level: int) -> None:
    """--passes / --dump-dir: run --level's pipeline printing and/or writing every step."""
    instruments = [PrintInstrument()] if args.passes else []
    try:
        if args.dump_dir is not None:
            dumps = DumpInstrument(args.dump_dir)
            instruments.append(dumps)
        PassManager(pipeline(level, args.fast_math), instruments).run(graph)
    except OSError as e:
        if args.dump_dir is None or e.filename is None:  # stdout, not the directory: main's job
            raise
        raise CliError(f"--dump-dir {args.dump_dir!r}: cannot write {e.filename!r}: "
                       f"{e.strerror or e}") from None
    if args.dump_dir is not None:
        print(f"wrote {len(dumps.files)} files to {args.dump_dir} (NN-<pass>.txt/.json/.dot)")


def run(args: argparse.Namespace) -> int:
    if args.dump_dir is not None:
        check_dump_dir(args.dump_dir)
    case = build_case(args)
    graph = recorded_executor(case).graph
    if args.stats or args.passes or args.dump_dir is not None:
        if args.stats:
            print_stats(graph, args.fast_math)
        else:
            run_passes(graph, args, case.level)
        note = fusion_note(graph) if args.stats or case.level == 2 else None
        if note:
            print(note)
        return 0
    if case.level > 0 or args.fast_math:
        graph = optimize(graph, case.level, fast_math=args.fast_math)
    text = render(graph, args.format)
    return write_output(text, args.output, f"{args.format}, {len(graph.nodes)} nodes (level {case.level})")


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMATS, default="text", help="dump format (default: text)")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument("--passes", action="store_true",
                   help="print the graph after each pass of --level's pipeline, with its stats")
    p.add_argument("--dump-dir", metavar="DIR",
                   help="write the graph before and after each pass as numbered text/JSON/DOT files")
    p.add_argument("--stats", action="store_true",
                   help="print nodes, kernel launches, bytes moved and workspace for levels 0, 1, 2")
    p.add_argument("--fast-math", action="store_true",
                   help="add the opt-in, NOT bit-exact fast-math rewrites")
    p.set_defaults(func=run)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "dump", help="record an op_api and dump its graph (text, json, dot)",
        description="Record OP on random tensors of --shape/--dtype (phase 1 only) and print "
                    "executor.graph (--level 0) or opgraph.passes.optimize(graph, level).",
        epilog="example: opgraph dump aclnnBatchNormElemtBackward --shape 2,3,1,4 "
               "--dtype float16 --format dot -o g.dot ('opgraph dump OP --help' lists OP's options)")
    add_op_subparsers(p, _options, level_default=0)
    return p
