"""Zero channels (C = 0) through the op_apis that take them: phase 2 succeeds at every level on
numpy and native, as phase 1 does (at level 0 the memory plan gave the empty intermediates
places in a workspace of 0 bytes, and phase 2 refused to run without one), and emit-cpp's
program for them compiles (it pointed those tensors into an arena it never declared)."""
from __future__ import annotations

import pytest

from backends import native
from cpp_helpers import compile_cpp, needs_gxx, run_cli

CASES = [("aclnnBatchNormReduce", "2,0,4,5"), ("aclnnBatchNormGatherStatsWithCounts", "3,0"),
         ("aclnnSyncBatchNormGatherStats", "2,0")]
BACKENDS = ["numpy", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason=native.availability()[1]))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("op, shape", CASES)
def test_zero_channels_run_at_every_level(op, shape, level, backend):
    rc, log = run_cli(["run", op, "--shape", shape, "--level", str(level), "--backend", backend])
    assert rc == 0 and "max rel error: 0.000e+00" in log, log


@needs_gxx
@pytest.mark.parametrize("op, shape", CASES[:2])  # (those with a public aclnn API)
def test_zero_channels_emit_cpp_that_compiles(op, shape, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (emit-cpp writes its .bin inputs into the working directory)
    src = tmp_path / "prog.cpp"
    rc, log = run_cli(["emit-cpp", op, "--shape", shape, "--level", "0", "-o", str(src)])
    assert rc == 0, log
    assert compile_cpp(src, "-fsyntax-only") == ""
