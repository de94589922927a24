"""Shared fixtures: every test starts and ends on the defaults (platform, backend, opt level)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import reference` from any rootdir
# Once torch is imported the native backend would run on its OpenMP threads (backends.native.
# team.share_openmp), which by default spin for milliseconds after every parallel call: in the
# suite that takes a core from its own worker threads and rank processes (the whole run took
# ~10 min on 2 vCPUs instead of 4.6). With idle threads asleep the backend keeps its own team
# (share_openmp_if_spinning); the team's tests run on both runtimes explicitly. Set before
# anything loads libgomp; no result depends on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import backends  # noqa: E402
import opgraph  # noqa: E402
from backends.aclnn.runtime import AclnnBackend  # noqa: E402
from backends.native import team  # noqa: E402
from l0ops import workers  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_context():
    """Tests may call set_platform / set_backend / set_opt_level; undo that afterwards."""
    plat, backend, level = opgraph.get_platform(), opgraph.get_backend_name(), opgraph.get_opt_level()
    yield
    opgraph.set_platform(plat)
    opgraph.set_backend(backend)
    opgraph.set_opt_level(level)


@pytest.fixture(params=[0, 1, 2], ids=lambda n: f"O{n}")
def level(request):
    """Run the test body at each optimisation level (phase 2 runs ``executor.compiled``)."""
    with opgraph.opt_level(request.param):
        yield request.param


STUB_SRC = os.path.join(os.path.dirname(__file__), "fixtures", "aclnn_stub.c")


@pytest.fixture(scope="session")
def stub_lib(tmp_path_factory):
    """A CPU stand-in for the CANN libraries (tests/fixtures/aclnn_stub.c), compiled once."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (install gcc) to build the aclnn stub library")
    out = tmp_path_factory.mktemp("stub") / "libaclnn_stub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-ffp-contract=off", "-o", str(out), STUB_SRC],
                   check=True)
    return str(out)


DELEGATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_double))


def stub_tensor(lib, ptr) -> "opgraph.Tensor | None":
    """An opgraph.Tensor over the memory of a stub aclTensor (None for NULL)."""
    if not ptr:
        return None
    dims, strides = (ctypes.c_int64 * 8)(), (ctypes.c_int64 * 8)()
    offset, nd = ctypes.c_int64(), ctypes.c_uint64()
    dtype, fmt, data = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
    lib.stub_tensor_info(ctypes.c_void_p(ptr), dims, strides, ctypes.byref(offset), ctypes.byref(nd),
                         ctypes.byref(dtype), ctypes.byref(fmt), ctypes.byref(data))
    shape, st = tuple(dims[:nd.value]), tuple(strides[:nd.value])
    dt = opgraph.DataType(dtype.value).np
    extent = offset.value + 1 + sum((n - 1) * s for n, s in zip(shape, st)) if all(shape) else 0
    buf = (ctypes.c_char * (max(extent, 1) * dt.itemsize)).from_address(data.value)
    storage = np.frombuffer(buf, dt, count=max(extent, 1))
    return opgraph.Tensor(storage, shape, st, offset.value, opgraph.Format(fmt.value))


def make_delegate(lib):
    """The stub's phase 2 of a delegated API: opgraph's own op_api on numpy, over the stub's
    memory (what the stub tests is the plan and the runtime, not the numerics)."""
    def delegate(api, n, kinds, tensors, scalars):
        spec = opgraph.aclnn.get_op_api(api.decode())
        args = []
        for i, p in enumerate(spec.params):
            if kinds[i] == 0:
                args.append(stub_tensor(lib, tensors[i]))
            elif kinds[i] == 2:
                args.append(bool(scalars[i]))
            else:
                args.append(float(scalars[i]))
        with opgraph.use_backend("numpy"):
            st, ws, ex = spec.get_workspace_size(*args)
            if st == 0:
                st = spec.run(bytearray(ws) if ws else None, ws, ex)
        return int(st)
    return DELEGATE(delegate)


@pytest.fixture
def stub_backend(stub_lib):
    """Backend ``aclnn-stub``: the aclnn backend running on the stub library."""
    backend = AclnnBackend(libs=[stub_lib])
    backends.register("aclnn-stub", backend, replace=True)
    lib = ctypes.CDLL(stub_lib)
    lib.stub_calls.restype = ctypes.c_char_p
    lib.stub_set_delegate.argtypes = [DELEGATE]
    delegate = make_delegate(lib)
    lib.stub_set_delegate(delegate)
    lib.stub_reset()
    yield lib
    lib.stub_reset()


@pytest.fixture
def threads():
    """``team.set_threads`` for a test, the native team's size restored after it."""
    before = team.threads()
    yield team.set_threads
    team.set_threads(before)


@pytest.fixture
def thread_count():
    """``l0ops.workers.set_threads`` for a test (the numpy interpreter's worker threads), the
    count restored after it."""
    before = workers.threads()
    yield workers.set_threads
    workers.set_threads(before)
