"""The native kernels under AddressSanitizer (``tests/native_sanitizer.py``): every op_api the
kit knows, run through native with ASan-instrumented kernels in a child Python, reads and writes
nothing outside its tensors; and the harness does catch a kernel that does."""
from __future__ import annotations

import pytest

import backends
from family import shipped_op_apis
from native_sanitizer import PLATFORMS, RUNS, run_child, run_workload, sanitized_env, unit

pytestmark = pytest.mark.skipif("native" not in backends.available(),
                                reason="native backend needs a C compiler (install gcc)")

# one element past the end of a numpy array, written by a kernel built as the backend builds its
# own (build.load, $CC): the child must stop with ASan's report
OVERFLOW = """
import ctypes, numpy as np
from backends.native import build
k = build.load("void opg_kernel(float *a, long n) { for (long i = 0; i <= n; i++) a[i] = 1; }")
a = np.zeros(1000, np.float32)
k.fn(ctypes.c_void_p(a.ctypes.data), ctypes.c_long(a.size))
print("not caught")
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    found = sanitized_env(str(tmp_path_factory.mktemp("asan-kernels")))
    if found is None:
        pytest.skip("the native compiler has no AddressSanitizer runtime (install gcc and libasan)")
    return found


def test_the_harness_catches_a_kernel_writing_past_a_tensor(env):
    child = run_child(["-c", OVERFLOW], env, timeout=120)
    assert child.returncode == 86, child.stdout + child.stderr[-3000:]
    assert "AddressSanitizer: heap-buffer-overflow" in child.stderr
    assert "not caught" not in child.stdout


def test_every_op_api_on_native_stays_inside_its_tensors(env):
    ran = {run: [] for run in RUNS}
    for code, out, err in run_workload(env, parts=2, timeout=600):
        report = out + err[-6000:]
        assert code == 0, report
        assert "Sanitizer" not in err, report
        for line in out.splitlines():  # "<run>: <n> cases by <t> s: <op_api@platform> ..."
            run, _, units = line.split(": ")
            ran[run] += units.split()
    expected = sorted(unit(s.name, p) for s in shipped_op_apis() for p in PLATFORMS
                      if p in s.platforms)
    assert len(expected) >= 14 and all(sorted(units) == expected for units in ran.values()), ran
