"""The native backend's C compiler: which command, with which flags, run how.

The compiler is a command of one or more words. ``$CC``, when set, is split into words as a
shell (and make) would (:func:`shlex.split`), so a launcher in front works: ``CC="ccache gcc"``
runs ``ccache gcc -O2 ...``; its first word is looked up on PATH, and nothing else is tried (a
compiler the user named is not swapped for another). Otherwise it is the first of
:data:`COMPILERS` found on PATH. Flags are :data:`BASE_FLAGS` (exact IEEE float: no FMA
contraction, no fast-math) plus :data:`OPTIONAL_FLAGS` that the compiler accepts (probed once).
A command that cannot start or runs past :data:`COMPILE_TIMEOUT` is a :class:`NativeBuildError`
naming the compiler.

    >>> split_cc("ccache 'my gcc' -m64")
    ['ccache', 'my gcc', '-m64']
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

COMPILERS = ("cc", "gcc", "clang")
BASE_FLAGS = ("-O2", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c11")
OPTIONAL_FLAGS = ("-march=native", "-fopenmp")
COMPILE_TIMEOUT = 120        # seconds a compiler command may take

Command = tuple[str, ...]    # the compiler: its program (an absolute path), then its own words
_FOUND: dict[tuple, tuple[Optional[Command], list[str], str]] = {}
_PROBED: dict[Command, tuple[str, ...]] = {}


class NativeBuildError(RuntimeError):
    """The C compiler rejected a generated kernel (the message names the source file), or the
    disk cache is not private or not configured right (the message names the path or setting)."""


def split_cc(value: str) -> list[str]:
    """``$CC``'s words, split as a shell would; ValueError for unbalanced quotes."""
    return shlex.split(value)


def find_compiler() -> tuple[Optional[Command], list[str]]:
    """``(compiler command or None, names tried)``: ``$CC`` when set (and nothing else), else
    :data:`COMPILERS`; the command's first word is an absolute path. Memoised per
    ``(PATH, CC)``."""
    found = _search()
    return found[0], list(found[1])


def _search() -> tuple[Optional[Command], list[str], str]:
    """``(command or None, names tried, why None)``, memoised per ``(PATH, CC)``."""
    key = (os.environ.get("PATH", ""), os.environ.get("CC", ""))
    hit = _FOUND.get(key)
    if hit is None:
        hit = _FOUND[key] = _search_compiler(key[1].strip())
    return hit


def _search_compiler(env: str) -> tuple[Optional[Command], list[str], str]:
    if env:
        try:
            words = split_cc(env)
        except ValueError as e:
            return None, [env], f"$CC is {env!r}, which cannot be split into words as a shell would: {e}"
        path = shutil.which(words[0]) if words else None
        if path:
            return (path, *words[1:]), [env], ""
        where = f" (its program {words[0]!r})" if len(words) > 1 else ""
        return None, [env], (f"$CC is {env!r}, which{where} is not found on PATH (unset CC to use "
                             f"one of {', '.join(COMPILERS)})")
    for i, name in enumerate(COMPILERS):
        path = shutil.which(name)
        if path:
            return (path,), list(COMPILERS[:i + 1]), ""
    return None, list(COMPILERS), f"no C compiler found (tried {', '.join(COMPILERS)})"


def availability() -> tuple[bool, str]:
    """``(True, "")`` when a C compiler is on PATH, else ``(False, one line saying so)``."""
    cc, _, why = _search()
    return (True, "") if cc is not None else (False, why)


def require_compiler() -> Command:
    """The compiler command; NativeBuildError saying why when there is none."""
    cc, _, why = _search()
    if cc is None:
        raise NativeBuildError(why)
    return cc


def run(cc: Sequence[str], args: Sequence[str]) -> subprocess.CompletedProcess:
    """The result of the compiler command ``cc`` with ``args``; NativeBuildError naming the
    compiler if it cannot start or times out."""
    cmd = [*cc, *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise NativeBuildError(f"the C compiler {shlex.join(cc)} did not finish in {COMPILE_TIMEOUT} s "
                               f"(command: {shlex.join(cmd)})") from None
    except OSError as e:
        raise NativeBuildError(f"cannot run the C compiler {shlex.join(cc)}: {e.strerror or e}") from None


def flags(cc: Sequence[str]) -> tuple[str, ...]:
    """The flags used with ``cc``: :data:`BASE_FLAGS` + every accepted :data:`OPTIONAL_FLAGS`."""
    key = tuple(cc)
    if key in _PROBED:
        return _PROBED[key]
    chosen = list(BASE_FLAGS)
    with tempfile.TemporaryDirectory(prefix="opgraph-probe-") as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("int opg_probe(int x) { return x + 1; }\n")
        for flag in OPTIONAL_FLAGS:
            if run(key, [*chosen, flag, str(src), "-o", str(Path(tmp) / "probe.so")]).returncode == 0:
                chosen.append(flag)
    _PROBED[key] = tuple(chosen)
    return _PROBED[key]


def describe() -> str:
    """One line naming the compiler and the flags kernels are built with (for benchmark logs),
    e.g. ``'/usr/bin/cc -O2 -ffp-contract=off ... -march=native -fopenmp'``."""
    cc, _, why = _search()
    return why if cc is None else shlex.join([*cc, *flags(cc)])


def identity(cc: Sequence[str]) -> str:
    """What a cache key records of ``cc``: each word, where a word names a program (the first
    always; a launcher's compiler, ``gcc`` in ``ccache gcc``, found on PATH) its real path with
    its size and modification time, so that another or a reinstalled compiler — behind a launcher
    too — builds its own kernels.

        >>> identity(["/bin/sh", "-m64"]).endswith(" -m64")
        True
    """
    return " ".join([_program(cc[0]), *(w if w.startswith("-") else _program(w, w) for w in cc[1:])])


def _program(word: str, default: Optional[str] = None) -> str:
    """``word``'s program as ``realpath|size|mtime_ns`` when it is one on PATH (or a path to
    one), else ``default`` (``word``'s real path when None)."""
    path = shutil.which(word)
    if path is None:
        return os.path.realpath(word) if default is None else default
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return real
    return f"{real}|{st.st_size}|{st.st_mtime_ns}"


def forget() -> None:
    """Forget the compilers found (the flags probed stay: they follow from the command)."""
    _FOUND.clear()


__all__ = ["BASE_FLAGS", "COMPILERS", "COMPILE_TIMEOUT", "Command", "NativeBuildError",
           "OPTIONAL_FLAGS", "availability", "describe", "find_compiler", "flags", "forget",
           "identity", "require_compiler", "run", "split_cc"]
