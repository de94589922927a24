"""Phase 2 rules (reference §1.1, §3.3): NULL executor, single use, repeatable executors,
destroy, workspace checks, untouched outputs on rejection; the backend registry and the
run-time choices (use_backend / opt_level)."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

import backends
import opgraph
from opgraph.core import backend as backend_registry
from opgraph.core.backend import Backend, BackendUnavailable, Executable
from backends.numpy_backend import NumpyBackend
from opgraph import aclnn

from reference import F16, F32, NAMES, assert_bits_equal, make_case, to_tensors

run = aclnn.aclnnBatchNormElemtBackward
SENTINEL = np.float32(-123.25)


def phase1(case, out=None, level=0):
    """Phase 1 at ``level`` (0 by default: the recorded graph needs a workspace)."""
    out = np.full(case.input.shape, SENTINEL, case.out_dtype) if out is None else out
    ts = to_tensors(case)
    with opgraph.opt_level(level):
        st, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*ts, opgraph.tensor(out))
    assert st == 0, aclnn.aclGetRecentErrMsg()
    return ws, ex, out, ts


@pytest.fixture
def case():
    return make_case((2, 3, 4), F32, seed=42)


def test_phase1_reports_a_workspace_and_phase2_runs(case):
    ws, ex, out, _ = phase1(case)
    assert ws > 0 and ex.workspace_size == ws
    assert (out == SENTINEL).all()  # phase 1 never writes the output
    assert run(bytearray(ws), ws, ex, None) == 0
    assert_bits_equal(out, case.expected())


def test_none_executor_is_161001():
    assert run(None, 0, None) == 161001
    assert "executor" in aclnn.aclGetRecentErrMsg()


def test_foreign_executor_object_is_rejected():
    st = run(None, 0, object())
    assert st != 0 and "executor" in aclnn.aclGetRecentErrMsg()


def test_second_run_is_rejected_and_leaves_output_untouched(case):
    ws, ex, out, _ = phase1(case)
    assert run(bytearray(ws), ws, ex) == 0
    out[...] = SENTINEL
    st = run(bytearray(ws), ws, ex)
    assert st != 0
    msg = aclnn.aclGetRecentErrMsg()
    assert "executor" in msg and "Repeatable" in msg
    assert (out == SENTINEL).all()


def test_repeatable_executor_runs_many_times_on_current_data(case):
    ws, ex, out, ts = phase1(case)
    assert aclnn.aclSetAclOpExecutorRepeatable(ex) == 0
    assert run(bytearray(ws), ws, ex) == 0
    assert_bits_equal(out, case.expected())
    # change the caller's input memory in place: the next run sees the new values
    new = make_case((2, 3, 4), F32, seed=43)
    ts[0].storage[...] = new.gradOut.ravel()
    ts[1].storage[...] = new.input.ravel()
    out[...] = SENTINEL
    assert run(bytearray(ws), ws, ex) == 0
    want = case.with_(gradOut=new.gradOut, input=new.input).expected()
    assert_bits_equal(out, want)
    assert run(bytearray(ws), ws, ex) == 0
    assert aclnn.aclDestroyAclOpExecutor(ex) == 0


def test_destroyed_executor_is_rejected(case):
    ws, ex, out, _ = phase1(case)
    assert aclnn.aclSetAclOpExecutorRepeatable(ex) == 0
    assert aclnn.aclDestroyAclOpExecutor(ex) == 0
    assert run(bytearray(ws), ws, ex) != 0
    assert "destroy" in aclnn.aclGetRecentErrMsg().lower()
    assert (out == SENTINEL).all()


def test_repeatable_must_be_set_before_running(case):
    ws, ex, _, _ = phase1(case)
    assert run(bytearray(ws), ws, ex) == 0
    assert aclnn.aclSetAclOpExecutorRepeatable(ex) != 0
    assert aclnn.aclSetAclOpExecutorRepeatable(None) != 0
    assert aclnn.aclDestroyAclOpExecutor(None) != 0


def test_null_workspace_with_positive_size_is_rejected(case):
    ws, ex, out, _ = phase1(case)
    assert ws > 0
    assert run(None, ws, ex) != 0
    assert "workspace" in aclnn.aclGetRecentErrMsg()
    assert (out == SENTINEL).all()
    # the rejected call did not consume the executor
    assert run(bytearray(ws), ws, ex) == 0
    assert_bits_equal(out, case.expected())


@pytest.mark.parametrize("how", ["small-buffer", "small-size", "zero", "read-only", "not-a-buffer",
                                 "strided", "stride-0"])
def test_bad_workspace_is_rejected(case, how):
    ws, ex, out, _ = phase1(case)
    args = {
        "small-buffer": (bytearray(ws - 1), ws),
        "small-size": (bytearray(ws), ws - 1),
        "zero": (bytearray(ws), 0),
        "read-only": (bytes(ws), ws),
        "not-a-buffer": (12345, ws),
        "strided": (np.zeros(2 * ws, np.uint8)[::2], ws),
        "stride-0": (np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (ws,), (0,)), ws),
    }[how]
    assert run(*args, ex) == 161002
    msg = aclnn.aclGetRecentErrMsg()
    assert "workspace" in msg.lower(), msg
    assert (out == SENTINEL).all()
    # the rejected call did not consume the executor
    assert run(bytearray(ws), ws, ex) == 0
    assert_bits_equal(out, case.expected())


def test_larger_workspace_is_fine(case):
    ws, ex, out, _ = phase1(case)
    assert run(bytearray(ws + 4096), ws + 4096, ex) == 0
    assert_bits_equal(out, case.expected())


@pytest.mark.parametrize("lvl", [0, 1, 2])
def test_phase2_runs_the_compiled_graph_at_each_level(case, lvl):
    ws, ex, out, _ = phase1(case, level=lvl)
    assert ex.opt_level == lvl and ex.compiled is not None
    assert [n.op for n in ex.graph.nodes].count("BroadcastTo") == 5  # graph stays as recorded
    ex.compiled.verify()
    assert run(bytearray(ws) if ws else None, ws, ex) == 0
    assert_bits_equal(out, case.expected())


def test_success_clears_the_recent_error(case):
    run(None, 0, None)
    assert aclnn.aclGetRecentErrMsg() != ""
    ws, ex, _, _ = phase1(case)
    assert run(bytearray(ws), ws, ex) == 0
    assert aclnn.aclGetRecentErrMsg() == ""


# --------------------------------------------------------------------------------------------
# rebinding tensors on a repeatable executor (aclSetInputTensorAddr / aclSetOutputTensorAddr)
# --------------------------------------------------------------------------------------------
def test_rebinding_input_and_output_tensors(case):
    ws, ex, out, ts = phase1(case)
    assert aclnn.aclSetAclOpExecutorRepeatable(ex) == 0
    assert run(bytearray(ws), ws, ex) == 0
    new = make_case((2, 3, 4), F32, seed=44)
    assert aclnn.aclSetInputTensorAddr(ex, 1, opgraph.tensor(new.input.copy())) == 0  # input
    out2 = np.full((2, 3, 4), SENTINEL, F32)
    assert aclnn.aclSetOutputTensorAddr(ex, 0, opgraph.tensor(out2)) == 0
    out[...] = SENTINEL
    assert run(bytearray(ws), ws, ex) == 0
    assert (out == SENTINEL).all()
    assert_bits_equal(out2, case.with_(input=new.input).expected())


def test_rebinding_errors(case):
    ws, ex, _, _ = phase1(case)
    good = opgraph.tensor(np.zeros((2, 3, 4), F32))
    assert aclnn.aclSetInputTensorAddr(ex, len(NAMES), good) == 161002
    assert aclnn.aclSetInputTensorAddr(ex, 0, opgraph.tensor(np.zeros((2, 3, 5), F32))) == 161002
    assert aclnn.aclSetInputTensorAddr(ex, 0, opgraph.tensor(np.zeros((2, 3, 4), F16))) == 161002
    assert aclnn.aclSetOutputTensorAddr(ex, 1, good) == 161002
    assert aclnn.aclSetInputTensorAddr(None, 0, good) == 561103
    assert aclnn.aclSetInputTensorAddr(ex, 0, None) == 561103


# --------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------
def test_numpy_backend_is_registered_and_default():
    b = backends.get("numpy")
    assert isinstance(b, NumpyBackend) and b.name == "numpy"
    assert "numpy" in backends.available() and backends.status()["numpy"] == "ok"
    assert opgraph.get_backend_name() == "numpy"


def test_unknown_backend_is_one_clear_line():
    with pytest.raises(BackendUnavailable) as e:
        backends.get("no-such-backend")
    msg = str(e.value)
    assert "\n" not in msg and "no-such-backend" in msg and "numpy" in msg
    with pytest.raises(BackendUnavailable):
        with opgraph.use_backend("no-such-backend"):
            pass
    with pytest.raises(BackendUnavailable):
        opgraph.set_backend("no-such-backend")
    assert opgraph.get_backend_name() == "numpy"


class Recording(Backend):
    """Delegates to numpy and remembers what it compiled and ran."""

    def __init__(self):
        self.compiled, self.runs = [], []

    def compile(self, graph, memory_plan, platform):
        self.compiled.append((graph, memory_plan, platform))
        inner = NumpyBackend().compile(graph, memory_plan, platform)
        runs = self.runs

        class Run(Executable):
            def run(self, bindings, workspace=None):
                runs.append((graph, dict(bindings), workspace))
                return inner.run(bindings, workspace)
        return Run()


class Broken(Backend):
    def availability(self):
        return False, "the device driver is missing"

    def compile(self, graph, memory_plan, platform):  # pragma: no cover - never reached
        raise AssertionError("an unavailable backend must not compile")


def test_custom_backend_receives_phase2(case):
    name = f"rec-{uuid.uuid4().hex[:8]}"
    rec = Recording()
    backends.register(name, rec)
    assert name in backends.names() and name in backends.available()
    ws, ex, out, _ = phase1(case)
    with opgraph.use_backend(name) as used:
        assert used == name and opgraph.get_backend_name() == name
        assert run(bytearray(ws), ws, ex) == 0
    assert opgraph.get_backend_name() == "numpy"
    assert len(rec.runs) == 1 and len(rec.compiled) == 1
    graph, bindings, workspace = rec.runs[0]
    assert graph is ex.compiled and rec.compiled[0][1] is ex.memory_plan
    assert set(bindings) == {v.name for v in ex.graph.inputs}
    assert workspace is None if ws == 0 else len(workspace) == ws
    assert_bits_equal(out, case.expected())
    # a second call with the same metadata reuses the compiled program: no new compile
    ws2, ex2, out2, _ = phase1(case)
    with opgraph.use_backend(name):
        assert run(bytearray(ws2), ws2, ex2) == 0
    assert len(rec.runs) == 2 and len(rec.compiled) == 1
    assert_bits_equal(out2, case.expected())
    with pytest.raises(ValueError, match="already registered"):
        backends.register(name, Recording())


def test_backend_registered_as_factory_is_built_lazily():
    name = f"lazy-{uuid.uuid4().hex[:8]}"
    built = []

    def factory():
        built.append(1)
        return Recording()

    backends.register(name, factory)
    assert built == []
    assert isinstance(backends.get(name), Recording) and backends.get(name) is backends.get(name)
    assert built == [1]


def test_unavailable_backend_is_reported(case):
    name = f"broken-{uuid.uuid4().hex[:8]}"
    backends.register(name, Broken)
    assert name not in backends.available()
    assert "driver is missing" in backends.status()[name]
    with pytest.raises(BackendUnavailable, match="driver is missing"):
        with opgraph.use_backend(name):
            pass


def test_set_backend_routes_phase2(case):
    name = f"rec-{uuid.uuid4().hex[:8]}"
    rec = Recording()
    backends.register(name, rec)
    opgraph.set_backend(name)
    assert opgraph.get_backend_name() == name
    ws, ex, out, _ = phase1(case)
    assert run(bytearray(ws), ws, ex) == 0
    assert len(rec.runs) == 1
    opgraph.set_backend("numpy")


def test_opt_level_context_and_validation():
    assert opgraph.get_opt_level() == 2  # the default once passes exist
    with opgraph.opt_level(0):
        assert opgraph.get_opt_level() == 0
        with opgraph.opt_level(1):
            assert opgraph.get_opt_level() == 1
        assert opgraph.get_opt_level() == 0
    assert opgraph.get_opt_level() == 2
    for bad in (3, -1, "2"):
        with pytest.raises(ValueError):
            with opgraph.opt_level(bad):
                pass
        with pytest.raises(ValueError):
            opgraph.set_opt_level(bad)


def test_backend_and_platform_contexts_nest_restore_and_decorate():
    @opgraph.use_backend("numpy")
    @opgraph.platform("Ascend950")
    def where(depth: int) -> list:  # each decorated call enters its own context, recursion too
        here = [(opgraph.get_backend_name(), opgraph.get_platform().soc)]
        with opgraph.platform("Ascend910"):
            here.append(opgraph.get_platform().soc)
        return here + (where(depth - 1) if depth else [])

    before = (opgraph.get_backend_name(), opgraph.get_platform().soc)
    with opgraph.platform("Ascend910_93") as p:
        assert p.soc == "Ascend910_93"
        assert where(2) == [("numpy", "Ascend950"), "Ascend910"] * 3
        assert opgraph.get_platform().soc == "Ascend910_93"
    with pytest.raises(opgraph.BackendUnavailable, match="unknown backend 'nope'"):
        with opgraph.use_backend("nope"):
            pass
    with pytest.raises(RuntimeError):
        with opgraph.use_backend(backend_registry.get("numpy")) as b:
            assert b.name == opgraph.get_backend_name() == "numpy"
            raise RuntimeError("boom")
    assert (opgraph.get_backend_name(), opgraph.get_platform().soc) == before


def test_executor_repr_and_bindings(case):
    ws, ex, out, ts = phase1(case)
    assert ex.bindings["gradOut"] is ts[0] and ex.bindings["counter"] is ts[7]
    assert "aclnnBatchNormElemtBackward" in repr(ex) and "Ascend910B" in repr(ex)
    assert ex.name == "aclnnBatchNormElemtBackward"
