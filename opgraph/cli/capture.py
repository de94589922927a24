"""``opgraph capture FILE``: run FILE's ``step(shape, dtype)`` inside ``opgraph.capture()`` and
show the program — the calls' graphs as one graph, optimised across them — with its launches,
collectives and bytes next to the same calls one by one. ``examples/capture_syncbn.py`` is a
SyncBatchNorm training step (forward + backward, two collectives).

    opgraph capture examples/capture_syncbn.py --shape 8,16,14,14 --level 2
    opgraph capture examples/capture_syncbn.py --format stats
    opgraph capture examples/capture_syncbn.py --format json -o step.json
    opgraph capture examples/capture_syncbn.py --format html -o step.html

The command's parser alone (nothing is imported or run until ``run``):

    >>> import argparse
    >>> p = add_parser(argparse.ArgumentParser(prog="opgraph").add_subparsers())
    >>> a = p.parse_args(["examples/capture_syncbn.py", "--shape", "2,3,4", "--format", "stats"])
    >>> a.file, a.shape, a.dtype.name, a.level, a.format, a.func is run
    ('examples/capture_syncbn.py', (2, 3, 4), 'FLOAT', None, 'stats', True)
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import math
import os
import sys
import time
from typing import Any, Callable, Sequence

from l0ops.collectives import is_collective
from opgraph.capture import CaptureError, Program, capture
from opgraph.core.backend import BackendUnavailable
from opgraph.core.dtypes import DataType
from .common import (READ_FILES, CliError, add_fast_math_option, called_exit,
                     check_fast_math_level, check_memory, check_output, conflict, fmt_bytes,
                     integer_option, names_stdout, parse_backend, parse_dtype, parse_shape,
                     write_output)
from .dump import render

FORMATS = ("text", "json", "dot", "table", "html", "stats")
COMMENTED = ("text", "table")  # the formats --run's "// replayed ..." line joins (JSON, DOT
# and HTML are read by programs: it would break JSON and show as text after an HTML page)


def load_step(path: str) -> Callable[..., Any]:
    """The ``step`` function of the Python file ``path`` (CliError naming FILE otherwise)."""
    if not os.path.isfile(path):
        why = ("is a directory" if os.path.isdir(path) else "is not a regular file"
               if os.path.exists(path) else "no such file")
        raise CliError(f"FILE {path!r}: {why}", code=2)
    name = "opgraph_capture_" + os.path.splitext(os.path.basename(path))[0]
    # read as Python source whatever its suffix (a .so or .pyc is not run as such)
    spec = importlib.util.spec_from_loader(name, importlib.machinery.SourceFileLoader(name, path))
    if spec is None or spec.loader is None:
        raise CliError(f"FILE {path!r}: not a Python file", code=2)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except SystemExit as e:
        raise CliError(f"FILE {path!r}: importing it {called_exit(e)}") from None
    except BaseException as e:  # (GeneratorExit and the like too: the file's own, in one line)
        raise CliError(f"FILE {path!r}: importing it failed: {type(e).__name__}: {e}") from None
    step = getattr(module, "step", None)
    if not callable(step):
        raise CliError(f"FILE {path!r}: defines no function step(shape, dtype) making the calls",
                       code=2)
    return step


def _capture(step: Callable[..., Any], shape: tuple, dtype: DataType, level: int,
             path: str, fast_math: bool = False) -> Program:
    try:
        with capture(level, fast_math=fast_math) as prog:
            step(shape, dtype.np)
    except CaptureError as e:
        raise CliError(f"capture: {e}") from None
    except KeyboardInterrupt:
        raise
    except SystemExit as e:
        raise CliError(f"FILE {path!r}: step() {called_exit(e)}") from None
    except BaseException as e:  # the file's own failure, in one line
        raise CliError(f"step() failed: {type(e).__name__}: {e}") from None
    return prog


def stats_table(step: Callable[..., Any], shape: tuple, dtype: DataType, path: str,
                levels: Sequence[int] = (0, 1, 2), fast_math: bool = False) -> str:
    """Launches, collectives and bytes per level: the program and the calls one by one."""
    rows = ["level  captured: launches  collectives  bytes moved   one by one: launches  "
            "collectives  bytes moved"]
    for level in levels:
        prog = _capture(step, shape, dtype, level, path, fast_math)
        s, o = prog.stats(), prog.stats_one_by_one()
        rows.append(f"{level:>5}  {s.launches:>18}  {s.collectives:>11}  {s.bytes_moved:>11}  "
                    f"{o.launches:>21}  {o.collectives:>11}  {o.bytes_moved:>11}")
    return "\n".join(rows) + "\n"


def _kind(n: Any) -> str:
    return "collective" if is_collective(n) else "free" if n.opdef.is_free(n) else "kernel"


def run(args: argparse.Namespace) -> int:
    """``opgraph capture``: capture FILE's step at ``--level`` and write the program in
    ``--format`` (``stats``: every level's counts, nothing replayed); returns 0, or raises
    CliError (a bad shape, FILE or step: one line)."""
    if args.format == "stats" and args.run:
        raise conflict("--format stats", "--run", "the stats table counts launches and bytes, it "
                       "replays nothing")
    READ_FILES.append(args.file)
    check_output(args.output)  # before the step runs (FILE itself is refused)
    shape = args.shape
    if len(shape) < 2 or math.prod(shape) == 0:
        raise CliError(f"--shape {','.join(map(str, shape))}: expected N,C[,...] with every dim "
                       ">= 1", code=2)
    check_memory(shape, math.prod(shape) * args.dtype.np.itemsize * 8, "the step's tensors")
    if args.level is not None:
        check_fast_math_level(args.fast_math, args.level)
    step = load_step(args.file)
    if args.format == "stats":  # every level, or the one --level names
        levels = (0, 1, 2) if args.level is None else (args.level,)
        return write_output(stats_table(step, shape, args.dtype, args.file, levels,
                                        args.fast_math), args.output)
    level = 2 if args.level is None else args.level
    prog = _capture(step, shape, args.dtype, level, args.file, args.fast_math)
    g = prog.graph if level == 0 else prog.compiled
    if args.format in ("json", "dot"):
        text = render(g, args.format)
    elif args.format == "html":
        text = g.to_html()
    elif args.format == "table":
        text = "".join(f"%{n.outputs[0].name:<6} {n.op:<36} {_kind(n)}\n" for n in g.nodes)
    else:
        s, o = prog.stats(), prog.stats_one_by_one()
        head = (f"// {len(prog.calls)} op_api calls and {s.collectives} collectives captured from "
                f"{args.file}, level {level}{' with fast-math' if prog.fast_math else ''}: "
                f"{s.launches} launches + {s.collectives} "
                f"collectives, {fmt_bytes(s.bytes_moved)} moved (one by one: {o.launches} + "
                f"{o.collectives}, {fmt_bytes(o.bytes_moved)})\n")
        text = head + str(g) + "\n"
    summary, aside = f"{len(g.nodes)} nodes", None
    if args.run:
        _replay(prog, args.run)  # the first run compiles for the backend
        start = time.perf_counter()
        _replay(prog, args.run)
        note = f"replayed on {args.run}: {(time.perf_counter() - start) * 1e3:.2f} ms"
        if args.format in COMMENTED:
            text += f"// {note}\n"
        elif names_stdout(args.output):  # JSON, DOT or HTML on stdout: the note beside them
            aside = f"opgraph: {note}"
        else:
            summary += f"; {note}"
    write_output(text, args.output, summary)
    if aside:
        sys.stdout.flush()  # (a stdout that cannot take the output fails first)
        print(aside, file=sys.stderr)
    return 0


def _replay(prog: Program, backend: str) -> None:
    """``prog.replay(backend=...)``; the backend's own failure (a plugin's compile or run) is one
    line naming it, as phase 2 reports it for the other commands."""
    try:
        prog.replay(backend=backend)
    except BackendUnavailable as e:
        raise CliError(f"--run: {e}") from None
    except Exception as e:
        raise CliError(f"--run: backend {backend!r} failed: {type(e).__name__}: {e}") from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``opgraph capture FILE`` and its options on ``subparsers``; returns its parser."""
    p = subparsers.add_parser(
        "capture", help="capture the op_api calls of a Python file's step() as one program",
        description="Imports FILE, runs its step(shape, dtype) inside opgraph.capture() and "
                    "prints the program graph (the calls chained, optimised across them) with "
                    "its launches, collectives and bytes next to the calls one by one.")
    p.add_argument("file", metavar="FILE", help="a .py file defining step(shape, dtype), e.g. "
                                                "examples/capture_syncbn.py")
    p.add_argument("--shape", type=parse_shape, default=(8, 16, 14, 14), help="N,C[,...] "
                   "(default 8,16,14,14)")
    p.add_argument("--dtype", type=parse_dtype, default=DataType.FLOAT, help="default float32")
    p.add_argument("--level", type=integer_option, choices=(0, 1, 2),
                   help="0 as recorded, 1 what CANN launches, 2 fused across the calls (default; "
                        "with --format stats: every level unless one is given)")
    p.add_argument("--format", choices=FORMATS, default="text",
                   help="text (default), json, dot, table (one row per node), html (the "
                        "viewer page: opgraph view's drawing) or stats (levels 0-2, or --level's, "
                        "side by side with the calls one by one)")
    p.add_argument("--run", type=parse_backend, metavar="BACKEND",
                   help="also replay the program on BACKEND and print the time")
    add_fast_math_option(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.set_defaults(func=run)
    return p
