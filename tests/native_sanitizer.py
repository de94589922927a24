"""A test helper: the native backend under AddressSanitizer. A child Python runs with GCC's ASan
runtime preloaded and ``$CC`` compiling every kernel (and the thread team) with
``-fsanitize=address``: numpy's buffers then come from the runtime's malloc with poisoned
red zones around them, so a kernel that reads or writes past a tensor's memory stops the child
with a report, even where the bits it leaves are right.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     env = sanitized_env(d)  # None: no GCC with libasan here
    ...     print(env is None or "-fsanitize=address" in open(f"{d}/cc-asan").read())
    True

``python tests/native_sanitizer.py [K/N]`` runs :func:`workload` (part K of N), as the test's
children do.
"""
from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest

from backends.native import compiler
from native_limits import reduce_limits_at
from opgraph.core.opapi import get_op_api, op_api_specs
from opgraph.testing import check_backend

SANITIZE = ("-O0", "-fsanitize=address", "-fno-omit-frame-pointer")  # after the backend's flags
ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = ("Ascend910B", "Ascend950")


def asan_runtime(cc: Sequence[str]) -> Optional[str]:
    """The path of ``cc``'s ASan runtime (libasan.so), or None when it is not GCC with one."""
    found = compiler.run(cc, ["-print-file-name=libasan.so"])
    path = found.stdout.strip()
    return path if found.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


def sanitized_env(directory: str) -> Optional[dict[str, str]]:
    """The environment of a sanitized child, or None when no compiler with an ASan runtime is
    found. In ``directory``: the compiler, a script that runs the backend's own with
    :data:`SANITIZE` after its flags (``-O0`` must follow the backend's ``-O2``; unoptimised
    kernels compile in half the time and must still give the reference's bits), and the
    kernels it builds."""
    cc, _ = compiler.find_compiler()
    runtime = asan_runtime(cc) if cc else None
    if runtime is None:
        return None
    wrapper = Path(directory) / "cc-asan"
    # (the compiler itself runs without the preloaded runtime, which would only slow it)
    wrapper.write_text(f'#!/bin/sh\nunset LD_PRELOAD\nexec {shlex.join(cc)} "$@" {shlex.join(SANITIZE)}\n')
    env = dict(os.environ)
    env.update(CC=shlex.join([shutil.which("sh") or "/bin/sh", str(wrapper)]),  # (tmp: noexec?)
               OPGRAPH_CACHE_DIR=str(Path(directory) / "kernels"),
               LD_PRELOAD=runtime,
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=86",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


def run_child(args: Sequence[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``python args...`` in ``env``, killed after ``timeout`` seconds (TimeoutExpired)."""
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def run_workload(env: dict[str, str], parts: int, timeout: float) -> list[tuple[int, str, str]]:
    """:func:`workload` split over ``parts`` children run at once (the compiles dominate);
    ``(exit code, stdout, stderr)`` of each. Every child is killed if they are not all done
    within ``timeout`` seconds (then TimeoutExpired)."""
    children = [subprocess.Popen([sys.executable, __file__, f"{k}/{parts}"], env=env, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for k in range(parts)]
    try:
        outs = [c.communicate(timeout=timeout) for c in children]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.communicate()
    return [(c.returncode, out, err) for c, (out, err) in zip(children, outs)]


def large_shape(shape: Sequence[int], elements: int = 1 << 21) -> tuple[int, ...]:
    """``shape`` with 64 channels (dim 1, from rank 3) and its last dim grown to a multiple of 64
    that makes it at least ``elements``: 8 MiB of float32 by default, so that the outputs are
    stored non-temporally (rows of whole cache lines, channels-last ones too) and run on the
    threads.

        >>> large_shape((2, 3, 4, 5))
        (2, 64, 4, 4096)
        >>> large_shape((4, 8))
        (4, 524288)
    """
    shape = (shape[0], 64, *shape[2:]) if len(shape) >= 3 else tuple(shape)
    head = math.prod(shape[:-1]) or 1
    return (*shape[:-1], -(-elements // head // 64) * 64)


RUNS = ("thresholds", "reductions in C at any size", "large")  # what workload prints, in order


def share(part: int, parts: int) -> dict[str, list[str]]:
    """Part ``part`` of ``parts`` of the work: ``{platform: [op_api, ...]}``. The op_apis with an
    input generator, by name, and each one's platforms (the k-th op_api's list turned by k) are
    dealt out in turn, so that every part gets some of each platform's kernels to compile.

        >>> sorted(share(0, 1)) == sorted(PLATFORMS)
        True
    """
    names = sorted(n for n, s in op_api_specs().items() if s.make_inputs is not None)
    out: dict[str, list[str]] = {}
    turn = 0
    for k, name in enumerate(names):
        socs = [p for p in PLATFORMS if p in get_op_api(name).platforms]
        for soc in socs[k % len(socs):] + socs[:k % len(socs)]:  # each op_api starts on another
            if turn % parts == part:
                out.setdefault(soc, []).append(name)
            turn += 1
    return out


def unit(name: str, soc: str) -> str:
    """How a workload's line names what it ran: ``op_api@platform``."""
    return f"{name}@{soc}"


def checked(names: Sequence[str], soc: str, **how: Any) -> int:
    """The kit's cases of op_apis ``names`` on ``soc`` through native at level 2 (``how``: the
    kit's other arguments); raises AssertionError with its report on a mismatch."""
    report = check_backend("native", op_apis=names, levels=(2,), platforms=[soc], **how)
    if not report.ok:
        raise AssertionError(str(report))
    return report.cases


def workload(part: int = 0, parts: int = 1) -> None:
    """Part ``part`` of ``parts`` of the op_apis the kit knows (:func:`share`) through native at
    level 2, each output's bits compared with the numpy reference: every dtype and flag,
    contiguous, strided and channels-last, at the kit's shapes, once at the backend's thresholds
    (small reductions as one serial C call) and once with the reductions' C passes at every
    size; then float32 at a :func:`large_shape`. Raises on a mismatch; prints a line a run:
    ``<run>: <cases> cases by <seconds> s: <op_api@platform> ...``."""
    start, work = time.monotonic(), share(part, parts)
    ran = " ".join(unit(name, soc) for soc, names in work.items() for name in names)

    def line(run: str, cases: int) -> None:
        print(f"{run}: {cases} cases by {time.monotonic() - start:.1f} s: {ran}", flush=True)

    layouts = ("contiguous", "strided", "channels_last")
    line(RUNS[0], sum(checked(names, soc, layouts=layouts) for soc, names in work.items()))
    with pytest.MonkeyPatch.context() as limits:
        reduce_limits_at(limits, 0)
        line(RUNS[1], sum(checked(names, soc, layouts=layouts) for soc, names in work.items()))
    line(RUNS[2], sum(checked([name], soc, dtypes=("float32",),
                              layouts=("contiguous", "channels_last"),
                              shapes=[large_shape(get_op_api(name).default_shape)])
                      for soc, names in work.items() for name in names))


if __name__ == "__main__":
    k, n = sys.argv[1].split("/") if len(sys.argv) > 1 else ("0", "1")
    workload(int(k), int(n))
