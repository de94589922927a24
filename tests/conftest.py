"""Shared fixtures: every test starts and ends on the defaults (platform, backend, opt level)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import reference` from any rootdir

import opgraph  # noqa: E402


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
