"""opgraph.core.quiet: numpy's floating-point warnings off between silence() and restore(), the
caller's error state (and its other settings) back after, per thread; and the numpy backend,
which runs under it, leaves the caller's state as it found it, also when a run fails."""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

import opgraph
from opgraph.core.quiet import restore, silence


def divide_by_zero() -> float:
    return float(np.divide(np.float32(1), np.float32(0)))


def test_silence_turns_warnings_off_and_restore_brings_the_callers_state_back():
    with np.errstate(divide="raise", over="warn", invalid="call", call=lambda *a: None):
        before = np.geterr()
        np.setbufsize(16384)
        token = silence()
        try:
            assert divide_by_zero() == np.inf  # no FloatingPointError
            assert set(np.geterr().values()) == {"ignore"}
            assert np.getbufsize() == 16384  # the caller's other settings stay
        finally:
            restore(token)
        assert np.geterr() == before
        with pytest.raises(FloatingPointError):
            divide_by_zero()
    np.setbufsize(8192)


def test_silence_nests_and_is_per_thread():
    with np.errstate(all="raise"):
        outer = silence()
        inner = silence()
        restore(inner)
        assert divide_by_zero() == np.inf  # the outer silence still holds
        seen = []

        def other_thread():
            with np.errstate(all="raise"):
                try:
                    divide_by_zero()
                except FloatingPointError:
                    seen.append("raised")
        t = threading.Thread(target=other_thread)
        t.start(); t.join()
        restore(outer)
        assert seen == ["raised"]
        with pytest.raises(FloatingPointError):
            divide_by_zero()


@pytest.mark.parametrize("level", [0, 2])
def test_the_numpy_backend_runs_quietly_and_restores_the_state(level):
    x = np.ones((1, 2, 4), np.float32)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        with opgraph.use_backend("numpy"), opgraph.opt_level(level):
            # a zero counter divides by zero: inf/NaN in the result, no warning and no raise
            got = opgraph.ops.batch_norm_elemt_backward(
                x, x, np.zeros(2, np.float32), np.ones(2, np.float32), np.ones(2, np.float32),
                np.ones(2, np.float32), np.ones(2, np.float32), np.zeros(1, np.int32))
        assert not np.isfinite(got).all()
        assert set(np.geterr().values()) == {"raise"}
        with pytest.raises(FloatingPointError):
            divide_by_zero()


def test_a_failing_numpy_run_restores_the_state_too():
    x = opgraph.tensor(np.ones((1, 2, 4), np.float32))
    c = opgraph.tensor(np.ones(2, np.float32))
    n = opgraph.tensor(np.ones(1, np.int32))
    out = opgraph.tensor(np.zeros((1, 2, 4), np.float32))
    with opgraph.use_backend("numpy"):
        status, _, ex = opgraph.aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
            x, x, c, c, c, c, c, n, out)
        assert status == 0
        exe = ex.program.executable(opgraph.core.backend.get("numpy"))
    with np.errstate(all="raise"):
        with pytest.raises(Exception):
            exe.run({})  # nothing bound: the run fails
        assert set(np.geterr().values()) == {"raise"}
