"""The benchmarks still run: each one, at its smallest setting, exits 0 and prints the rows it
exists for. Nothing here is timed or compares speeds (the benchmarks do that, not the tests)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backends import native

ROOT = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None


def run(script: str, *args: str) -> str:
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_bench_elemt_backward_prints_its_table_and_refuses_an_unknown_dtype():
    out = run("bench_elemt_backward.py", "--shapes", "1,2,4", "--dtypes", "fp32", "--reps", "1",
              "--only", "native", "--no-latency")
    assert "fp32 [1, 2, 4]" in out and "floor np.add" in out and "floor raw bits" in out
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_elemt_backward.py"),
                        "--dtypes", "float16"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "--dtypes: unknown float16" in p.stderr


NEEDS_NATIVE = pytest.mark.skipif(not native.available(), reason=native.availability()[1])


def _bench_common():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "bench_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@NEEDS_NATIVE
def test_the_fp16_steps_floor_computes_the_faithful_steps_it_stands_for():
    """The floor of a bit-faithful fp16 kernel does that kernel's arithmetic: each step rounded
    to fp16 (numpy's float16 operators round each result), the vector loop and its scalar tail,
    specials included. The fp16 table of bench_elemt_backward prints it."""
    rng = np.random.default_rng(0)
    n = 4099  # a scalar tail after the vector loop
    a, b = (rng.standard_normal(n).astype(np.float16) * 300 for _ in range(2))
    a[:6] = [np.nan, np.inf, -np.inf, 6e-8, 65000, -0.0]
    b[6:9] = [np.float16(np.nan), 2e-7, -65504]
    out = np.zeros(n, np.float16)
    _bench_common().c_f16_steps_variant([a, b], out)()
    h = np.float16
    with np.errstate(all="ignore"):
        want = ((((a - h(0.25)) - (b - h(-0.5)) * h(1.5)) * h(0.75)) * h(1.25))
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))
    table = run("bench_elemt_backward.py", "--shapes", "1,2,4", "--dtypes", "fp16", "--reps", "1",
                "--only", "native", "--no-latency")
    assert "floor C fp16 steps" in table


@NEEDS_NATIVE
def test_bench_family_prints_a_row_per_op_api():
    out = run("bench_family.py", "--quick", "--ops", "Stats", "--reps", "1")
    for op in ("BatchNormStats ", "BatchNormGatherStatsWithCounts", "SyncBatchNormGatherStats"):
        assert op in out


@NEEDS_NATIVE
def test_bench_capture_compares_the_program_with_the_calls():
    out = run("bench_capture.py", "--quick", "--reps", "1")
    assert "calls one by one" in out and "program, level 2" in out


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install 'opgraph[torch]')")
def test_bench_syncbn_runs_the_layer_against_torch():
    out = run("bench_syncbn.py", "--quick", "--reps", "1", "--dtypes", "fp32")
    assert "opgraph SyncBatchNorm" in out and "torch BatchNorm2d" in out
    assert "empty autograd.Function" in out


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install 'opgraph[torch]')")
@NEEDS_NATIVE
def test_bench_syncbn_compares_the_native_thread_runtimes():
    out = run("bench_syncbn.py", "--quick", "--reps", "1", "--dtypes", "fp32", "--backends",
              "native", "--runtimes", "team,openmp")
    assert "native on team" in out and "native on openmp" in out
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_syncbn.py"),
                        "--runtimes", "pthreads"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "--runtimes: choose from team, openmp" in p.stderr


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install 'opgraph[torch]')")
@NEEDS_NATIVE
def test_bench_interleave_reports_both_runtimes():
    out = run("bench_interleave.py", "--quick", "--blocks", "1")
    assert "opgraph after torch" in out and "torch 3rd in a row" in out
    assert "\n  team " in out and "\n  openmp " in out


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_benchmark_arrays_sit_in_private_memory_advised_onto_huge_pages():
    """Shared anonymous memory (mmap's default) is shmem, which gets no transparent huge pages
    where ``shmem_enabled`` is ``never``: the arrays must be private, and advised."""
    a = _bench_common().on_huge_pages(np.ones((4, 1 << 18), np.float32))
    flags = _mapping_flags(a.ctypes.data)
    assert "sh" not in flags and "hg" in flags, flags
    assert a.sum() == 4 << 18


def test_the_pythonic_latency_times_both_ways_and_leaves_direct_calls_as_they_were():
    spec = importlib.util.spec_from_file_location(
        "bench_elemt_backward", ROOT / "benchmarks" / "bench_elemt_backward.py")
    sys.path.insert(0, str(ROOT / "benchmarks"))  # its bench_common
    try:
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    arrays, _ = bench.make_inputs((1, 2, 4), np.float32)
    bench.NUMPY_CALLS.enabled = False
    try:
        usual, direct = bench.pythonic_latency("numpy", arrays, 2)
        assert usual > 0 and direct > 0 and bench.NUMPY_CALLS.enabled is False
    finally:
        bench.NUMPY_CALLS.enabled = True


def test_interleaved_samples_start_one_variant_later_each_repeat():
    """Each variant follows each other one in turn (a call's time depends on what the variant
    before it left in the caches), every variant sampled ``reps`` times."""
    calls: list[str] = []

    def sample(fn) -> float:
        fn()
        return float(len(calls))
    fns = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    times = _bench_common().interleaved(fns, 4, sample=sample)
    assert calls == list("abc" "bca" "cab" "abc")
    assert times == {"a": [1.0, 6.0, 8.0, 10.0], "b": [2.0, 4.0, 9.0, 11.0],
                     "c": [3.0, 5.0, 7.0, 12.0]}
