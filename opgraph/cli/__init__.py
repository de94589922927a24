"""The ``opgraph`` command line: ``opgraph demo``, ``opgraph ops``, ``opgraph dump``, ``opgraph run``...

Each command is a module with ``add_parser(subparsers)`` that registers a subparser and sets
``func`` (``args -> exit status``); add a command by writing one module and listing it in
:data:`COMMANDS`. Commands that take an OP get one sub-parser per registered op_api
(:mod:`opgraph.cli.cases`); ``--load MODULE`` (a module name or a ``.py`` path, anywhere on the
command line) registers user op_apis first, as do the ``opgraph.op_apis`` entry points.

    >>> main(["--version"])  # doctest: +ELLIPSIS
    opgraph 0...
    0
"""
from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType
from typing import Optional, Sequence

import importlib.util

from backends.native.build import NativeBuildError
from opgraph import __version__
from opgraph.core.layout import LayoutUnavailable
from opgraph.core.opapi import load_entry_points, load_module
from . import capture, demo, dump, emit_c, emit_cpp, ops, plan, run, syncbn, tiling, view
from .common import READ_FILES, CliError, Parser, called_exit

COMMANDS = [demo, ops, dump, view, run, tiling, emit_c, plan, emit_cpp, syncbn, capture]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subcommand per module in :data:`COMMANDS`."""
    parser = Parser(
        prog="opgraph", allow_abbrev=False,  # (--loa would be argparse's --load, which main
        # takes from the line itself: it would be ignored)
        description="Record, inspect, optimise and run CANN aclnn operator graphs "
                    "(op_api + l0 ops) in Python.",
        epilog="run 'opgraph COMMAND --help' for the options of a command")
    parser.add_argument("--version", action="version", version=f"opgraph {__version__}")
    parser.add_argument("--traceback", action="store_true",
                        help="show the Python traceback of an unexpected error (may be given "
                             "anywhere on the command line)")
    parser.add_argument("--load", metavar="MODULE", action="append", default=[],
                        help="import MODULE (a module name or a .py file) that registers op_apis; "
                             "may be given anywhere on the command line, more than once")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI and return its exit status (0 ok, 1 failed op or error, 2 usage error,
    141 when stdout was closed early, as in ``opgraph dump ... | head -2``).

    >>> main(["dump", "nope"])
    2
    """
    if sys.stdout is None:  # started with stdout closed (``opgraph ops >&-``): nowhere to write
        _say("opgraph: error: stdout is closed")
        return 1
    for stream in (sys.stdout, sys.stderr):  # Σ, µs ... on an ASCII terminal: \u03a3, never a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        code = _run(argv)
        if not getattr(sys.stdout, "closed", False):
            sys.stdout.flush()  # a closed pipe shows here, not as "Exception ignored" at exit
    except BrokenPipeError:  # the reader went away: stop quietly, like a SIGPIPE'd tool
        _discard_stdout()
        return 141
    except OSError as e:  # stdout itself cannot take the output (a full disk ...)
        _discard_stdout()
        _say(f"opgraph: error: cannot write to stdout: {e.strerror or e}")
        return 1
    return code


def one_line(message: str, keep: int = 3) -> str:
    r"""``message`` on one line: its first ``keep`` non-blank lines joined by `` | `` (a
    compiler's output, say), then how many more there were.

    >>> one_line("C compiler failed (command: cc ...):\nk.c:1: error: x\n\nk.c:2: note: y\nz")
    'C compiler failed (command: cc ...): | k.c:1: error: x | k.c:2: note: y | (1 more line)'
    """
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    more = len(lines) - keep
    tail = [f"({more} more line{'s' if more > 1 else ''})"] if more > 0 else []
    return " | ".join(lines[:keep] + tail)


def _say(line: str) -> None:
    """Print one line on stderr; nothing when stderr is closed (print would use stdout)."""
    if sys.stderr is not None:
        print(line, file=sys.stderr)


def split_load(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(modules named by --load, the other arguments)`` from anywhere in ``argv``.

    >>> split_load(["dump", "aclnnX", "--load", "my.ops", "--load=b.py", "--level", "2"])
    (['my.ops', 'b.py'], ['dump', 'aclnnX', '--level', '2'])
    """
    mods, rest, it = [], [], iter(argv)
    for a in it:
        if a == "--load":
            mods.append(next(it, ""))
        elif a.startswith("--load="):
            mods.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    return mods, rest


USER_CODE: set[str] = set()  # files (and package directories, ending in os.sep) of --load'ed and
# installed (entry point) op_api modules


def load(target: str) -> None:
    """Import a module by name (installed, or in the current directory) or a ``.py`` file by
    path (CliError naming --load on failure); its code is noted in :data:`USER_CODE`."""
    try:
        if target.endswith(".py"):  # by its real path: one file is one module however named
            real = os.path.realpath(target)
            name = "opgraph_user_" + "".join(c if c.isalnum() else "_" for c in real)
            spec = importlib.util.spec_from_file_location(name, real)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {target!r}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            USER_CODE.add(real)
            READ_FILES.append(target)
            spec.loader.exec_module(module)
        elif os.path.isfile(target):  # `--load graph.json` would import graph, then graph.json
            raise CliError(f"--load {target!r}: a file that is not a .py file; --load takes a "
                           "module name or a .py file", code=2)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.append(os.getcwd())  # as `python -m` finds it; installed names first
            load_module(target)
            note_user_code(sys.modules[target])
    except (KeyboardInterrupt, CliError):
        raise
    except SystemExit as e:  # not a usage error of opgraph's: name the culprit
        raise CliError(f"--load {target!r}: the module {called_exit(e)}", code=2) from None
    except BaseException as e:  # the user's module: say what failed, in one line
        raise CliError(f"--load {target!r}: {type(e).__name__}: {e}", code=2) from None


def _run(argv: Optional[Sequence[str]]) -> int:
    wanted = False  # --traceback, taken from anywhere on the line
    try:
        READ_FILES.clear()  # (of an earlier main() in this process)
        mods, argv = split_load(sys.argv[1:] if argv is None else list(argv))
        wanted = "--traceback" in argv
        argv = [a for a in argv if a != "--traceback"]
        if "" in mods:
            raise CliError("--load: expected a module name or a .py path", code=2)
        for ep in load_entry_points():  # installed op_apis: user code too
            if ep.error is not None:
                _say(f"opgraph: warning: {ep.failure}")
            else:
                note_user_code(sys.modules[ep.module])
        for m in mods:
            load(m)
        parser = build_parser()
        args = parser.parse_args(argv)
        try:
            return int(args.func(args) or 0)
        except SystemExit as e:  # user code (an op_api --load registered) ended the command
            raise CliError(f"{args.command}: user code {called_exit(e)}") from None
    except SystemExit as e:  # --help, --version and usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except CliError as e:
        _say(f"opgraph: error: {one_line(str(e))}")
        return e.code
    except (NativeBuildError, LayoutUnavailable) as e:  # the C compiler, the kernel cache, no
        # graph layout engine (a page drawn by view or capture): the environment's
        if wanted:
            raise
        _say(f"opgraph: error: {one_line(str(e))}")
        return 1
    except KeyboardInterrupt:
        _say("opgraph: interrupted")
        return 130
    except BrokenPipeError:
        raise
    except OSError as e:  # the environment (a full disk ...), not a bug: one line
        if wanted:
            raise
        where = f": {e.filename}" if e.filename else ""
        _say(f"opgraph: error: {e.strerror or e}{where}")
        try:
            sys.stdout.flush()
        except OSError:  # it was stdout: what is still buffered would fail again at exit
            _discard_stdout()
        return 1
    except MemoryError:  # the limits of build_case are estimates; never a traceback for this
        _say("opgraph: error: out of memory (try a smaller --shape)")
        return 1
    except Exception as e:  # a bug: one line unless --traceback
        if wanted:
            raise
        if getattr(sys.stdout, "closed", False):  # user code (a capture step) closed it
            _say("opgraph: error: stdout was closed")
            return 1
        where = user_code_line(e)  # an op_api --load registered failed: not opgraph's bug
        label = f"error: in user code at {where}" if where else "internal error"
        _say(f"opgraph: {label}: {type(e).__name__}: {e} (rerun with --traceback)")
        return 1
    except BaseException as e:  # GeneratorExit and the like, from user code: one line
        if wanted:
            raise
        where = user_code_line(e)
        _say(f"opgraph: error: {f'in user code at {where}: ' if where else ''}{type(e).__name__}: "
             f"{e} (rerun with --traceback)")
        return 1


def note_user_code(module: ModuleType) -> None:
    """Count ``module``'s code (every file under it, for a package) as user code."""
    if getattr(module, "__path__", None):
        USER_CODE.update(os.path.join(os.path.realpath(d), "") for d in module.__path__)
    elif getattr(module, "__file__", None):
        USER_CODE.add(os.path.realpath(module.__file__))


def user_code_line(e: BaseException) -> Optional[str]:
    """``FILE:LINE`` of the innermost frame of ``e``'s traceback in code --load imported
    (:data:`USER_CODE`), or None: then the exception is opgraph's own."""
    found, tb = None, e.__traceback__
    while tb is not None:
        path = os.path.realpath(tb.tb_frame.f_code.co_filename)
        if any(path == u or (u.endswith(os.sep) and path.startswith(u)) for u in USER_CODE):
            found = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


def _discard_stdout() -> None:
    """Point the stdout descriptor at /dev/null so the interpreter's final flush of the
    closed pipe neither fails nor prints; nothing to do when stdout is not a real file."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


__all__ = ["COMMANDS", "build_parser", "main"]
