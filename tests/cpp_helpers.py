"""Shared by the emit-cpp tests: g++ against the fixture headers, a precompiled header of the
program prelude's standard #includes, and the CLI run in-process.

    >>> rc, out = run_cli(["emit-cpp", "aclnnBatchNormStats", "-o", "-"])
    >>> rc, "aclnnBatchNormStatsGetWorkspaceSize(" in out
    (0, True)
"""
from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
from pathlib import Path

import pytest

from backends.aclnn.emit_cpp import PRELUDE
from opgraph.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
INCLUDE = FIXTURES / "include"
GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ not installed: cannot compile emitted C++")
CXX = ["-std=c++17", "-Wall", "-Werror", "-I", str(INCLUDE), "-I", str(INCLUDE / "aclnn")]


def compile_cpp(src: Path, *extra: str) -> str:
    """g++ on ``src`` (``extra``: -fsyntax-only or -o/libraries); '' on success, else stderr."""
    r = subprocess.run([GXX, *CXX, str(src), *extra], capture_output=True, text=True)
    return "" if r.returncode == 0 else r.stderr


def precompiled_std(root: Path) -> list[str]:
    """Flags using a precompiled header of the prelude's own standard #includes (a program
    starts with exactly these, so nothing is masked; it makes each syntax check ~3x cheaper);
    [] when g++ cannot build it."""
    header = root / "prelude_std.h"
    header.write_text("".join(line + "\n" for line in PRELUDE.splitlines()
                              if line.startswith("#include <")))
    r = subprocess.run([GXX, *CXX, "-x", "c++-header", str(header), "-o", f"{header}.gch"],
                       capture_output=True)
    return ["-include", str(header), "-Winvalid-pch"] if r.returncode == 0 else []


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``opgraph ARGV`` in this process: (exit code, stdout and stderr together)."""
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return int(rc or 0), log.getvalue()
