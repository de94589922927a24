"""Compile rendered C kernels with the system compiler, cache them on disk and in process, and
load them with ctypes.

The compiler is the first of ``$CC``, ``cc``, ``gcc``, ``clang`` found on PATH (``shutil.which``).
Flags are :data:`BASE_FLAGS` (exact IEEE float: no FMA contraction, no fast-math) plus
:data:`OPTIONAL_FLAGS` that the compiler accepts (``-march=native``, ``-fopenmp``; probed once, on
the first cache miss). A shared object is cached under :func:`cache_dir` as
``k_<sha256>.so`` keyed by the source, the compiler, its flags and the CPU; the exact command
line is stored next to it as ``k_<sha256>.cmd``.

    >>> ok, why = availability()
    >>> fn = load("int opg_kernel(void) { return 7; }") if ok else None  # compiled or cached
    >>> fn is None or len(fn.name) == 64
    True
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

COMPILERS = ("cc", "gcc", "clang")
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c11")
OPTIONAL_FLAGS = ("-march=native", "-fopenmp")
SYMBOL = "opg_kernel"

stats = {"compiles": 0, "disk_hits": 0, "memory_hits": 0}  # counters, for tests and benchmarks
_LOCK = threading.Lock()
_LOADED: dict[str, "Kernel"] = {}
_PROBED: dict[str, tuple[str, ...]] = {}


class NativeBuildError(RuntimeError):
    """The C compiler rejected a generated kernel; the message names the source file."""


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel: the ctypes function plus where it came from."""

    fn: Any               # the ctypes function opg_kernel
    name: str             # cache key (sha256 hex)
    library: Path
    source: Path


_FOUND: dict[tuple, tuple[Optional[str], list[str]]] = {}
_BY_SOURCE: dict[tuple, "Kernel"] = {}


def find_compiler() -> tuple[Optional[str], list[str]]:
    """``(absolute path or None, names tried)``: ``$CC`` first when set, then :data:`COMPILERS`.
    Memoised per ``(PATH, CC)``."""
    key = (os.environ.get("PATH", ""), os.environ.get("CC", ""))
    hit = _FOUND.get(key)
    if hit is None:
        hit = _FOUND[key] = _search_compiler()
    return hit[0], list(hit[1])


def _search_compiler() -> tuple[Optional[str], list[str]]:
    tried = []
    env = os.environ.get("CC", "").strip()
    for name in ([env] if env else []) + list(COMPILERS):
        if name in tried:
            continue
        tried.append(name)
        path = shutil.which(name)
        if path:
            return path, tried
    return None, tried


def availability() -> tuple[bool, str]:
    """``(True, "")`` when a C compiler is on PATH, else ``(False, one line saying so)``."""
    cc, tried = find_compiler()
    if cc is None:
        return False, f"no C compiler found (tried {', '.join(tried)})"
    return True, ""


def cache_dir() -> Path:
    """``$OPGRAPH_CACHE_DIR`` or ``$XDG_CACHE_HOME/opgraph/native`` or ``~/.cache/opgraph/native``."""
    explicit = os.environ.get("OPGRAPH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "opgraph" / "native"


def _cpu_tag() -> str:
    """Machine + CPU feature flags: ``-march=native`` objects must not travel between CPUs."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()}|{platform.system()}|{hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)


def flags(cc: str) -> tuple[str, ...]:
    """The flags used with ``cc``: :data:`BASE_FLAGS` + every accepted :data:`OPTIONAL_FLAGS`."""
    if cc in _PROBED:
        return _PROBED[cc]
    chosen = list(BASE_FLAGS)
    with tempfile.TemporaryDirectory(prefix="opgraph-probe-") as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("int opg_probe(int x) { return x + 1; }\n")
        for flag in OPTIONAL_FLAGS:
            if _run([cc, *chosen, flag, str(src), "-o", str(Path(tmp) / "probe.so")]).returncode == 0:
                chosen.append(flag)
    _PROBED[cc] = tuple(chosen)
    return _PROBED[cc]


def describe() -> str:
    """One line naming the compiler and the flags kernels are built with (for benchmark logs),
    e.g. ``'/usr/bin/cc -O3 -ffp-contract=off ... -march=native -fopenmp'``."""
    cc, tried = find_compiler()
    if cc is None:
        return f"no C compiler found (tried {', '.join(tried)})"
    return " ".join([cc, *flags(cc)])


def cache_key(source: str, cc: str, extra: Sequence[str] = ()) -> str:
    """sha256 of source + compiler + requested flags + CPU (probe results follow from these)."""
    parts = [source, os.path.realpath(cc), " ".join(BASE_FLAGS + OPTIONAL_FLAGS), " ".join(extra),
             _cpu_tag()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def compile_source(source: str, lib: Path, cc: str, extra: Sequence[str] = ()) -> list[str]:
    """Compile ``source`` to the shared object ``lib`` (written atomically); returns the command.
    Raises :class:`NativeBuildError` quoting the source path and the compiler's message."""
    lib.parent.mkdir(parents=True, exist_ok=True)
    src = lib.with_suffix(".c")
    src.write_text(source, encoding="utf-8")
    fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".so.tmp", dir=lib.parent)
    os.close(fd)
    cmd = [cc, *flags(cc), *extra, str(src), "-o", tmp]
    try:
        proc = _run(cmd)
        if proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip()
            raise NativeBuildError(f"C compiler failed on generated kernel {src} "
                                   f"(command: {' '.join(cmd)}):\n{msg}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    stats["compiles"] += 1
    lib.with_suffix(".cmd").write_text(" ".join(cmd[:-1] + [str(lib)]) + "\n", encoding="utf-8")
    return cmd


def load(source: str, extra: Sequence[str] = (), symbol: str = SYMBOL) -> Kernel:
    """The kernel ``symbol`` of ``source``: from memory, else the disk cache, else compiled now."""
    front = (source, tuple(extra), symbol, os.environ.get("OPGRAPH_CACHE_DIR"))
    hit = _BY_SOURCE.get(front)  # this process already loaded this exact source: no work at all
    if hit is not None:
        stats["memory_hits"] += 1
        return hit
    kernel = _load(source, extra, symbol)
    _BY_SOURCE[front] = kernel
    return kernel


def _load(source: str, extra: Sequence[str], symbol: str) -> Kernel:
    cc, tried = find_compiler()
    if cc is None:
        raise NativeBuildError(f"no C compiler found (tried {', '.join(tried)})")
    key = cache_key(source, cc, extra)
    with _LOCK:
        hit = _LOADED.get(key)
        if hit is not None:
            stats["memory_hits"] += 1
            return hit
        lib = cache_dir() / f"k_{key}.so"
        if lib.exists():
            stats["disk_hits"] += 1
        else:
            compile_source(source, lib, cc, extra)
        fn = getattr(ctypes.CDLL(str(lib)), symbol)
        kernel = Kernel(fn, key, lib, lib.with_suffix(".c"))
        _LOADED[key] = kernel
        return kernel


def forget() -> None:
    """Drop the in-process cache (the disk cache stays): the next load acts like a new process."""
    with _LOCK:
        _LOADED.clear()
        _BY_SOURCE.clear()
        _FOUND.clear()
