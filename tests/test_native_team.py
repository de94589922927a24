"""The native backend's thread team: every work item runs exactly once for any thread count,
grain and team state (busy, forked); kernels give the numpy backend's bits for 1, 2 and many
threads at sizes around the serial/parallel threshold, in every dtype, and the independent
reference's bits — on the team's own threads and on a shared OpenMP runtime
(:func:`backends.native.team.share_openmp`)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import backends
import opgraph
import reference as R
from forked import in_forked_child
from backends import native
from native_limits import reduce_limits_at
from backends.native import build, render, team

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])

THREADS = (1, 2, 7)
DTYPES = {"f32": R.F32, "f16": R.F16, "bf16": R.BF16}
# element counts just below, at and above the threshold, and a multi-claim size with short rows
SIZES = {"below": (1, 7, 4681), "at": (2, 4, render.PARALLEL_MIN // 8), "above": (3, 1, 10923),
         "rows": (16, 64, 7, 7), "long-rows": (2, 3, 3 * render.BLOCK + 5)}

COUNT_SOURCE = "#include <stdint.h>\n" + team.C_DECL + r"""
static void count(void *ctx, int64_t begin, int64_t end) {
    int32_t *c = (int32_t *)ctx;
    for (int64_t i = begin; i < end; ++i) __atomic_fetch_add(&c[i], 1, __ATOMIC_RELAXED);
}
void opg_kernel(opg_run run, int32_t *counts, int64_t n, int64_t grain) { run(count, counts, n, grain); }
"""



def _openmp_loaded() -> bool:
    """Map an OpenMP runtime into this process (torch's when torch is imported, else the
    system's libgomp), as a library that uses OpenMP would."""
    try:
        ctypes.CDLL("libgomp.so.1")
    except OSError:
        return False
    return bool(team.openmp_libraries())


@pytest.fixture(params=["team", "openmp"])
def runtime(request):
    """Run the test's parallel calls on the team, then on a shared OpenMP runtime."""
    before = team.runtime()
    if request.param == "openmp" and not (_openmp_loaded() and team.share_openmp()):
        pytest.skip("no OpenMP runtime to share: needs libgomp (apt-get install libgomp1) and "
                    "a compiler that takes -fopenmp")
    if request.param == "team":
        team.share_openmp(False)
    assert team.runtime() == request.param
    yield request.param
    team.share_openmp(before == "openmp")


@pytest.fixture(autouse=True)
def kernels_of_any_size(monkeypatch):
    reduce_limits_at(monkeypatch, 0)


def _counter():
    fn = build.load(COUNT_SOURCE).fn
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    fn.restype = None

    def run(n: int, grain: int) -> np.ndarray:
        counts = np.zeros(max(n, 1), np.int32)
        fn(team.runner(), counts.ctypes.data, n, grain)
        return counts[:n]
    return run


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("n,grain", [(1, 1), (2, 1), (1000, 1), (1000, 7), (1000, 999),
                                     (1000, 1000), (1000, 5000), (100003, 64), (5, 0)])
def test_every_item_runs_exactly_once(n, grain, n_threads, threads, runtime):
    threads(n_threads)
    run = _counter()
    for _ in range(3):  # the team is reused between calls
        assert np.array_equal(run(n, grain), np.ones(n, np.int32))
    assert run(0, 4).size == 0


def test_calls_from_many_python_threads_at_once(threads, runtime):
    """One job at a time: concurrent callers run serially on their own threads, none is lost."""
    threads(2)
    run = _counter()
    bad: list = []

    def worker():
        for _ in range(50):
            c = run(20000, 16)
            if not np.array_equal(c, np.ones(20000, np.int32)):
                bad.append(c)
    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not bad and not any(t.is_alive() for t in ts)


def test_a_forked_child_gets_a_working_team(threads, runtime):
    threads(2)
    run = _counter()
    assert run(50000, 8).sum() == 50000  # the parent's workers exist now
    # the workers did not survive the fork: the child's first calls must start new ones (and
    # leave the parent's OpenMP threads alone: libgomp hangs in a forked child)
    in_forked_child(lambda: all(np.array_equal(run(50000, 8), np.ones(50000, np.int32))
                                for _ in range(5)), "in the thread team")


BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
RUN = ctypes.CFUNCTYPE(None, BODY, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


def test_claims_are_shared_out_over_the_threads(threads, runtime):
    """``run(body, ctx, n, grain)`` calls ``body`` once per claim of ``grain`` items, on the
    caller and the other thread both."""
    threads(2)
    seen, lock = [], threading.Lock()

    @BODY
    def body(ctx, begin, end):
        with lock:
            seen.append((threading.get_ident(), begin, end))
        time.sleep(0.002)  # long enough that one thread cannot take every claim
    RUN(team.runner())(body, None, 40, 3)
    assert sorted((b, e) for _, b, e in seen) == [(b, min(b + 3, 40)) for b in range(0, 40, 3)]
    assert len({t for t, _, _ in seen}) == 2


def test_openmp_runtime_is_opt_out_and_never_a_second_one(monkeypatch):
    monkeypatch.setenv("OPGRAPH_RUNTIME", "team")
    before = team.runtime()
    try:
        assert team.share_openmp() is False and team.runtime() == "team"
    finally:
        monkeypatch.delenv("OPGRAPH_RUNTIME")
        team.share_openmp(before == "openmp")
    # a process without an OpenMP runtime keeps the team: sharing would start a runtime of its own
    probe = ("import backends.native.team as t; r = t.runner(); "
             "print(sorted(t.openmp_libraries()), t.share_openmp(), t.runtime())")
    env = {k: v for k, v in os.environ.items() if k != "OPGRAPH_RUNTIME"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, env=env, cwd=Path(__file__).parents[1])
    assert out.stdout.split() == ["[]", "False", "team"], out.stderr
    # a compiler that cannot build OpenMP code: declined once, and not tried again on every call
    probe = ("import ctypes; ctypes.CDLL('libgomp.so.1')\n"
             "import backends.native.build as b, backends.native.team as t\n"
             "real, tried = b.load, []\n"
             "def load(src, extra=(), symbol=b.SYMBOL):\n"
             "    if symbol == 'opg_omp_run':\n"
             "        tried.append(1); raise b.NativeBuildError('no -fopenmp here')\n"
             "    return real(src, extra, symbol)\n"
             "b.load = load\n"
             "r = t.runner()\n"
             "print(t.runtime(), t.share_openmp(), t.share_openmp(), len(tried))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, env=env, cwd=Path(__file__).parents[1])
    if "OSError" in out.stderr:
        pytest.skip("no libgomp to load (apt-get install libgomp1)")
    assert out.stdout.split() == ["team", "False", "False", "1"], out.stderr


def test_set_threads(threads):
    threads(3)
    assert team.threads() == 3
    for bad in (0, -2, 1.5, "2"):
        with pytest.raises(ValueError, match="threads must be an integer >= 1"):
            team.set_threads(bad)
    assert team.threads() == 3  # (the environment's default: tests/test_numpy_workers.py)


def test_a_huge_thread_count_or_spin_is_the_most_the_team_takes(threads):
    """More threads than the team holds are that many, in set_threads and in the environment;
    ctypes wrapped a larger int into int64 silently (2**64 + 1 threads ran on one)."""
    threads(2)
    try:
        team.set_threads(2 ** 64 + 1, spin_us=1e30)
        assert team.threads() == team.MAX_THREADS
        team.set_threads(2, spin_us=float("inf"))
        assert team.threads() == 2
    finally:
        team.set_threads(2, spin_us=team.spin_us())  # idle workers sleep again
    code = "from backends.native import team; print(team.threads())"
    env = dict(os.environ, OPGRAPH_NUM_THREADS=str(2 ** 64 + 2), OPGRAPH_SPIN_US="1e300")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, cwd=Path(__file__).parent.parent)
    assert proc.stdout.split() == [str(team.MAX_THREADS)], proc.stderr


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_kernels_bit_identical_for_any_thread_count(size, dtype, threads, runtime):
    case = R.make_case(SIZES[size], DTYPES[dtype], seed=11)
    with opgraph.opt_level(2), opgraph.use_backend("numpy"):
        expected = R.compute(case)
    R.assert_bits_equal(expected, case.expected())
    b = backends.get("native")
    b.fallbacks.clear()
    for n in THREADS:
        threads(n)
        with opgraph.opt_level(2), opgraph.use_backend("native"):
            R.assert_bits_equal(R.compute(case), expected)
    assert not b.fallbacks, dict(b.fallbacks)


def test_exact_alias_runs_in_c_and_a_partial_overlap_as_recorded():
    """gradInput written over gradOut itself is fine in C; a shifted overlap is compiled as
    recorded by phase 1 (writes_shared_memory), so no fused kernel sees it, and it leaves
    level 0's bits."""
    case = R.make_case((2, 3, 64), R.F32, seed=3)
    with opgraph.opt_level(2), opgraph.use_backend("numpy"):
        expected = R.compute(case)
    b = backends.get("native")
    buf = case.gradOut.copy()
    b.fallbacks.clear()
    with opgraph.opt_level(2), opgraph.use_backend("native"):
        got = opgraph.ops.batch_norm_elemt_backward(buf, case.input, case.mean, case.invstd,
                                                    case.weight, case.sumDy, case.sumDyXmu,
                                                    case.counter, out=buf)
    R.assert_bits_equal(got, expected)
    assert not b.fallbacks
    results = []
    for level, backend in ((2, "native"), (0, "numpy")):
        flat = np.concatenate([case.gradOut.ravel(), np.zeros(1, R.F32)])
        shifted = flat[1:].reshape(case.gradOut.shape)
        go = flat[:-1].reshape(case.gradOut.shape)
        with opgraph.opt_level(level), opgraph.use_backend(backend):
            opgraph.ops.batch_norm_elemt_backward(go, case.input, case.mean, case.invstd, case.weight,
                                                  case.sumDy, case.sumDyXmu, case.counter, out=shifted)
        results.append(flat)
    R.assert_bits_equal(results[0], results[1])
    assert not b.fallbacks


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_streaming_stores_bit_identical(dtype, offset, threads):
    """Outputs of at least STREAM_BYTES take the non-temporal store loop: its scalar peel up to
    the vector alignment (output views starting ``offset`` elements into a buffer) and its tail
    give numpy's bits, for 1 and 2 threads."""
    dt = DTYPES[dtype]
    n = render.STREAM_BYTES // dt.itemsize // 16 + 13
    case = R.make_case((2, 8, n), dt, seed=5)
    with opgraph.opt_level(2), opgraph.use_backend("numpy"):
        expected = R.compute(case)
    for k in (1, 2):
        threads(k)
        buf = np.full(case.input.size + 8, 7, dt)
        out = buf[offset:offset + case.input.size].reshape(case.input.shape)
        with opgraph.opt_level(2), opgraph.use_backend("native"):
            got = opgraph.ops.batch_norm_elemt_backward(*case.arrays(), out=out)
        assert got.nbytes >= render.STREAM_BYTES
        R.assert_bits_equal(out, expected)
        assert np.array_equal(R.bits(buf[:offset]), R.bits(np.full(offset, 7, dt)))
        assert np.array_equal(R.bits(buf[offset + out.size:]), R.bits(np.full(8 - offset, 7, dt)))
