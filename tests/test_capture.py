"""opgraph.capture: a SyncBatchNorm training step (five op_api calls and two collectives, as
examples/capture_syncbn.py makes them) captured as one program and replayed, bit for bit against
the same calls run one by one — levels 0/1/2, numpy and native, fp32 and fp16, one rank and a
two-rank stand-in group — plus the program's structure, replay with new data, what is stored,
serialisation and every refusal. Across real gloo processes: tests/test_capture_torch.py."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

import opgraph
from backends import native
from l0ops.collectives import AllGather, AllReduce
from opgraph.aclnn.batch_norm_elemt import batch_norm_elemt
from opgraph.aclnn.batch_norm_stats import (aclnnBatchNormStats, aclnnBatchNormStatsGetWorkspaceSize,
                                            batch_norm_stats)
from opgraph.capture import CaptureError, all_gather, all_reduce, capture, check_schedule, on_replay
from opgraph.core.collective import register_group
from opgraph.core.dtypes import DataType as D
from opgraph.core.ir import Graph, TensorType
from opgraph.core.opdef import L0Error
from opgraph.core.memory import plan_memory
from threads import hammer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("capture_syncbn", ROOT / "examples" / "capture_syncbn.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

SHAPE = (4, 3, 5, 5)
BACKENDS = ["numpy", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason=native.availability()[1]))]


class Mirror:
    """A stand-in for two ranks holding the same data: gathering stacks two copies, reducing
    doubles (exact in binary floating point)."""

    world_size = 2

    def all_gather(self, arrays):
        return [np.stack([a, a]) for a in arrays]

    def all_reduce(self, arrays):
        return [a + a for a in arrays]


register_group("mirror2", Mirror())


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def assert_same(ref: dict, got: dict) -> None:
    for k in ref:
        assert ref[k].dtype == got[k].dtype and ref[k].shape == got[k].shape, k
        assert np.array_equal(bits(ref[k]), bits(got[k])), k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("dtype, group", [(np.float32, "local"), (np.float16, "local"),
                                          (np.float32, "mirror2")])
def test_replay_is_bit_identical_to_the_calls_one_by_one(backend, level, dtype, group):
    world = 2 if group == "mirror2" else 1
    with opgraph.use_backend(backend), opgraph.opt_level(level):
        ref = ex.step(SHAPE, dtype, group=group, world=world)
        with capture() as prog:
            got = ex.step(SHAPE, dtype, group=group, world=world)
        prog.replay()
    assert prog.level == level and prog.backend.name == backend
    assert_same(ref, got)


def test_nothing_runs_inside_the_capture():
    inputs = ex.make_inputs(SHAPE)
    rm = inputs["running_mean"].copy()
    with capture() as prog:
        out = ex.step_on(**inputs)
        out["grad_input"][...] = 7.0  # the program will overwrite it
    assert np.array_equal(inputs["running_mean"], rm)  # the in-place update is deferred
    prog.replay()
    assert not np.array_equal(inputs["running_mean"], rm)
    assert not (out["grad_input"] == 7.0).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_with_new_inputs(backend):
    first, second = ex.make_inputs(SHAPE, seed=1), ex.make_inputs(SHAPE, seed=2)
    with opgraph.use_backend(backend):
        ref = ex.step_on(**{k: v.copy() for k, v in second.items()})
        with capture() as prog:
            got = ex.step_on(**first)
        out = prog.replay(input=second["x"], gradOut=second["dy"], weight=second["weight"],
                          bias=second["bias"], runningMean=second["running_mean"],
                          runningVar=second["running_var"])
    assert_same({k: ref[k] for k in ("y", "grad_input", "grad_weight", "grad_bias")}, got)
    assert np.array_equal(bits(out["runningMean"]), bits(ref["running_mean"]))
    assert np.shares_memory(out["runningMean"], second["running_mean"])
    assert np.array_equal(bits(second["running_var"]), bits(ref["running_var"]))


def test_level2_program_structure():
    shape = (8, 4, 32, 32)
    with capture(2) as prog:
        ex.step(shape)
    ops = [n.op for n in prog.compiled.nodes]
    assert ops.count("AllGather") == 1 and ops.count("AllReduce") == 1
    assert ops.index("AllGather") < ops.index("AllReduce")
    s, one, l1 = prog.stats(), prog.stats_one_by_one(), prog.at_level(1).stats()
    assert s.collectives == one.collectives == 2
    assert s.launches <= one.launches < l1.launches
    x_bytes = 4 * int(np.prod(shape))
    # one by one: stats reads x; elemt x -> y; reduce-backward dy, x; elemt-backward dy, x -> dx
    assert one.bytes_moved >= 8 * x_bytes
    # captured: the backward sums share the statistics' pass (x, dy read once before the gather)
    assert 7 * x_bytes <= s.bytes_moved < 7 * x_bytes + x_bytes // 4
    # every fused reduction keeps its results per channel (what the native C pass renders)
    for n in prog.compiled.nodes:
        if n.op == "FusedReduce":
            assert max(v.type.numel for v in n.outputs) < int(np.prod(shape)), n.header()


def test_what_is_stored():
    with capture() as prog:
        ex.step(SHAPE)
    assert sorted(prog.outputs) == ["gradBias", "gradInput", "gradWeight", "output",
                                    "runningMean", "runningVar"]
    with capture(keep="all") as prog_all:
        got = ex.step(SHAPE)
        mean, invstd = batch_norm_stats(got["y"], 1e-5)  # reads the program's y
    prog_all.replay()
    assert {"mean", "invstd", "output"} <= set(prog_all.outputs)
    ref_y = ex.step(SHAPE)["y"]
    ref_mean, ref_invstd = batch_norm_stats(ref_y, 1e-5)
    assert np.array_equal(bits(mean), bits(ref_mean)) and np.array_equal(bits(invstd), bits(ref_invstd))


def test_graph_dumps_and_serialises():
    with capture() as prog:
        ex.step(SHAPE)
    for g in (prog.graph, prog.compiled):
        assert Graph.from_json(g.to_json()) == g
        assert "AllGather" in g.to_dot() and "AllReduce" in str(g)
    assert "group=local" in str(prog.graph)
    s = prog.stats()
    assert f"<Program of 5 op_api calls: level 2, {s.launches} launches + 2 collectives" in repr(prog)


def test_collectives_outside_a_capture_run_at_once():
    a, b = all_gather(np.float32([1, 2]), np.float32([3]))
    assert a.tolist() == [[1.0, 2.0]] and b.tolist() == [[3.0]]
    assert all_reduce(np.float32([4]), group="mirror2")[0].tolist() == [8.0]


def test_a_capture_object_entered_again_records_only_its_new_block():
    """The recorder was made once per capture object: a second block's program held the first
    block's calls and their replay effects too."""
    x = np.ones((2, 3, 4), np.float32)
    cap, effects = capture(), []
    for block in range(2):
        with cap as prog:
            batch_norm_stats(x, 1e-5)
            on_replay(lambda: effects.append(block))
        effects.clear()
        prog.replay()
        assert len(prog.calls) == 1 and effects == [block]


def test_a_0d_array_keeps_its_shape_in_a_collective_outside_a_capture_as_inside():
    s = np.float32(1.5)
    (g,), (r,) = all_gather(s, group="mirror2"), all_reduce(s, group="mirror2")
    assert (g.shape, g.tolist(), r.shape, r.tolist()) == ((2,), [1.5, 1.5], (), 3.0)
    with capture() as prog:
        all_gather(s, group="mirror2"), all_reduce(s, group="mirror2")
    out = prog.replay()
    assert [(v.shape, v.tolist()) for v in out.values()] == [((2,), [1.5, 1.5]), ((), 3.0)]


def test_replay_refuses_bad_inputs_and_leaves_outputs_untouched():
    with capture() as prog:
        got = ex.step(SHAPE)
    prog.replay()
    y = got["y"].copy()
    with pytest.raises(ValueError, match="replay: bogus: not an input of the program"):
        prog.replay(bogus=np.zeros(3))
    with pytest.raises(ValueError, match=r"replay: input: the program was captured with f32\[4,3,5,5\]"):
        prog.replay(input=np.zeros((2, 3, 5, 5), np.float32))
    for same_shape in (np.zeros((4, 3, 5, 10), np.float32)[..., ::2],  # other strides
                       np.zeros(SHAPE, np.float16)):                     # another dtype
        with pytest.raises(ValueError, match=r"replay: input: the program was captured with"):
            prog.replay(input=same_shape)
    with pytest.raises(ValueError, match="replay: output: storage is read-only"):
        ro = np.zeros(SHAPE, np.float32)
        ro.flags.writeable = False
        prog.replay(output=ro)
    for junk in ("abc", None):  # not arrays at all
        with pytest.raises(ValueError, match=f"replay: input: cannot be used as a tensor \\({type(junk).__name__}\\)"):
            prog.replay(input=junk)
    assert np.array_equal(got["y"], y)


def test_replay_refuses_rebound_tensors_that_share_memory_with_one_written():
    """The capture kept every written tensor apart from the other inputs; a replay's rebinding
    must too (else the compiled program's reads and writes meet in another order than the
    calls'): refused naming both, nothing written. Read-only inputs may share memory."""
    with capture() as prog:
        got = ex.step(SHAPE)
    prog.replay()
    before = {name: prog.inputs[name].numpy() for name in prog.outputs}
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    big = np.zeros((2, *SHAPE), np.float32)
    c = np.ones(3, np.float32)
    refused = [
        (dict(output=x, input=x), "output: shares memory with input"),        # an output over an input
        (dict(gradInput=prog.inputs["input"].view()), "gradInput: shares memory with input"),  # captured
        (dict(input=got["y"]), "input: shares memory with output"),           # an input over a captured output
        (dict(output=big[0], gradInput=big[0]), "output: shares memory with gradInput"),  # two outputs
        (dict(output=big.reshape(-1)[5:5 + x.size].reshape(SHAPE), gradInput=big[0]),
         "output: shares memory with gradInput"),                              # partly
        (dict(runningMean=c, runningVar=c), "runningMean: shares memory with runningVar"),
        (dict(runningMean=c, weight=c), "runningMean: shares memory with weight"),
    ]
    for rebind, message in refused:
        with pytest.raises(ValueError, match=f"replay: {message}; the program writes"):
            prog.replay(**rebind)
        for name in prog.outputs:
            assert np.array_equal(bits(prog.inputs[name].numpy()), bits(before[name])), name
    assert not big.any() and (c == 1).all() and not x.size == 0
    prog.replay(weight=c, bias=c)  # read-only inputs on one array: allowed
    y = prog.replay(input=x, output=big[0], gradInput=big[1])["output"]  # apart: allowed
    assert np.shares_memory(y, big[0]) and big[0].any()
    prog.replay(input=x, output=big[0], gradInput=big[1])  # the same tensors again: known apart
    t = opgraph.tensor(c)
    prog.replay(weight=t, bias=t)
    with pytest.raises(ValueError, match="replay: runningMean: shares memory with runningVar"):
        prog.replay(runningMean=t, runningVar=t)  # the same tensors under other names: checked


def test_program_is_built_at_the_end_of_the_block():
    with capture() as prog:
        with pytest.raises(CaptureError, match="the program is built when the capture block ends"):
            prog.stats()
        with pytest.raises(CaptureError, match="captures do not nest"):
            with capture():
                pass
        batch_norm_stats(np.ones((2, 3, 4), np.float32), 1e-5)
    assert prog.stats().launches == 1 and prog.outputs == ["mean", "invstd"]
    assert opgraph.capture is capture and not opgraph.capture.__module__.endswith("program")
    # built, it is an ordinary object: hasattr and getattr with a default work (a notebook's
    # display asks for _repr_html_), where every unknown name was "not built yet"
    assert not hasattr(prog, "_repr_html_") and getattr(prog, "nonexistent", 7) == 7
    with pytest.raises(AttributeError, match="no attribute 'replya'"):
        prog.replya()


def stats_into(x: np.ndarray, mean: np.ndarray, invstd: np.ndarray) -> None:
    """aclnnBatchNormStats with the given output views (both phases)."""
    st, ws, exe = aclnnBatchNormStatsGetWorkspaceSize(
        opgraph.tensor(x), 1e-5, opgraph.tensor(mean), opgraph.tensor(invstd))
    assert st == opgraph.Status.ACLNN_SUCCESS
    aclnnBatchNormStats(bytearray(ws) if ws else None, ws, exe)


def test_a_tensor_written_twice_is_refused():
    x = np.ones(SHAPE, np.float32)
    mean, invstd = np.empty(3, np.float32), np.empty(3, np.float32)
    with pytest.raises(CaptureError, match="call #1 aclnnBatchNormStats: mean was already "
                                           "written by call #0"):
        with capture():
            stats_into(x, mean, invstd)
            stats_into(x, mean, invstd)


def test_partial_overlap_and_write_after_read_are_refused():
    x = np.ones((2, 3, 4), np.float32)
    buf = np.empty(6, np.float32)
    with pytest.raises(CaptureError, match="call #1 aclnnBatchNormElemt: mean overlaps a tensor "
                                           "another call wrote without being the same view"):
        with capture():
            stats_into(x, buf[:3], buf[3:])
            batch_norm_elemt(x, None, None, buf[1:4], buf[3:], 1e-5)
    with pytest.raises(CaptureError, match="output was read by call #0 and is written now"):
        with capture():
            mean, invstd = batch_norm_stats(x, 1e-5)
            batch_norm_elemt(x.copy(), None, None, mean, invstd, 1e-5, out=x)


def test_an_executor_from_before_the_capture_runs_at_once():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    mean, invstd = np.zeros(3, np.float32), np.zeros(3, np.float32)
    st, ws, exe = aclnnBatchNormStatsGetWorkspaceSize(
        opgraph.tensor(x), 1e-5, opgraph.tensor(mean), opgraph.tensor(invstd))
    with capture():
        aclnnBatchNormStats(bytearray(ws) if ws else None, ws, exe)
    assert mean.tolist() == [7.5, 11.5, 15.5]


def test_check_schedule_catches_reordered_collectives_and_reads_after_writes():
    g = Graph("p")
    x = g.add_input("x", TensorType((3,), D.FLOAT))
    y = g.add_input("y", TensorType((3,), D.FLOAT))
    a = g.add_node("AllReduce", [x], group="local", seq=1).outputs[0]
    b = g.add_node("AllReduce", [a], group="local", seq=0).outputs[0]
    g.outputs = [g.add_node("ViewCopy", [b, y]).outputs[0]]
    with pytest.raises(CaptureError, match=r"reorders its collectives: \[1, 0\]"):
        check_schedule(g, plan_memory(g))
    g = Graph("q")
    x = g.add_input("x", TensorType((3,), D.FLOAT))
    w = g.add_node("ViewCopy", [g.add_node("Mul", [x, x]).outputs[0], x]).outputs[0]
    late = g.add_node("Add", [x, x]).outputs[0]
    g.outputs = [w, late]
    with pytest.raises(CaptureError, match=r"reads %x at node 2 after node 1 wrote it"):
        check_schedule(g, plan_memory(g))


def test_a_collective_result_nobody_reads_is_stored():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    with capture() as prog:
        mean, _ = batch_norm_stats(x, 1e-5)
        gathered, = all_gather(mean, group="mirror2")
    assert [n.op for n in prog.compiled.nodes if n.op.startswith("All")] == ["AllGather"]
    out = prog.replay()
    assert gathered.tolist() == [[7.5, 11.5, 15.5]] * 2
    assert any(np.shares_memory(a, gathered) for a in out.values())


def test_capture_arguments_and_platforms():
    with pytest.raises(ValueError, match="keep must be 'outputs' or 'all', got 'some'"):
        capture(keep="some")
    with pytest.raises(ValueError, match="opt level must be one of"):
        capture(level=4)
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(CaptureError, match="call #1 aclnnBatchNormStats runs on Ascend950, the "
                                           "capture on Ascend910B"):
        with capture():
            batch_norm_stats(x, 1e-5)
            with opgraph.platform("Ascend950"):
                batch_norm_stats(x, 1e-5)


class Broken:
    """A group that answers with the wrong arrays: one too few, or float64 / the wrong shape."""

    world_size = 2

    def __init__(self, how: str):
        self.how = how

    def _bad(self, arrays, shape):
        if self.how == "count":
            return [np.zeros(shape(a), a.dtype) for a in arrays[1:]]
        if self.how == "dtype":
            return [np.zeros(shape(a), np.float64) for a in arrays]
        return [np.zeros(shape(a) + (1,), a.dtype) for a in arrays]

    def all_gather(self, arrays):
        return self._bad(arrays, lambda a: (2,) + a.shape)

    def all_reduce(self, arrays):
        return self._bad(arrays, lambda a: a.shape)


@pytest.mark.parametrize("how, says", [("count", "returned 1 arrays for 2"),
                                       ("dtype", "returned float64[2, 3], expected float32[2, 3]"),
                                       ("shape", "returned float32[2, 3, 1], expected float32[2, 3]")])
def test_a_group_answering_with_the_wrong_arrays_is_named(how, says):
    register_group(f"broken-{how}", Broken(how))
    xs = [np.ones(3, np.float32), np.ones(3, np.float32)]
    with pytest.raises(L0Error, match=f"AllGather: the group {re.escape(says)}"):
        AllGather.compute(xs, AllGather.make_attrs(group=f"broken-{how}", world=2))
    ys = [np.ones((2, 3), np.float32)] * 2
    with pytest.raises(L0Error, match=f"AllReduce: the group {re.escape(says)}"):
        AllReduce.compute(ys, AllReduce.make_attrs(group=f"broken-{how}"))
    with pytest.raises(L0Error, match="AllGather: group 'mirror2' has 2 ranks, the graph was captured with 3"):
        AllGather.compute(xs, AllGather.make_attrs(group="mirror2", world=3))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", [0, 2])
def test_replays_racing_in_threads_each_get_their_own_results(backend, level):
    """Each replay ran in the program's one workspace: two threads replaying at once overwrote
    each other's intermediates (wrong outputs, every run on 2 cores). A replay that finds it
    taken runs in a workspace of its own."""
    shape = (16, 8, 64)
    with capture(level) as prog:
        mean, invstd = batch_norm_stats(np.ones(shape, np.float32), 1e-5)
        batch_norm_elemt(np.ones(shape, np.float32), None, None, mean, invstd, 1e-5)
    assert prog.workspace_size
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(shape).astype(np.float32) * (k + 1) + k for k in range(4)]

    def replay(k):
        out = np.empty(shape, np.float32)
        prog.replay(backend, input=xs[k], output=out)
        return out
    wants = [replay(k) for k in range(len(xs))]
    got, errors = hammer(replay, wants, np.array_equal, rounds=60)
    assert errors == [] and len(got) == len(xs)
