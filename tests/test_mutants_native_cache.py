"""The native kernel cache's keys and bounds where a mutation audit of backends/native/build.py
found them unpinned: what the disk key and the in-process memo tell apart, and the eviction
bound reached exactly."""
from __future__ import annotations

import ctypes
import os

import pytest

from backends import native
from backends.native import build, compiler

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])

SOURCE = "int opg_kernel(void) {\n#ifdef OPG_TWO\n    return 2;\n#else\n    return 1;\n#endif\n}\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory of this test's (and the in-process caches forgotten)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("OPGRAPH_CACHE_DIR", str(d))
    build.forget()
    yield d
    build.forget()


def _value(kernel) -> int:
    kernel.fn.argtypes, kernel.fn.restype = [], ctypes.c_int
    return kernel.fn()


def test_cache_key_follows_the_extra_flags_the_compiler_and_the_cpu(monkeypatch):
    """The disk key of a source changes with the extra flags, the compiler's identity and the
    CPU tag (a -march=native object must not travel), each on its own."""
    cc = ["cc"]
    key = build.cache_key(SOURCE, cc)
    assert build.cache_key(SOURCE, cc) == key
    assert build.cache_key(SOURCE, cc, ["-DOPG_TWO"]) != key
    monkeypatch.setattr(compiler, "identity", lambda c: "/elsewhere/cc")
    assert build.cache_key(SOURCE, cc) != key
    monkeypatch.undo()
    monkeypatch.setattr(build, "_cpu_tag", lambda: "another|cpu|0000000000000000")
    assert build.cache_key(SOURCE, cc) != key


def test_in_process_memo_tells_extra_flags_apart(cache):
    """One source loaded with and without an extra -D flag is two kernels, in either order
    and again (the in-process memo is keyed by the flags too)."""
    assert _value(build.load(SOURCE)) == 1
    assert _value(build.load(SOURCE, ["-DOPG_TWO"])) == 2
    assert _value(build.load(SOURCE)) == 1
    assert _value(build.load(SOURCE, ["-DOPG_TWO"])) == 2


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
