"""Shared fixtures: every test starts and ends on the defaults (platform, backend, opt level)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import reference` from any rootdir

import backends  # noqa: E402
import opgraph  # noqa: E402
from backends.aclnn.runtime import AclnnBackend  # noqa: E402


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


@pytest.fixture
def stub_backend(stub_lib):
    """Backend ``aclnn-stub``: the aclnn backend running on the stub library."""
    backend = AclnnBackend(libs=[stub_lib])
    backends.register("aclnn-stub", backend, replace=True)
    lib = ctypes.CDLL(stub_lib)
    lib.stub_calls.restype = ctypes.c_char_p
    lib.stub_reset()
    yield lib
    lib.stub_reset()
