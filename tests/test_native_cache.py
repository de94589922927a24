"""The native kernel cache on disk is private (a 0700 directory; a library or directory that is
not ours or is group/world-writable is refused), written atomically (two processes compiling one
kernel both succeed) and bounded (least recently used entries go first, with their sidecars)."""
from __future__ import annotations

import ctypes
import io
import multiprocessing
import os
import platform
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.native import build, compiler

pytestmark = pytest.mark.skipif(
    not build.availability()[0],
    reason=f"the native kernel cache needs a C compiler: {build.availability()[1]}")

NOBODY = 65534  # a uid that is not ours (only used when the tests run as root)


def source(value: int, lines: int = 1) -> str:
    """A kernel returning ``value * lines`` (``lines`` statements of ``v += value``)."""
    body = f"  v += {value};\n" * lines
    return f"#include <stdint.h>\nint64_t opg_kernel(void) {{\n  int64_t v = 0;\n{body}  return v;\n}}\n"


def call(kernel: build.Kernel) -> int:
    kernel.fn.restype = ctypes.c_int64
    return kernel.fn()


def entry(directory: Path, kernel: build.Kernel) -> list[Path]:
    """The .so and its two sidecars."""
    return [directory / f"k_{kernel.name}{ext}" for ext in (".so", ".c", ".cmd")]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory (not created yet) and a process that has loaded nothing."""
    d = tmp_path / "deep" / "cache"
    monkeypatch.setenv("OPGRAPH_CACHE_DIR", str(d))
    monkeypatch.delenv("OPGRAPH_CACHE_MAX_MB", raising=False)
    build.forget()
    yield d
    build.forget()
    if d.exists():
        d.chmod(0o700)  # so tmp_path can be cleaned when a test left it open


def refused(match: str):
    return pytest.raises(build.NativeBuildError, match=match)


# --- privacy --------------------------------------------------------------------------------------
def test_directory_is_created_0700_and_files_private_whatever_the_umask(cache):
    old = os.umask(0)
    try:
        k = build.load(source(11))
    finally:
        os.umask(old)
    assert call(k) == 11
    st = os.stat(cache)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    for f in entry(cache, k):
        st = os.lstat(f)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid(), f
        assert stat.S_IMODE(st.st_mode) & 0o022 == 0, (f, oct(st.st_mode))


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777], ids=oct)
def test_group_or_world_writable_directory_is_refused(cache, mode):
    k = build.load(source(12))
    before = dict(build.stats)
    cache.chmod(mode)
    build.forget()
    for src in (source(12), source(13)):  # a cached kernel is not loaded, a new one not compiled
        with refused("writable") as e:
            build.load(src)
        msg = str(e.value)
        assert str(cache) in msg and "\n" not in msg and oct(mode)[2:] in msg
    assert build.stats["disk_hits"] == before["disk_hits"]
    assert build.stats["compiles"] == before["compiles"]
    assert sorted(cache.iterdir()) == sorted(entry(cache, k))


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o777], ids=oct)
def test_group_or_world_writable_library_is_refused(cache, mode):
    k = build.load(source(14))
    k.library.chmod(mode)
    before = dict(build.stats)
    build.forget()
    with refused("writable") as e:
        build.load(source(14))
    assert str(k.library) in str(e.value) and "\n" not in str(e.value)
    assert build.stats["disk_hits"] == before["disk_hits"]
    assert stat.S_IMODE(k.library.stat().st_mode) == mode, "the file is left as it was"


def test_symlinked_library_is_refused(cache, tmp_path):
    k = build.load(source(15))
    other = build.load(source(16))
    k.library.unlink()
    k.library.symlink_to(other.library)  # would silently run the wrong kernel
    build.forget()
    with refused("not a regular file") as e:
        build.load(source(15))
    assert str(k.library) in str(e.value)


def _pretend_foreign(monkeypatch, target: Path) -> None:
    """Every stat of ``target`` (by path or open descriptor) reports another user as its owner."""
    real = target.stat()
    ident = (real.st_dev, real.st_ino)
    extra = ("st_atime", "st_mtime", "st_ctime", "st_atime_ns", "st_mtime_ns", "st_ctime_ns",
             "st_blksize", "st_blocks", "st_rdev")

    def wrap(fn):
        def fake(*args, **kwargs):
            st = fn(*args, **kwargs)
            if (st.st_dev, st.st_ino) != ident:
                return st
            seq = tuple(st)
            return os.stat_result(seq[:4] + (os.getuid() + 1,) + seq[5:],
                                  {k: getattr(st, k) for k in extra if hasattr(st, k)})
        return fake

    for name in ("stat", "lstat", "fstat"):
        monkeypatch.setattr(os, name, wrap(getattr(os, name)))


@pytest.mark.parametrize("how", ["simulated", "real-chown"])
def test_library_owned_by_another_user_is_refused(cache, monkeypatch, how):
    k = build.load(source(17))
    if how == "real-chown":
        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(k.library, NOBODY, NOBODY)
    else:
        _pretend_foreign(monkeypatch, k.library)
    build.forget()
    with refused("owned by uid") as e:
        build.load(source(17))
    msg = str(e.value)
    assert str(k.library) in msg and f"you are uid {os.getuid()}" in msg and "\n" not in msg


@pytest.mark.parametrize("how", ["simulated", "real-chown"])
def test_directory_owned_by_another_user_is_refused(cache, monkeypatch, how):
    build.load(source(18))
    if how == "real-chown":
        if os.getuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(cache, NOBODY, NOBODY)
    else:
        _pretend_foreign(monkeypatch, cache)
    build.forget()
    with refused("owned by uid") as e:
        build.load(source(18))
    assert str(cache) in str(e.value)


# --- two processes, one kernel ----------------------------------------------------------------------
LINES = 3000  # long enough that half a source file does not compile
CC_WRAPPER = """#!/bin/sh
case "$*" in */k_*) sleep "${OPG_TEST_CC_DELAY:-0}";; esac
exec %s "$@"
"""


class _SlowText:
    """A text file whose kernel-source writes stall half way (a loaded disk)."""

    def __init__(self, f, pause: float) -> None:
        self._f, self._pause = f, pause

    def write(self, data: str) -> int:
        if not isinstance(data, str) or "opg_kernel" not in data:
            return self._f.write(data)
        half = len(data) // 2
        n = self._f.write(data[:half])
        self._f.flush()
        time.sleep(self._pause)
        return n + self._f.write(data[half:])

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def race(target, arg_lists: list[tuple]) -> list:
    """Run ``target(*args, barrier, results)`` in one spawned process per ``args``, released
    together by the barrier; what each put on ``results``, in arrival order. Every process is
    joined, or killed after 30 s."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(arg_lists)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, results)) for args in arg_lists]
    for p in procs:
        p.start()
    try:
        return [results.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


def _compile_worker(role, cache_dir, cc, barrier, results):
    """One process of the race: the ``compiler`` role's compiler starts a second late; the
    ``writer`` role starts 0.3 s later and its file writes stall half way for 1.5 s."""
    try:
        os.environ.update(OPGRAPH_CACHE_DIR=cache_dir, CC=cc)
        os.environ["OPG_TEST_CC_DELAY"] = "1.0" if role == "compiler" else "0"
        if role == "writer":
            real_open = io.open
            io.open = lambda *a, **k: (_SlowText(real_open(*a, **k), 1.5)
                                       if "w" in str(a[1] if len(a) > 1 else k.get("mode", "r"))
                                       else real_open(*a, **k))
        barrier.wait(timeout=60)
        if role == "writer":
            time.sleep(0.3)
        k = build.load(source(7, LINES))
        results.put((role, call(k), ""))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((role, None, f"{type(e).__name__}: {e}"))


def test_two_processes_compiling_one_kernel_both_succeed(cache, tmp_path, monkeypatch):
    real_cc = build.find_compiler()[0]
    cc = tmp_path / "slowcc"
    cc.write_text(CC_WRAPPER % shlex.join(real_cc))
    cc.chmod(0o755)
    got = dict((r, (v, err)) for r, v, err in race(
        _compile_worker, [(role, str(cache), str(cc)) for role in ("compiler", "writer")]))
    assert got == {"compiler": (7 * LINES, ""), "writer": (7 * LINES, "")}
    names = sorted(f.name for f in cache.iterdir())
    assert len(names) == 3 and [n.rsplit(".", 1)[1] for n in names] == ["c", "cmd", "so"], names
    assert (cache / names[0]).read_text() == source(7, LINES)
    monkeypatch.setenv("CC", str(cc))  # the same compiler, so the same cache key
    hits = build.stats["disk_hits"]
    assert call(build.load(source(7, LINES))) == 7 * LINES  # the published library loads here
    assert build.stats["disk_hits"] == hits + 1


# --- the size bound -------------------------------------------------------------------------------
def _size(files) -> int:
    return sum(f.stat().st_size for f in files)


def _total(directory: Path) -> int:
    return _size(f for f in directory.iterdir())


def test_eviction_keeps_the_bound_and_drops_the_least_recently_used_with_sidecars(cache,
                                                                                  monkeypatch):
    kernels = [build.load(source(v)) for v in (101, 102, 103)]  # same-size sources
    one = max(_size(entry(cache, k)) for k in kernels)
    now = time.time()
    for age, k in zip((300, 200, 100), kernels):  # kernel 101 oldest, then 102, then 103
        for f in entry(cache, k):
            os.utime(f, (now - age, now - age))
    build.forget()
    assert call(build.load(source(101))) == 101  # a disk hit: 101 becomes the most recent
    bound = 3 * one + one // 2  # room for three entries, not four
    monkeypatch.setenv("OPGRAPH_CACHE_MAX_MB", repr(bound / 2 ** 20))
    newest = build.load(source(104))
    assert call(newest) == 104
    gone = entry(cache, kernels[1])
    assert not any(f.exists() for f in gone), "kernel 102 was the least recently used"
    for k in (kernels[0], kernels[2], newest):
        assert all(f.exists() for f in entry(cache, k))
    assert _total(cache) <= bound


def test_eviction_to_a_zero_bound_empties_the_cache_and_tolerates_vanished_files(cache,
                                                                                 monkeypatch):
    kernels = [build.load(source(v)) for v in (201, 202, 203)]
    real_unlink = os.unlink

    def raced(path, *a, **k):  # another process removed it just before us
        real_unlink(path, *a, **k)
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(os, "unlink", raced)
    monkeypatch.setattr(os, "remove", raced)
    removed = build.evict(limit=0)
    assert not list(cache.iterdir())
    assert sorted(removed) == sorted(f for k in kernels for f in entry(cache, k))
    assert [call(k) for k in kernels] == [201, 202, 203]  # loaded kernels keep working


def test_stale_temporaries_are_evicted_fresh_ones_kept(cache):
    k = build.load(source(301))
    stale = cache / f"k_{'a' * 64}.x7q_z9ab.tmp.so"
    fresh = cache / f"k_{'b' * 64}.p0w3rs2x.tmp.c"  # maybe another process compiling right now
    for f in (stale, fresh):
        f.write_bytes(b"partial")
    old = time.time() - build.TEMP_MAX_AGE - 60
    os.utime(stale, (old, old))
    build.evict()
    assert not stale.exists() and fresh.exists()
    assert all(f.exists() for f in entry(cache, k))


def test_an_unwritable_cache_directory_is_one_clear_error(cache, monkeypatch):
    """A cache directory the process cannot write into (read-only, not ours to write: as root
    a chmod would not stop us, so mkstemp is made to fail as it does there) is named, with the
    fix, as a NativeBuildError (it was mkstemp's PermissionError naming a temporary)."""
    build.private_dir(cache)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(Path(kwargs["dir"]) / "x.tmp"))
    monkeypatch.setattr(build.tempfile, "mkstemp", refuse)
    with refused(f"cannot write into the native kernel cache directory {cache}: Permission "
                 "denied; make it writable or set OPGRAPH_CACHE_DIR") as e:
        build.load(source(504))
    assert "x.tmp" not in str(e.value)


@pytest.mark.parametrize("script", ["\x7fELF not a program", "#!/bin/sh\nexec sleep 30\n"])
def test_a_cc_that_cannot_run_or_hangs_is_one_clear_error(cache, tmp_path, monkeypatch, script):
    """$CC naming a file that is no program (it was the OSError 'Exec format error'), or a
    compiler that hangs (TimeoutExpired, after two minutes per command), is a NativeBuildError."""
    cc = tmp_path / "cc"
    cc.write_text(script)
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(compiler, "COMPILE_TIMEOUT", 1)
    build.forget()
    with refused(f"cannot run the C compiler {cc}: Exec format error|the C compiler {cc} did not "
                 "finish in 1 s"):
        build.load(source(505))


# --- damaged entries -------------------------------------------------------------------------------
def test_another_kernels_library_under_this_name_is_compiled_again(cache):
    a, b = build.load(source(501)), build.load(source(502))
    entry(cache, a)[0].replace(entry(cache, b)[0])  # b's name now holds a's (valid) library
    build.forget()
    before = build.stats["compiles"]
    assert call(build.load(source(502))) == 502  # not a's 501
    assert build.stats["compiles"] == before + 1


@pytest.mark.parametrize("keep", [100, 3000])
def test_a_truncated_library_is_compiled_again_not_loaded(cache, keep):
    lib = entry(cache, build.load(source(503, 400)))[0]
    cut = lib.with_name(lib.name + ".cut")  # dlopen() takes 3000 bytes, then SIGBUS on a call
    cut.write_bytes(lib.read_bytes()[:keep])
    # a new file under the name: truncating the one this process has mapped would SIGBUS it later
    cut.replace(lib)
    build.forget()
    code = ("from backends.native import build; from tests.test_native_cache import call, source; "
            "print(call(build.load(source(503, 400))), build.stats['compiles'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert (proc.returncode, proc.stdout.split()) == (0, [str(503 * 400), "1"]), proc.stderr


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_bad_size_limit_is_a_clear_error(cache, monkeypatch, value):
    monkeypatch.setenv("OPGRAPH_CACHE_MAX_MB", value)
    with refused("OPGRAPH_CACHE_MAX_MB") as e:
        build.load(source(401))
    assert repr(value) in str(e.value) and "MiB" in str(e.value)


def test_default_limit_and_env_override(monkeypatch):
    monkeypatch.delenv("OPGRAPH_CACHE_MAX_MB", raising=False)
    assert build.cache_limit() == 256 * 2 ** 20
    monkeypatch.setenv("OPGRAPH_CACHE_MAX_MB", "1.5")
    assert build.cache_limit() == 3 * 2 ** 19


# --- the precompiled header -----------------------------------------------------------------------
def vector_source(value: int) -> str:
    """A kernel that includes the intrinsics header, as the vector kernels do."""
    return f"#include <immintrin.h>\n#include <stdint.h>\nint64_t opg_kernel(void) {{ return {value}; }}\n"


def gcc_on_x86() -> bool:
    cc = build.find_compiler()[0]
    return (platform.machine() in ("x86_64", "AMD64") and cc is not None
            and "Free Software Foundation" in compiler.run(cc, ["--version"]).stdout)


needs_gcc_x86 = pytest.mark.skipif(not gcc_on_x86(), reason="precompiled headers are made for "
                                   "GCC on x86 only (other compilers parse immintrin.h each time)")


@needs_gcc_x86
def test_the_intrinsics_header_is_precompiled_once_privately_and_used(cache):
    first = build.load(vector_source(3))
    [gch] = list(cache.glob("p_*.h.gch"))
    header = gch.with_suffix("")
    assert header.read_text() == build.PCH_HEADER
    for made in (gch, header):
        assert stat.S_IMODE(made.stat().st_mode) & 0o077 == 0
    assert f"-include {header}" in (cache / f"k_{first.name}.cmd").read_text()
    made_at = gch.stat().st_mtime_ns
    second = build.load(vector_source(4))
    assert (call(first), call(second)) == (3, 4)
    assert list(cache.glob("p_*.h.gch")) == [gch] and gch.stat().st_mtime_ns == made_at
    assert [p.name for p in cache.glob("*.tmp.*")] == []
    build.evict(limit=0)  # the kernels go, the header stays (it is outside the bound)
    assert gch.exists() and not list(cache.glob("k_*"))


@needs_gcc_x86
def test_a_damaged_precompiled_header_still_compiles_and_a_shared_one_is_refused(cache):
    build.load(vector_source(5))
    [gch] = list(cache.glob("p_*.h.gch"))
    gch.write_bytes(b"not a precompiled header")  # GCC ignores it and parses the header
    build.forget()
    assert call(build.load(vector_source(6))) == 6
    gch.chmod(0o666)
    build.forget()
    with refused(r"precompiled header .*p_.*\.h\.gch: it is group/world-writable"):
        build.load(vector_source(7))


@needs_gcc_x86
def test_a_deleted_precompiled_header_is_made_again(cache):
    build.load(vector_source(8))
    for made in cache.glob("p_*"):
        made.unlink()
    assert call(build.load(vector_source(9))) == 9  # same process: the name is remembered
    assert len(list(cache.glob("p_*.h.gch"))) == 1


def _vector_worker(cache_dir, barrier, results):
    try:
        os.environ["OPGRAPH_CACHE_DIR"] = cache_dir
        barrier.wait(timeout=60)
        results.put((call(build.load(vector_source(11))), ""))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((None, f"{type(e).__name__}: {e}"))


@needs_gcc_x86
def test_two_processes_making_the_precompiled_header_at_once_both_succeed(cache):
    assert race(_vector_worker, [(str(cache),)] * 2) == [(11, "")] * 2
    assert len(list(cache.glob("p_*.h.gch"))) == 1 and not list(cache.glob("*.tmp.*"))


def test_a_precompiled_header_unused_for_its_max_age_is_evicted_its_header_kept(cache):
    build.private_dir()
    old = time.time() - build.PCH_MAX_AGE - 60
    made = {}
    for stem, when in (("a", old), ("b", time.time())):  # e.g. the one of GCC before an upgrade
        header = cache / f"p_{stem * 64}.h"
        header.write_text(build.PCH_HEADER)
        header.with_name(header.name + ".gch").write_bytes(b"precompiled")
        for f in (header, header.with_name(header.name + ".gch")):
            os.utime(f, (when, when))
        made[stem] = header
    removed = build.evict(limit=2 ** 40)  # whatever the bound
    assert removed == [cache / f"p_{'a' * 64}.h.gch"]
    assert made["a"].exists() and made["b"].exists() and (cache / f"p_{'b' * 64}.h.gch").exists()


@needs_gcc_x86
def test_naming_the_precompiled_header_for_a_compile_marks_it_used(cache):
    build.load(vector_source(12))
    [gch] = list(cache.glob("p_*.h.gch"))
    old = time.time() - build.PCH_MAX_AGE - 60
    os.utime(gch, (old, old))
    cc = build.find_compiler()[0]
    # what compile_source asks before a compile (which may not read the file on a noatime mount)
    assert build.precompiled(cc, build.flags(cc), cache) == ["-include", str(gch.with_suffix(""))]
    build.evict()
    assert gch.exists() and gch.stat().st_atime > old + build.PCH_MAX_AGE
    assert call(build.load(vector_source(13))) == 13
