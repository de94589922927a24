"""Compile rendered C kernels with the system compiler, cache them on disk and in process, and
load them with ctypes.

The compiler is ``$CC`` (a command: ``CC="ccache gcc"`` works, as with make), else the first of
``cc``, ``gcc``, ``clang`` found on PATH (:mod:`.compiler`). Flags are :data:`BASE_FLAGS` (exact
IEEE float: no FMA contraction, no fast-math) plus :data:`OPTIONAL_FLAGS` that the compiler
accepts (``-march=native``, ``-fopenmp``; probed once, on the first cache miss). ``-O2``, not
``-O3``: the kernels' hot loops are written with vector intrinsics, so what ``-O3`` adds
(auto-vectorising, unrolling, versioning the other loops) measured within noise on the family's op_apis, while it doubled the compile time (GCC 12: the
eleven kernels of a float32 SyncBatchNorm step 9.2 → 4.7 s; benchmarks/HISTORY.md). With GCC,
kernels that include ``<immintrin.h>`` take it precompiled (:func:`precompiled`). A shared object is cached under :func:`cache_dir` as
``k_<sha256>.so`` keyed by the source, the compiler, its flags and the CPU; its source is stored
next to it as ``k_<sha256>.c`` and the exact command line as ``k_<sha256>.cmd``.

The disk cache is

* private: the directory is created with mode 0700. Before anything is compiled into or loaded
  from it, the directory, and then the ``.so``, must be owned by the current user and not
  group/world-writable, and the ``.so`` must be a regular file (not a symlink). Otherwise
  :class:`NativeBuildError` names the path and the problem in one line. There is no silent
  fallback to another directory: a cache that someone else can write to lets them run code in
  this process, which the user should see and fix (or point ``$OPGRAPH_CACHE_DIR`` elsewhere).
* atomic: the source, the library and the command line are written to unique temporaries
  ``k_<sha256>.<random>.tmp.{c,so,cmd}`` in the cache directory and renamed into place
  (``os.replace``), the library last. The new library is loaded before it is renamed, so no
  process ever loads a half-written file, and processes compiling the same kernel at the same
  time all succeed (the last rename wins; the bytes are the same).
* sealed: the library ends with :data:`.seal.SEAL` and the sha256 of its cache key and bytes
  (:func:`.seal.seal`); a cached library whose seal does not match (truncated or damaged on disk,
  another kernel's library under this name) is not loaded but compiled again, as a missing one
  is (``dlopen()`` of a truncated library can succeed and then crash the process with SIGBUS).
* bounded: after every compile the least recently used entries (``.so`` with its ``.c`` and
  ``.cmd``) are deleted until the directory holds at most :func:`cache_limit` bytes
  (:data:`MAX_CACHE_BYTES`, 256 MiB, or ``$OPGRAPH_CACHE_MAX_MB``). A disk hit sets the library's
  access time (its modification time stays the compile time); "recently used" is the later of
  the two. Temporaries older than :data:`TEMP_MAX_AGE` seconds (left by a killed compile) go too,
  and so does a precompiled header (:func:`precompiled`) unused for :data:`PCH_MAX_AGE`.

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
import re
import shlex
import stat
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from opgraph.core.config import env_number
from opgraph.core.tensor import array_address
from . import compiler
from .compiler import (BASE_FLAGS, OPTIONAL_FLAGS, Command, NativeBuildError, availability, describe,
                       find_compiler, flags)
from .seal import seal, sealed

SYMBOL = "opg_kernel"
MAX_CACHE_BYTES = 256 << 20  # the disk cache bound unless $OPGRAPH_CACHE_MAX_MB is set
TEMP_MAX_AGE = 3600.0        # seconds after which a leftover temporary is deleted
PCH_MAX_AGE = 30 * 86400.0   # seconds after which an unused precompiled header is deleted
_ENTRY = re.compile(r"k_([0-9a-f]{64})\.(so|c|cmd)")
_TEMP = re.compile(r"[kp]_[0-9a-f]{64}\.[^.]+\.tmp\.(so|c|cmd|h|gch)")
_PCH = re.compile(r"p_[0-9a-f]{64}\.h\.gch")
# what the vector kernels include: parsing it is ~0.3 s of every compile, so GCC gets it
# precompiled (p_<sha256>.h and its .h.gch in the cache, made once per compiler, flags and CPU)
PCH_HEADER = "#include <immintrin.h>\n"
_DELETE_ORDER = {"so": 0, "cmd": 1, "c": 2}  # the library first: no .so is left without sidecars

stats = {"compiles": 0, "disk_hits": 0, "memory_hits": 0}  # counters, for tests and benchmarks
_LOCK = threading.Lock()
_LOADED: dict[str, tuple[ctypes.CDLL, Path]] = {}  # cache key -> (library, its path)


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel: the ctypes function plus where it came from."""

    fn: Any               # the ctypes function (``symbol`` of :func:`load`, opg_kernel by default)
    name: str             # cache key (sha256 hex)
    library: Path
    source: Path
    handle: Any = None    # the loaded ctypes.CDLL (other symbols of the same library)


address = array_address  # a kernel's pointer argument: the array's first element


class PointerArray:
    """Makes ctypes arrays of ``n`` pointers from addresses — packed by :mod:`struct` and copied
    in, about half the cost of ctypes' own constructor for ten of them.

        >>> PointerArray(2)(16, 0)[:]
        [16, None]
    """

    __slots__ = ("type", "pack")

    def __init__(self, n: int):
        self.type, self.pack = ctypes.c_void_p * n, struct.Struct(f"{n}P").pack

    def __call__(self, *addresses: int) -> Any:
        return self.type.from_buffer_copy(self.pack(*addresses))


def int64_array(values: Sequence[int]) -> Any:
    """``values`` as a ctypes int64 array (packed by :mod:`struct`, as :class:`PointerArray`).

        >>> int64_array([3, -1])[:]
        [3, -1]
    """
    n = len(values)
    return (ctypes.c_int64 * n).from_buffer_copy(struct.pack(f"{n}q", *values))


_PCH_NAMES: dict[tuple, Optional[str]] = {}  # compile command -> its header's stem (None: no PCH)
_BY_SOURCE: dict[tuple, "Kernel"] = {}


def cache_dir() -> Path:
    """``$OPGRAPH_CACHE_DIR`` (``~`` expanded, as a shell would) or ``$XDG_CACHE_HOME/opgraph/native``
    or ``~/.cache/opgraph/native``. A relative ``$XDG_CACHE_HOME`` is ignored, as the XDG Base
    Directory spec says (it would put the cache wherever the process happens to run)."""
    explicit = os.environ.get("OPGRAPH_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
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


def cache_key(source: str, cc: Command, extra: Sequence[str] = ()) -> str:
    """sha256 of source + compiler + requested flags + CPU (probe results follow from these)."""
    parts = [source, compiler.identity(cc), " ".join(BASE_FLAGS + OPTIONAL_FLAGS), " ".join(extra),
             _cpu_tag()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def cache_limit() -> int:
    """The disk cache bound in bytes: ``$OPGRAPH_CACHE_MAX_MB`` MiB (fractions allowed) when set,
    else :data:`MAX_CACHE_BYTES`. A value that is not a number >= 0 raises NativeBuildError."""
    try:
        mib = env_number("OPGRAPH_CACHE_MAX_MB", MAX_CACHE_BYTES / (1 << 20), "MiB")
    except ValueError as e:
        raise NativeBuildError(str(e)) from None
    return int(mib * (1 << 20))


def _require_private(what: str, path: Path, st: os.stat_result) -> None:
    """Raise unless ``st`` is ours, not group/world-writable, and of the kind ``what`` expects."""
    kind_ok = stat.S_ISDIR(st.st_mode) if what == "directory" else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        problem = f"is not a {'directory' if what == 'directory' else 'regular file'}"
    elif st.st_uid != os.getuid():
        problem = f"is owned by uid {st.st_uid}, you are uid {os.getuid()}"
    elif st.st_mode & 0o022:
        problem = f"is group/world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        return
    fix = ("make it private (yours, chmod 700) or set OPGRAPH_CACHE_DIR to another directory"
           if what == "directory" else "delete it (it is rebuilt)")
    raise NativeBuildError(f"refusing the native kernel cache {what} {path}: it {problem}; {fix}")


def private_dir(directory: Optional[Path] = None) -> Path:
    """``directory`` (default :func:`cache_dir`), created with mode 0700 when missing; raises
    NativeBuildError unless it is a directory of ours that no one else can write to."""
    directory = cache_dir() if directory is None else Path(directory)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.stat(directory)
    except OSError as e:
        raise NativeBuildError(f"cannot create the native kernel cache directory {directory}: "
                               f"{e.strerror or e}") from None
    _require_private("directory", directory, st)
    return directory


def _unwritable(directory: Path, e: OSError) -> NativeBuildError:
    return NativeBuildError(f"cannot write into the native kernel cache directory {directory}: "
                            f"{e.strerror or e}; make it writable or set OPGRAPH_CACHE_DIR to another directory")


def _temp(lib: Path, ext: str) -> tuple[int, str]:
    """A new temporary beside ``lib``; NativeBuildError naming the directory if it fails."""
    try:
        return tempfile.mkstemp(prefix=f"{lib.stem}.", suffix=f".tmp.{ext}", dir=lib.parent)
    except OSError as e:
        raise _unwritable(lib.parent, e) from None


def _write_temp(lib: Path, ext: str, text: str) -> str:
    fd, path = _temp(lib, ext)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:  # a full disk, say
        _unlink(path)
        raise _unwritable(lib.parent, e) from None
    return path


def _unlink(path: str) -> bool:
    """Delete ``path``; True when it is gone afterwards (another process may have beaten us)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def compile_source(source: str, lib: Path, cc: Command, extra: Sequence[str] = ()) -> ctypes.CDLL:
    """Compile ``source`` to the shared object ``lib`` in a private directory; returns it loaded.
    Everything is written to unique temporaries and renamed into place, the library last (after
    it is loaded). Raises :class:`NativeBuildError` quoting the source and the compiler's message
    (the source is kept at ``lib.with_suffix(".c")``)."""
    private_dir(lib.parent)
    src = lib.with_suffix(".c")
    options = [*flags(cc), *extra]
    if PCH_HEADER.strip() in source:
        options += precompiled(cc, options, lib.parent)
    shown = shlex.join([*cc, *options, str(src), "-o", str(lib)])  # as if run on final names
    temps: list[str] = []
    try:
        temps.append(_write_temp(lib, "c", source))
        fd, tmp_lib = _temp(lib, "so")
        os.close(fd)
        temps.append(tmp_lib)
        proc = compiler.run(cc, [*options, temps[0], "-o", tmp_lib])
        if proc.returncode != 0:
            os.replace(temps[0], src)
            msg = (proc.stderr or proc.stdout).strip().replace(temps[0], str(src))
            raise NativeBuildError(f"C compiler failed on generated kernel {src} "
                                   f"(command: {shown}):\n{msg}")
        os.replace(temps[0], src)
        seal(Path(tmp_lib), lib.stem[2:])
        os.chmod(tmp_lib, 0o700)  # the linker may have recreated it with the umask's mode
        try:
            handle = ctypes.CDLL(tmp_lib)
        except OSError as e:
            raise NativeBuildError(f"cannot load the kernel just compiled from {src}: {e}") from None
        temps.append(_write_temp(lib, "cmd", shown + "\n"))
        os.replace(temps[-1], lib.with_suffix(".cmd"))
        os.replace(tmp_lib, lib)
    finally:
        for leftover in temps:
            _unlink(leftover)
    stats["compiles"] += 1
    return handle


def precompiled(cc: Command, options: Sequence[str], directory: Path) -> list[str]:
    """``["-include", header]`` for compiles by ``cc`` with ``options`` (the flags): the
    header is :data:`PCH_HEADER` and ``header.gch`` its precompiled form in ``directory``, made
    on first use (atomically, as kernels are) and refused like a library when not private. []
    when the compiler is not GCC or cannot make it: each kernel then parses the header itself.
    The code compiled is the same either way; only the parsing is saved (GCC 12, 20 kernels:
    8.5-10.3 s -> 5.4-6.3 s). A use sets the ``.gch``'s access time. It is outside the cache's
    bound (one per compiler, flags and CPU, ~25 MB); :func:`evict` deletes one unused for
    :data:`PCH_MAX_AGE` (after a GCC upgrade, say) but keeps its 23-byte header, so that a
    compile that named it just then parses the header instead of failing."""
    key = (*cc, *options)
    if key not in _PCH_NAMES:
        version = compiler.run(cc, ["--version"]).stdout
        if "Free Software Foundation" not in version:  # GCC's banner; clang names .pch otherwise
            _PCH_NAMES[key] = None
        else:
            parts = [PCH_HEADER, version, " ".join(key), _cpu_tag()]
            _PCH_NAMES[key] = "p_" + hashlib.sha256("\0".join(parts).encode()).hexdigest()
    stem = _PCH_NAMES[key]
    if stem is None:
        return []
    header = directory / f"{stem}.h"
    gch = directory / f"{stem}.h.gch"
    try:
        st = os.lstat(gch)
        _require_private("precompiled header", gch, st)
        if _mark_used(gch, st):
            return ["-include", str(header)]
    except FileNotFoundError:
        pass
    temps = [_write_temp(header, "h", PCH_HEADER)]
    try:
        fd, tmp_gch = _temp(header, "gch")
        os.close(fd)
        temps.append(tmp_gch)
        made = compiler.run(cc, [*options, "-x", "c-header", temps[0], "-o", tmp_gch])
        if made.returncode != 0:
            _PCH_NAMES[key] = None
            return []
        os.chmod(tmp_gch, 0o600)
        os.replace(temps[0], header)
        os.replace(tmp_gch, gch)  # the header first: a .gch is never without its header
    finally:
        for leftover in temps:
            _unlink(leftover)
    return ["-include", str(header)]


def _open_cached(lib: Path) -> Optional[ctypes.CDLL]:
    """The cached library ``lib`` loaded (its access time set to now), or None when there is
    none or it cannot be loaded (evicted meanwhile, damaged or not its key's: its seal does not
    match; then it is rebuilt)."""
    try:
        st = os.lstat(lib)
    except FileNotFoundError:
        return None
    _require_private("library", lib, st)
    if not _mark_used(lib, st) or not sealed(lib, lib.stem[2:]):
        return None
    try:
        return ctypes.CDLL(str(lib))
    except OSError:
        return None


def _mark_used(path: Path, st: os.stat_result) -> bool:
    """Set ``path``'s access time to now, its modification time kept (the last use
    :func:`evict` reads); False when the file has vanished meanwhile."""
    try:
        os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
    except FileNotFoundError:
        return False
    except OSError:
        pass  # e.g. a read-only file system: the file only looks older than it is
    return True


def evict(limit: Optional[int] = None, directory: Optional[Path] = None) -> list[Path]:
    """Delete least recently used cache entries (``.so`` + ``.c`` + ``.cmd``) until
    ``directory`` (default :func:`cache_dir`) holds at most ``limit`` bytes (default
    :func:`cache_limit`), temporaries older than :data:`TEMP_MAX_AGE` and precompiled headers
    unused for :data:`PCH_MAX_AGE` (their ``.gch``). Files that vanish meanwhile (another
    process) are skipped. Returns the files deleted (or found gone)."""
    limit = cache_limit() if limit is None else limit
    directory = private_dir(directory)
    groups: dict[str, list] = {}  # key -> [last use ns, bytes, [(delete order, path)]]
    removed: list[Path] = []
    now = time.time()
    with os.scandir(directory) as it:
        for e in it:
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            m = _ENTRY.fullmatch(e.name)
            if m is None:
                stale = (_TEMP.fullmatch(e.name) and st.st_mtime < now - TEMP_MAX_AGE or
                         _PCH.fullmatch(e.name) and max(st.st_atime, st.st_mtime) < now - PCH_MAX_AGE)
                if stale and _unlink(e.path):
                    removed.append(Path(e.path))
                continue
            g = groups.setdefault(m[1], [0, 0, []])
            g[0] = max(g[0], st.st_atime_ns, st.st_mtime_ns)
            g[1] += st.st_size
            g[2].append((_DELETE_ORDER[m[2]], e.path))
    total = sum(g[1] for g in groups.values())
    for _, size, paths in sorted(groups.values(), key=lambda g: g[0]):
        if total <= limit:
            break
        removed += [Path(p) for _, p in sorted(paths) if _unlink(p)]
        total -= size
    return removed


def load(source: str, extra: Sequence[str] = (), symbol: str = SYMBOL) -> Kernel:
    """The kernel ``symbol`` of ``source``: from memory, else the disk cache, else compiled now
    (then the disk cache is trimmed to :func:`cache_limit`)."""
    env = os.environ
    # the settings a load depends on: a kernel built by another compiler is not this one's
    front = (source, tuple(extra), symbol, env.get("OPGRAPH_CACHE_DIR"), env.get("CC"), env.get("PATH"))
    hit = _BY_SOURCE.get(front)  # this process already loaded this exact source: no work at all
    if hit is not None:
        stats["memory_hits"] += 1
        return hit
    kernel = _load(source, extra, symbol)
    _BY_SOURCE[front] = kernel
    return kernel


def _load(source: str, extra: Sequence[str], symbol: str) -> Kernel:
    cc = compiler.require_compiler()
    key = cache_key(source, cc, extra)
    with _LOCK:
        hit = _LOADED.get(key)
        if hit is not None:
            stats["memory_hits"] += 1
            return Kernel(getattr(hit[0], symbol), key, hit[1], hit[1].with_suffix(".c"), hit[0])
        limit = cache_limit()
        lib = private_dir() / f"k_{key}.so"
        handle = _open_cached(lib)
        if handle is not None:
            stats["disk_hits"] += 1
        else:
            handle = compile_source(source, lib, cc, extra)
            evict(limit, lib.parent)
        _LOADED[key] = (handle, lib)
        return Kernel(getattr(handle, symbol), key, lib, lib.with_suffix(".c"), handle)


def forget() -> None:
    """Drop the in-process cache (the disk cache stays): the next load acts like a new process."""
    with _LOCK:
        _LOADED.clear()
        _BY_SOURCE.clear()
        _PCH_NAMES.clear()
        compiler.forget()


# the compiler's names (.compiler) stay importable from here, where callers and tests look
__all__ = ["BASE_FLAGS", "OPTIONAL_FLAGS", "Kernel", "NativeBuildError", "PointerArray", "availability",
           "cache_dir", "cache_key", "cache_limit", "compile_source", "describe", "evict",
           "find_compiler", "flags", "forget", "int64_array", "load", "precompiled", "private_dir"]
