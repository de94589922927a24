"""The native backend's compiler command: ``$CC`` is split into words as a shell (and make) would,
so a launcher in front of the compiler works (``CC="ccache gcc"``); a $CC that cannot be split,
whose program is missing, cannot run or hangs is one clear error; ``$OPGRAPH_CACHE_DIR`` may
start with ``~``, and a relative ``$XDG_CACHE_HOME`` is ignored. The kernel cache's keys and bound:
what the disk key and the in-process memo tell apart, and the eviction bound reached exactly."""
from __future__ import annotations

import ctypes
import os
import shlex
from pathlib import Path

import pytest

from backends.native import build, compiler

pytestmark = pytest.mark.skipif(not build.availability()[0], reason=build.availability()[1])

# a launcher as ccache is one: logs its arguments, then runs them
LAUNCHER = """#!/bin/sh
echo "$@" >> "%s"
exec "$@"
"""


def kernel_source(value: int) -> str:
    return f"#include <stdint.h>\nint64_t opg_kernel(void) {{ return {value}; }}\n"


def call(kernel: build.Kernel) -> int:
    kernel.fn.restype = ctypes.c_int64
    return kernel.fn()


@pytest.fixture
def real_cc():
    """The compiler found without a launcher (before the test sets $CC)."""
    build.forget()
    cc = build.find_compiler()[0]
    yield cc
    build.forget()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("OPGRAPH_CACHE_DIR", str(d))
    build.forget()
    yield d
    build.forget()


def script(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_a_launcher_in_cc_runs_the_compiler(real_cc, cache, tmp_path, monkeypatch):
    """CC="launcher gcc" (its path with a space, quoted as in a shell) compiles every kernel
    through the launcher, as make would: it was refused as a compiler not found on PATH."""
    log = tmp_path / "launches.txt"
    launcher = script(tmp_path / "my tools" / "launch", LAUNCHER % log)
    monkeypatch.setenv("CC", shlex.join([str(launcher), *real_cc]))
    assert build.availability() == (True, "")
    assert build.find_compiler()[0] == (str(launcher), *real_cc)
    kernel = build.load(kernel_source(41))
    assert call(kernel) == 41
    compiles = [line for line in log.read_text().splitlines() if "-o" in line.split()]
    assert compiles and all(line.startswith(" ".join(real_cc)) for line in compiles), compiles
    assert any("-ffp-contract=off" in line and str(kernel.library.stem) in line for line in compiles)
    assert shlex.split(kernel.library.with_suffix(".cmd").read_text())[:len(real_cc) + 1] == \
        [str(launcher), *real_cc]
    assert build.describe().startswith(shlex.join([str(launcher), *real_cc]) + " -O2")


@pytest.mark.parametrize("cc, why", [
    ("no-such-launcher-opgraph gcc", "$CC is 'no-such-launcher-opgraph gcc', which (its program "
                                     "'no-such-launcher-opgraph') is not found on PATH"),
    ("'gcc", "$CC is \"'gcc\", which cannot be split into words as a shell would: No closing quotation"),
])
def test_a_cc_that_names_no_program_says_so(monkeypatch, cc, why):
    monkeypatch.setenv("CC", cc)
    build.forget()
    ok, message = build.availability()
    assert not ok and message.startswith(why), message
    with pytest.raises(build.NativeBuildError, match="^" + why.replace("(", r"\(").replace(")", r"\)")
                       .replace("$", r"\$")):
        build.load(kernel_source(42))


@pytest.mark.parametrize("body, error", [("\x7fELF not a program", "cannot run the C compiler {}: Exec format error"),
                                         ("#!/bin/sh\nexec sleep 30\n", "the C compiler {} did not finish in 1 s")])
def test_a_launcher_that_cannot_run_or_hangs_is_one_clear_error(real_cc, cache, tmp_path, monkeypatch,
                                                                 body, error):
    """The clear errors of a single-word $CC hold for a launcher's command, naming all of it."""
    launcher = script(tmp_path / "launch", body)
    cc = [str(launcher), *real_cc]
    monkeypatch.setenv("CC", shlex.join(cc))
    monkeypatch.setattr(compiler, "COMPILE_TIMEOUT", 1)
    with pytest.raises(build.NativeBuildError) as e:
        build.load(kernel_source(43))
    assert str(e.value).startswith(error.format(shlex.join(cc))), str(e.value)


def test_the_cache_dir_may_start_with_a_tilde(tmp_path, monkeypatch):
    """OPGRAPH_CACHE_DIR=~/x is the x in the home directory (a directory named '~' in the
    working directory was made)."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.setenv("OPGRAPH_CACHE_DIR", "~/kernels")
    build.forget()
    try:
        assert build.cache_dir() == home / "kernels"
        kernel = build.load(kernel_source(44))
        assert call(kernel) == 44 and kernel.library.parent == home / "kernels"
        assert not (work / "~").exists()
    finally:
        build.forget()


@pytest.mark.parametrize("xdg, under", [("relative/cache", "home/.cache"), ("", "home/.cache"),
                                        ("{tmp}/xdg", "xdg")])
def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch, xdg, under):
    """The XDG Base Directory spec: a relative $XDG_CACHE_HOME is invalid and ignored (it made
    the cache a directory under whatever the working directory was)."""
    monkeypatch.delenv("OPGRAPH_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", xdg.format(tmp=tmp_path))
    assert build.cache_dir() == tmp_path / under / "opgraph" / "native"


def test_without_cc_the_names_tried_lead_to_the_one_found(tmp_path, monkeypatch):
    """No $CC: cc, then gcc, then clang on PATH; the names tried end with the one found."""
    gcc_here = script(tmp_path / "bin" / "gcc", "#!/bin/sh\nexit 0\n")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(gcc_here.parent))
    build.forget()
    try:
        assert build.find_compiler() == ((str(gcc_here),), ["cc", "gcc"])
    finally:
        build.forget()


# a kernel whose value depends on an extra flag
FLAGGED_SOURCE = ("#include <stdint.h>\nint64_t opg_kernel(void) {\n#ifdef OPG_TWO\n    return 2;\n"
                  "#else\n    return 1;\n#endif\n}\n")


def test_cache_key_follows_the_extra_flags_the_compiler_and_the_cpu(monkeypatch):
    """The disk key of a source changes with the extra flags, the compiler's identity and the
    CPU tag (a -march=native object must not travel), each on its own."""
    cc = ["cc"]
    key = build.cache_key(FLAGGED_SOURCE, cc)
    assert build.cache_key(FLAGGED_SOURCE, cc) == key
    assert build.cache_key(FLAGGED_SOURCE, cc, ["-DOPG_TWO"]) != key
    monkeypatch.setattr(compiler, "identity", lambda c: "/elsewhere/cc")
    assert build.cache_key(FLAGGED_SOURCE, cc) != key
    monkeypatch.undo()
    monkeypatch.setattr(build, "_cpu_tag", lambda: "another|cpu|0000000000000000")
    assert build.cache_key(FLAGGED_SOURCE, cc) != key


def _program(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_identity_names_the_compiler_behind_a_launcher_and_its_build(tmp_path, monkeypatch):
    """The cache key's compiler identity: with ``CC="launcher gcc"`` another ``gcc`` on PATH is
    another identity (the launcher alone named the same one for both); so is the same path
    reinstalled (size or modification time); flags and words that name no program stay as
    written."""
    launcher = _program(tmp_path / "bin" / "launcher", "#!/bin/sh\n")
    first = _program(tmp_path / "a" / "gcc", "#!/bin/sh\n# one\n")
    _program(tmp_path / "b" / "gcc", "#!/bin/sh\n# the other one\n")
    words = [str(launcher), "gcc", "-m64", "no-such-program"]
    monkeypatch.setenv("PATH", str(tmp_path / "a"))
    one = compiler.identity(words)
    assert str(first) in one and one.endswith(" -m64 no-such-program")
    assert compiler.identity(words) == one
    monkeypatch.setenv("PATH", str(tmp_path / "b"))
    assert compiler.identity(words) != one
    monkeypatch.setenv("PATH", str(tmp_path / "a"))
    st = first.stat()
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert compiler.identity(words) != one


def test_in_process_memo_tells_extra_flags_apart(cache):
    """One source loaded with and without an extra -D flag is two kernels, in either order
    and again (the in-process memo is keyed by the flags too)."""
    assert call(build.load(FLAGGED_SOURCE)) == 1
    assert call(build.load(FLAGGED_SOURCE, ["-DOPG_TWO"])) == 2
    assert call(build.load(FLAGGED_SOURCE)) == 1
    assert call(build.load(FLAGGED_SOURCE, ["-DOPG_TWO"])) == 2


def test_eviction_keeps_a_cache_of_exactly_the_limit(cache):
    """A cache holding exactly the limit's bytes is within it: nothing is evicted; one byte
    less of limit evicts the least recently used entry, its three files."""
    build.private_dir(cache)
    for k, (age, size) in enumerate([(300, 100), (200, 50)]):
        for ext, n in (("so", size), ("c", 10), ("cmd", 5)):
            p = cache / f"k_{str(k) * 64}.{ext}"
            p.write_bytes(b"x" * n)
            t = 1_700_000_000 - age
            os.utime(p, (t, t))
    assert sum(p.stat().st_size for p in cache.iterdir()) == 180  # 115 + 65 bytes
    assert build.evict(180, cache) == []
    gone = build.evict(179, cache)
    assert sorted(p.name for p in gone) == [f"k_{'0' * 64}.{e}" for e in ("c", "cmd", "so")]
