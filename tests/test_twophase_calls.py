"""Phase 1 and phase 2 as a Python caller may call them: arguments by name, and one executor
run from two threads."""
from __future__ import annotations

import gc
import inspect
import threading

import numpy as np

import opgraph
from opgraph import aclnn
from opgraph.aclnn import twophase

from forked import in_forked_child

T = opgraph.tensor
X = np.float32([[1, 2], [3, 6]])  # N = 2, C = 2: mean [2, 4], biased var [1, 4]


def stats_outputs():
    return np.full(2, 7, np.float32), np.full(2, 7, np.float32)


def test_phase1_takes_its_parameters_by_name():
    """The signature phase 1 advertises names every parameter; a call by name is the call."""
    f = aclnn.aclnnBatchNormStatsGetWorkspaceSize
    assert list(inspect.signature(f).parameters) == ["input", "eps", "mean", "invstd"]
    mean, invstd = stats_outputs()
    st, ws, ex = f(T(X), 0.0, invstd=T(invstd), mean=T(mean))
    assert st == 0, aclnn.aclGetRecentErrMsg()
    assert aclnn.aclnnBatchNormStats(bytearray(ws) if ws else None, ws, ex) == 0
    assert mean.tolist() == [2.0, 4.0] and invstd.tolist() == [1.0, 0.5]


def test_phase1_names_a_bad_keyword_and_writes_nothing():
    f = aclnn.aclnnBatchNormStatsGetWorkspaceSize
    mean, invstd = stats_outputs()
    for kwargs, word in (({"mean": T(mean), "invstd": T(invstd), "bogus": 1}, "bogus"),
                         ({"invstd": T(invstd)}, "mean"),
                         ({"input": T(X), "mean": T(mean), "invstd": T(invstd)}, "input")):
        args = (T(X), 0.0) if "input" not in kwargs else (T(X),)
        st, ws, ex = f(*args, **kwargs)
        msg = aclnn.aclGetRecentErrMsg()
        assert (int(st), ws, ex) == (161002, 0, None)
        assert word in msg, msg
        assert mean.tolist() == [7.0, 7.0] and invstd.tolist() == [7.0, 7.0]


def test_a_single_use_executor_runs_once_when_two_threads_run_it(monkeypatch):
    """Phase 2 from two threads on one single-use executor: one run, one 'already ran' — the
    in-out running statistics are updated once. Thread A is held inside phase 2 after its
    checks (where it asks for the backend) while the main thread runs the same executor."""
    rm, rv = np.zeros(2, np.float32), np.ones(2, np.float32)
    mean_all, invstd_all = np.zeros(2, np.float32), np.zeros(2, np.float32)
    st, ws, ex = aclnn.aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize(
        T(np.zeros((4, 2), np.float32)), T(np.float32([[0, 1], [2, 3]])),
        T(np.ones((2, 2), np.float32)), T(rm), T(rv), 0.5, 0.0, T(np.float32([1, 3])),
        T(mean_all), T(invstd_all))
    assert st == 0, aclnn.aclGetRecentErrMsg()
    inside, go, calls, results = threading.Event(), threading.Event(), [], {}
    real = twophase.made

    def held_made(ref):
        calls.append(ref)
        if len(calls) == 1:  # thread A: wait until the main thread's call has returned
            inside.set()
            assert go.wait(120)
        return real(ref)

    monkeypatch.setattr(twophase, "made", held_made)
    def run():
        return aclnn.aclnnBatchNormGatherStatsWithCounts(bytearray(ws) if ws else None, ws, ex)

    a = threading.Thread(target=lambda: results.setdefault("a", run()))
    a.start()
    assert inside.wait(120)
    results["main"] = run()
    go.set()
    a.join()
    assert sorted(int(s) for s in results.values()) == [0, 161002]
    # meanAll = (1·[0, 1] + 3·[2, 3]) / 4 = [1.5, 2.5]; one update with momentum 0.5
    assert mean_all.tolist() == [1.5, 2.5]
    assert rm.tolist() == [0.75, 1.25]


def test_a_workspace_size_no_uint64_holds_is_refused_and_the_executor_kept():
    mean, invstd = stats_outputs()
    st, ws, ex = aclnn.aclnnBatchNormStatsGetWorkspaceSize(T(X), 0.0, T(mean), T(invstd))
    assert st == 0
    for size in (1 << 64, 1 << 70):
        assert int(aclnn.aclnnBatchNormStats(bytearray(ws), size, ex)) == 161002
        assert "workspaceSize" in aclnn.aclGetRecentErrMsg() and "uint64_t" in aclnn.aclGetRecentErrMsg()
        assert mean.tolist() == [7.0, 7.0]
    assert aclnn.aclnnBatchNormStats(bytearray(ws), (1 << 64) - 1, ex) == 0  # the largest uint64
    assert mean.tolist() == [2.0, 4.0]


def test_a_workspace_of_python_objects_is_refused_and_left_intact():
    """An object array exports a buffer of PyObject pointers: a run wrote the arena's floats
    over them and the process crashed when the array was freed (checked in a forked child).
    A datetime64 array exports no buffer at all (numpy raised ValueError)."""
    x = np.ones((4, 2, 8, 8), np.float32)

    def check() -> bool:
        ok = True
        for make in (lambda n: np.array([[i, "ref"] for i in range(n)], dtype=object)[:, 0].copy(),
                     lambda n: np.zeros(n, np.dtype([("a", "O"), ("b", "f8")])),
                     lambda n: np.zeros(n, "M8[s]")):
            mean, invstd = stats_outputs()
            with opgraph.opt_level(1):  # a program with a workspace
                st, ws, ex = aclnn.aclnnBatchNormStatsGetWorkspaceSize(T(x), 1e-5, T(mean), T(invstd))
            w = make(ws)
            before = w.copy()
            ok &= ws > 0 and int(aclnn.aclnnBatchNormStats(w, ws, ex)) == 161002
            ok &= "workspace" in aclnn.aclGetRecentErrMsg() and mean.tolist() == [7.0, 7.0]
            ok &= bool((w == before).all())
            ok &= aclnn.aclnnBatchNormStats(bytearray(ws), ws, ex) == 0 and mean.tolist() == [1.0, 1.0]
            del w, before
            gc.collect()
        return ok

    in_forked_child(check, "running phase 2 on a workspace of Python objects")


def test_a_workspace_sharing_memory_with_a_tensor_is_refused_and_nothing_written():
    """A workspace whose scratch bytes overlap the call's input or an output is 161002 naming
    that tensor, before anything runs (the run wrote its scratch over the tensor: wrong results,
    no error); the same call with a workspace of its own gives the formula's values."""
    x = np.float16([[1, 2], [3, 6], [5, 10]])  # per channel: mean 3, 6; biased var 8/3, 32/3
    with opgraph.opt_level(0):  # (level 0 keeps scratch: a workspace)
        for victim in ("input", "mean", "invstd"):
            arena = np.full(1 << 14, 7, np.uint8)
            at = {"input": 64, "mean": 256, "invstd": 512}
            placed = {k: np.frombuffer(arena, np.float16 if k == "input" else np.float32,
                                       x.size if k == "input" else 2, at[k]) for k in at}
            placed["input"][:] = x.reshape(-1)
            args = (T(placed["input"].reshape(3, 2)), 0.0, T(placed["mean"]), T(placed["invstd"]))
            st, ws, ex = aclnn.aclnnBatchNormStatsGetWorkspaceSize(*args)
            assert st == 0 and ws > 0, aclnn.aclGetRecentErrMsg()
            before = arena.copy()
            start = at[victim] - 8  # the scratch starts just before the tensor
            assert int(aclnn.aclnnBatchNormStats(arena[start:start + ws], ws, ex)) == 161002
            msg = aclnn.aclGetRecentErrMsg()
            assert f"workspace: shares memory with {victim}" in msg, msg
            assert np.array_equal(arena, before)
            st, ws, ex = aclnn.aclnnBatchNormStatsGetWorkspaceSize(*args)
            assert aclnn.aclnnBatchNormStats(arena[4096:4096 + ws], ws, ex) == 0
            assert placed["mean"].tolist() == [3.0, 6.0]
            want = 1 / np.sqrt(np.float64([8 / 3, 32 / 3]))
            assert np.allclose(placed["invstd"], want, rtol=1e-3)
