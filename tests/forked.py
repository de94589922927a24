"""Run a check in a forked child, bounded by a timeout and always reaped (for code that keeps
threads, which a fork does not copy)."""
from __future__ import annotations

import os
import time
from typing import Callable

import pytest


def in_forked_child(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Fork; the child runs ``check()`` and exits 0 if it is true. Fails the test when the child
    fails, raises or is still running after ``timeout`` seconds (then it is killed)."""
    pid = os.fork()
    if pid == 0:
        try:
            ok = check()
        except BaseException:
            os._exit(2)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child hung {what}")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0, f"the forked child failed {what}"
