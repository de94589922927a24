"""Phase 1 and phase 2 as a Python caller may call them: arguments by name, and one executor
run from two threads."""
from __future__ import annotations

import inspect

import numpy as np

import opgraph
from opgraph import aclnn

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
