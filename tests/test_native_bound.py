"""The native backend's bound runs (backends/native/bound.py): a captured program replayed, or a
repeatable executor run, again and again on tensors of the same layouts (the same ones or new
ones) binds its steps to them from the second such run on, and once bound rebinds other
tensors of the same layouts. Every run here changes the data first, and every result is
checked bit for bit — against the numpy backend on the same program and state (captured
programs), or against the independent reference (repeatable executors) — with the bound path
shown to run (or not, where it must not)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import opgraph
from backends import native
from backends.native import bound as bound_module
from opgraph import aclnn
from opgraph.core.backend import get as get_backend
from l0ops.define import define_op
from opgraph.core.dtypes import DataType
from opgraph.core.ir import Graph, TensorType
from opgraph.core.opapi import InputConfig, get_op_api
from opgraph.core.memory import plan_memory
from opgraph.core.platform import get_platform, platform as use_platform

from reference import F16, F32, assert_bits_equal, make_case, to_tensors

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("capture_syncbn", ROOT / "examples" / "capture_syncbn.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

BF16 = DataType.BF16.np
# (level, dtype, platform, shape): level 0 has free views and arena slots; 4x8x12x13 puts the
# reductions on the C passes, 2x3x2x2 on the serial C call
CASES = [(level, np.float32, None, shape) for level in (0, 1, 2)
         for shape in ((2, 3, 2, 2), (4, 8, 12, 13))] + [
    (2, np.float16, None, (4, 8, 12, 13)), (0, np.float16, "Ascend950", (2, 3, 2, 2)),
    (2, BF16, "Ascend950", (4, 8, 12, 13)), (1, BF16, "Ascend950", (2, 3, 2, 2))]
IDS = [f"L{c[0]}-{np.dtype(c[1]).name}-{c[2] or 'default'}-{'x'.join(map(str, c[3]))}" for c in CASES]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.fixture
def bound_runs(monkeypatch):
    """Counts the bound runs that ran (returned results)."""
    count = {"runs": 0}
    run = bound_module.Bound.run

    def counted(self):
        out = run(self)
        count["runs"] += out is not None
        return out
    monkeypatch.setattr(bound_module.Bound, "run", counted)
    return count


def captured(level: int, dtype, platform, shape, seed: int = 0):
    inputs = ex.make_inputs(shape, dtype, seed)
    with use_platform(platform or "Ascend910B"), opgraph.capture(level) as prog:
        ex.step_on(**inputs)
    return prog, inputs


def state(prog) -> dict:
    return {name: t.view().copy() for name, t in prog.inputs.items()}


def restore(prog, saved: dict) -> None:
    for name, t in prog.inputs.items():
        np.copyto(t.view(), saved[name])


def replay_both(prog, **new) -> None:
    """Replay on native, then from the same state on numpy; every written tensor bit-equal."""
    before = state(prog)
    got = {k: v.copy() for k, v in prog.replay(backend="native", **new).items()}
    after = state(prog)
    restore(prog, before)
    want = prog.replay(backend="numpy", **new)
    for name in want:
        assert np.array_equal(bits(got[name]), bits(want[name])), name
    for name in after:  # nothing else written differently (running statistics included)
        assert np.array_equal(bits(after[name]), bits(prog.inputs[name].view())), name


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_replays_on_the_same_tensors_bind_and_stay_bit_exact(case, bound_runs):
    level, dtype, platform, shape = case
    prog, inputs = captured(level, dtype, platform, shape)
    rng = np.random.default_rng(1)
    for _ in range(5):  # new data in the captured tensors before every replay
        inputs["x"][...] = (rng.standard_normal(shape) * 3 - 1).astype(dtype)
        inputs["dy"][...] = rng.standard_normal(shape).astype(dtype)
        replay_both(prog)
    exe = prog.executable(get_backend("native"))
    assert exe.bound is not None
    assert bound_runs["runs"] == 3  # the first two replays run node by node, then bound


def test_rebinding_other_objects_rebinds_the_nodes_that_touch_them(bound_runs):
    prog, inputs = captured(2, np.float32, None, (4, 8, 12, 13))
    rng = np.random.default_rng(2)
    shape = (4, 8, 12, 13)
    a, b = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    # a new object every replay, as a training step's input: the first replay runs node by
    # node, the second too and binds (the layouts repeat), the later ones rebind and run bound
    for x in (a, b, a, b):
        replay_both(prog, input=x)
    assert bound_runs["runs"] == 2
    for _ in range(3):  # the same object again and again: bound every time
        a[...] = rng.standard_normal(shape).astype(np.float32)
        replay_both(prog, input=a)
    assert bound_runs["runs"] == 2 + 3
    # now other objects of the same layout, inputs and outputs: rebound and run bound every time
    y1, y2 = np.empty(shape, np.float32), np.empty(shape, np.float32)
    g1, g2 = np.empty(shape, np.float32), np.empty(shape, np.float32)
    for x, dy, y, gx in ((b, inputs["dy"], y1, g1), (a, inputs["dy"].copy(), y2, g2),
                         (b, inputs["dy"], y2, g1), (a, inputs["dy"], y1, g2)):
        x[...] = rng.standard_normal(shape).astype(np.float32)
        replay_both(prog, input=x, gradOut=dy, output=y, gradInput=gx)
    assert bound_runs["runs"] == 5 + 4
    # only a result placed in a user tensor changes (the reduction writes gradWeight there)
    w1, w2 = np.empty(8, np.float32), np.empty(8, np.float32)
    for gw in (w1, w2, w1):
        a[...] = rng.standard_normal(shape).astype(np.float32)
        replay_both(prog, input=a, gradWeight=gw)
    assert bound_runs["runs"] == 5 + 4 + 3


def test_fresh_tensors_every_replay_bind_from_the_second(bound_runs):
    """A new array every replay (what a training loop hands a captured step), inputs and
    outputs: bound from the second replay on, every result bit-equal to numpy's."""
    shape = (4, 8, 12, 13)
    prog, _ = captured(2, np.float32, None, shape)
    rng = np.random.default_rng(5)
    for _ in range(5):
        replay_both(prog, input=(rng.standard_normal(shape) * 2).astype(np.float32),
                    output=np.empty(shape, np.float32), gradInput=np.empty(shape, np.float32))
    assert bound_runs["runs"] == 3


def test_a_rebound_array_whose_layout_changed_in_place_is_viewed_again(bound_runs):
    prog, inputs = captured(2, np.float32, None, (4, 8, 12, 13))
    x = np.random.default_rng(3).standard_normal((4, 8, 12, 13)).astype(np.float32)
    for _ in range(3):
        replay_both(prog, input=x)
    assert bound_runs["runs"] == 1
    x.shape = (8, 4, 12, 13)  # the same object, another type: refused, not run on the old view
    with pytest.raises(ValueError, match="captured with"):
        prog.replay(backend="native", input=x)


def test_busy_bound_steps_fall_back_to_the_node_by_node_path(bound_runs):
    prog, inputs = captured(0, np.float32, None, (4, 8, 12, 13))
    for _ in range(3):
        replay_both(prog)
    exe = prog.executable(get_backend("native"))
    runs = bound_runs["runs"]
    with exe.bound.lock:  # another thread is running the bound steps
        inputs["x"][...] += 1
        replay_both(prog)
    assert bound_runs["runs"] == runs


@pytest.mark.parametrize("level", [0, 2])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_repeatable_executor_binds_to_its_tensors_and_workspace(level, dtype, bound_runs):
    case = make_case((4, 8, 12, 13), dtype, seed=5)
    out = np.zeros(case.input.shape, case.out_dtype)
    ts = to_tensors(case)
    with opgraph.opt_level(level):
        st, ws, exe = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*ts, opgraph.tensor(out))
    assert st == 0, aclnn.aclGetRecentErrMsg()
    assert aclnn.aclSetAclOpExecutorRepeatable(exe) == 0
    workspace = bytearray(ws)
    with opgraph.use_backend("native"):
        for seed in range(6, 10):  # new data in the bound tensors before every run
            new = make_case((4, 8, 12, 13), dtype, seed=seed)
            ts[0].storage[...] = new.gradOut.ravel()
            ts[1].storage[...] = new.input.ravel()
            out[...] = 0
            assert aclnn.aclnnBatchNormElemtBackward(workspace, ws, exe) == 0
            assert_bits_equal(out, case.with_(gradOut=new.gradOut, input=new.input).expected())
        # a rebound input: the nodes that read it are bound anew, and every run runs bound
        other = make_case((4, 8, 12, 13), dtype, seed=11).input.copy()
        assert aclnn.aclSetInputTensorAddr(exe, 1, opgraph.tensor(other)) == 0
        for _ in range(3):
            out[...] = 0
            assert aclnn.aclnnBatchNormElemtBackward(workspace, ws, exe) == 0
            assert_bits_equal(out, case.with_(gradOut=new.gradOut, input=other).expected())
    assert bound_runs["runs"] == 2 + 3  # runs 3 and 4 of the first tensors, all of the new
    built = exe.program.built_executable(get_backend("native"))
    assert built.bound is not None
    assert aclnn.aclDestroyAclOpExecutor(exe) == 0
    assert built.bound is None and built.last_key is None  # its tensors are not held on


# a free op (no kernel) whose numpy semantics copy: l0 ops may be registered by plugins
CopyingView = define_op("TestBoundCopyingView", infer=lambda ts, a: [ts[0].with_()],
                        compute=lambda xs, a: [np.array(xs[0])], kind="view", num_inputs=1,
                        free=lambda node: True, doc="A free op that copies (tests only).")


def test_a_free_node_that_copies_runs_every_time(bound_runs):
    """Bound, a free node whose result is not a view of its operands must still run every
    time, or the copy of the first run's data would be read."""
    g = Graph("copying_free_node")
    x = g.add_input("x", TensorType((8,), DataType.FLOAT))
    out = g.add_input("out", TensorType((8,), DataType.FLOAT))
    s = g.add_node("TestBoundCopyingView", [x]).outputs[0]
    m = g.add_node("Mul", [s, x]).outputs[0]
    g.outputs = [g.add_node("ViewCopy", [m, out]).outputs[0]]
    plan = plan_memory(g)
    exe = get_backend("native").compile(g, plan, get_platform())
    xs, o = np.zeros(8, np.float32), np.zeros(8, np.float32)
    bindings = {"x": opgraph.tensor(xs), "out": opgraph.tensor(o)}
    workspace = bytearray(plan.size) if plan.size else None
    for k in range(4):
        xs[...] = np.arange(8, dtype=np.float32) + k
        exe.run_repeatable(bindings, workspace)
        assert np.array_equal(o, xs * xs), k
    assert bound_runs["runs"] == 2


def test_thresholds_changed_after_binding_are_honoured_on_rebinding(bound_runs, monkeypatch):
    """A reduction bound on the C passes, rebound after ``min_elements`` moved it to the serial
    call (and a kernel after ``min_fused_elements`` moved it to numpy): the same bits."""
    prog, inputs = captured(2, np.float32, None, (4, 8, 12, 13))
    rng = np.random.default_rng(4)
    for _ in range(3):
        replay_both(prog)
    be = get_backend("native")
    monkeypatch.setattr(be, "min_elements", 10 ** 9)
    monkeypatch.setattr(be, "min_fused_elements", 10 ** 9)
    for _ in range(2):
        x = rng.standard_normal(inputs["x"].shape).astype(np.float32)
        replay_both(prog, input=x)
    assert bound_runs["runs"] == 1 + 2


@pytest.mark.parametrize("api", ["aclnnBatchNormReduce", "aclnnBatchNormGatherStatsWithCounts"])
def test_a_repeatable_level_0_call_over_zero_channels_runs_again_without_a_workspace(api):
    """Zero channels at level 0: the empty intermediates take no workspace, so phase 1 asks for
    none; the repeated run binds its steps with holders of their own for them (it read a
    zero-size arena slot out of the missing workspace: TypeError, 361001 on the second run)."""
    spec = get_op_api(api)
    cfg = InputConfig((2, 0, 3, 3), DataType.FLOAT, {o.name: o.default for o in spec.options})
    arrays = spec.make_inputs(cfg, np.random.default_rng(0))
    with opgraph.opt_level(0), opgraph.use_backend("native"):
        st, ws, exe = spec.get_workspace_size(*spec.args_of(arrays, opgraph.tensor, cfg))
        assert (st, ws) == (0, 0)
        aclnn.aclSetAclOpExecutorRepeatable(exe)
        assert [int(spec.run(None, 0, exe)) for _ in range(3)] == [0, 0, 0], aclnn.aclGetRecentErrMsg()
