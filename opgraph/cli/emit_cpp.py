"""``opgraph emit-cpp OP -o prog.cpp``: a complete C++ host program that runs the op's call plan
on a device with the real aclnn C API (inputs from the random case; large ones as ``.bin`` files
next to the program).

    >>> import os, tempfile
    >>> from opgraph.cli import main
    >>> d = tempfile.mkdtemp()
    >>> main(["emit-cpp", "aclnnBatchNormElemtBackward", "--shape", "2,3", "-o",
    ...       os.path.join(d, "p.cpp")])  # doctest: +ELLIPSIS
    wrote ...p.cpp: 1 aclnn calls (level 2), 0 .bin files
    0
    >>> sorted(os.listdir(d))
    ['p.cpp']
    >>> import shutil; shutil.rmtree(d)
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from backends.aclnn.emit_cpp import emit_cpp
from .cases import add_op_subparsers
from .common import (CliError, check_memory, check_output, names_stdout, non_negative_int, same_path,
                     write_output)
from .plan import case_plan

BIN_OPTION = "-o/--output (its .bin inputs)"
EMBED_BYTES = 128  # memory an embedded element takes while the program text is built (measured ~110)


def run(args: argparse.Namespace) -> int:
    """``opgraph emit-cpp OP``: the host program of the op's call plan, and beside it the
    ``.bin`` files of inputs over ``--embed-limit`` elements, written all or none. Returns 0."""
    _, ex, plan = case_plan(args)
    data = {k: t.storage for k, t in ex.bindings.items() if t is not None}
    embedded = sum(a.size for a in data.values() if a.size <= args.embed_limit)
    check_memory(args.shape, embedded * EMBED_BYTES,
                 f"the inputs embedded as C++ text (~{EMBED_BYTES} B an element while it is built)",
                 f" --embed-limit {args.embed_limit}")
    src, files = emit_cpp(plan, data, embed_limit=args.embed_limit)
    to_file = not names_stdout(args.output)
    folder = os.path.dirname(os.path.abspath(args.output)) if to_file else "."
    bins = {os.path.join(folder, name): blob for name, blob in files.items()}
    check_output(args.output)
    if bins and to_file and os.path.exists(args.output) and not os.path.isfile(args.output):
        raise CliError(f"-o/--output {args.output!r} is not a regular file: the program's "
                       f"{len(bins)} .bin input files are written beside it; name a file", code=2)
    for path in bins:  # all of them before writing any
        if to_file and same_path(args.output, path):
            raise CliError(f"-o/--output {args.output!r}: the program would overwrite its input "
                           f"data {os.path.basename(path)}: choose another name", code=2)
        check_output(path, BIN_OPTION)
    # all or none: the .bin files and the program (a failed write leaves none of them)
    write_output(src, args.output, f"{len(plan.calls)} aclnn calls (level {plan.level}), "
                 f"{len(files)} .bin files", also=[(path, blob, BIN_OPTION) for path, blob in bins.items()])
    if bins and not to_file:
        print(f"opgraph: wrote the program's {len(bins)} .bin input files to {folder}", file=sys.stderr)
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``opgraph emit-cpp`` on ``subparsers``, one sub-parser per op_api; returns it."""
    p = subparsers.add_parser(
        "emit-cpp", help="emit a C++ host program calling the real aclnn API",
        description="Record OP, optimise at --level, lower it to aclnn calls and write a complete "
                    "CANN-style host program (init, tensors, two-phase calls, results, cleanup).",
        epilog="example: opgraph emit-cpp aclnnBatchNormElemtBackward --shape 8,16,7,7 --level 1 "
               "-o prog.cpp && g++ -std=c++17 prog.cpp -I$ASCEND_HOME_PATH/include "
               "-L$ASCEND_HOME_PATH/lib64 -lascendcl -lnnopbase -lopapi_math -lopapi_nn")
    add_op_subparsers(p, _options, level_default=2)
    return p


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", metavar="FILE", help="write the program to FILE (default: stdout)")
    p.add_argument("--embed-limit", type=non_negative_int, default=4096, metavar="N",
                   help="inputs with more than N elements go to <name>.bin files (default: 4096)")
    p.set_defaults(func=run)
