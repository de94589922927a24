"""Which path a native program takes (direct launches, direct reduction, node by node) for
graphs at the edge of each direct path's conditions, found unpinned by a mutation audit of
backends/native: every program runs, with the numpy backend's bits."""
from __future__ import annotations

import numpy as np
import pytest

from backends import native
from backends.native.launch import launch_for, run_fused_native
from backends.native.reduce import plan_for
from backends.native.reduce_run import run_fused_reduce_native
from backends.native.small import run_small_reduce_native
from l0ops.fused_reduce import FusedReduce, FusedReduceAttrs, Instr
from l0ops.interpreter import run_fused
from l0ops.primitives import FusedAttrs
from l0ops.syncbn import SyncBatchNormGatherStatsFused as G
from native_limits import reduce_limits_at
import opgraph
from opgraph.core.backend import get
from opgraph.core.ir import Graph, TensorType
from opgraph.core.memory import plan_memory
from opgraph.core.platform import get_platform
from test_mutants_native import _cast_mul, _reduce_program, _run_program, F, same_bits

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])


def _run_graph(backend: str, g: Graph, arrays: dict, runs: int = 3):
    """Per run, the graph outputs (copies) and the bound arrays (new copies of ``arrays``)."""
    plan = plan_memory(g)
    exe = get(backend).compile(g, plan, get_platform())
    seen = []
    for _ in range(runs):
        bound = {n: np.array(a) for n, a in arrays.items()}
        out = exe.run({n: opgraph.tensor(a) for n, a in bound.items()}, bytearray(plan.size))
        seen.append(([np.array(out[v.name]) for v in g.outputs], bound))
    return seen, exe


def _same_runs(g: Graph, arrays: dict):
    """Run ``g`` on native and numpy; assert every output and bound array has the same bits;
    the native executable."""
    got, exe = _run_graph("native", g, arrays)
    want, _ = _run_graph("numpy", g, arrays)
    for (go, gb), (wo, wb) in zip(got, want):
        assert all(same_bits(a, b) for a, b in zip(go, wo))
        assert all(same_bits(gb[n], wb[n]) for n in arrays)
    return exe


def test_reduce_with_a_result_left_in_the_workspace_runs_node_by_node():
    """A FusedReduce of two results of which only one is copied into a caller's tensor (the
    other lies in the workspace) is not a direct reduction: node by node, the same bits."""
    body = (Instr(op="mul", args=("in0", "in0"), dtype=F),
            Instr(op="sum", args=("t0",), dtype=F, shape=(1, 3, 1)),
            Instr(op="sqrt", args=("t1",), dtype=F))
    a = FusedReduceAttrs(body=body, results=("t2", "t1"), out_shapes=((3,), (3,)))
    x = np.float32(np.arange(24).reshape(2, 3, 4) / 3)
    g, plan = _reduce_program(a, x.shape, 1)
    got, exe = _run_program("native", g, plan, x, runs=3)
    want, _ = _run_program("numpy", g, plan, x)
    assert exe.reduce is None and exe.direct_reduce is None
    assert same_bits(got[0], want[0]) and got[0].tolist() == np.sqrt((x.astype(np.float64) ** 2).sum((0, 2))).astype(np.float32).tolist()


def _mul(shape=(6, 40)):
    return FusedAttrs(shape=shape, body=(Instr(op="mul", args=("in0", "in1"), dtype=F),),
                      result="t0", out_dtype=F)


def _inputs():
    x = np.float32(np.arange(240).reshape(6, 40) / 7 - 11)
    return {"x": x, "w": np.float32(np.arange(40).reshape(1, 40) / 5 - 3)}


def _chain_graph():
    """x * w into the workspace, then that + x redirected into the caller's ``o``."""
    g = Graph("chain")
    x, w = g.add_input("x", TensorType((6, 40), F)), g.add_input("w", TensorType((1, 40), F))
    o = g.add_input("o", TensorType((6, 40), F))
    k1 = g.add_node("FusedElementwise", [x, w], _mul())
    add = FusedAttrs(shape=(6, 40), body=(Instr(op="add", args=("in0", "in1"), dtype=F),),
                     result="t0", out_dtype=F)
    k2 = g.add_node("FusedElementwise", [k1.outputs[0], x], add)
    g.outputs = [g.add_node("ViewCopy", [k2.outputs[0], o], redirect=True).outputs[0]]
    return g, k1.outputs[0].name


def test_kernel_chain_through_the_workspace_runs_node_by_node():
    """Two kernels, the first's result in the workspace (no caller's tensor) read by the second,
    which writes into the caller's output: not direct launches (they take bound tensors only),
    node by node with the reference's bits."""
    exe = _same_runs(_chain_graph()[0], {**_inputs(), "o": np.zeros((6, 40), np.float32)})
    assert exe.direct is None and exe.launches is None


def _gather_graph(copied: int, extra_output: bool = False):
    """The 950's SyncBatchNormGatherStatsFused on bound tensors, ``copied`` of its four results
    copied (redirected) into bound tensors ``o0``...; with ``extra_output`` the graph gives its
    ``mean`` input back too. The graph and its arrays."""
    W, C = 3, 7
    g = Graph("gather")
    shapes = {"mean": (W, C), "invstd": (W, C), "counts": (W,), "rm": (1, C), "rv": (1, C)}
    ins = [g.add_input(n, TensorType(s, F)) for n, s in shapes.items()]
    outs = [g.add_input(f"o{k}", TensorType((1, C), F)) for k in range(copied)]
    node = g.add_node("SyncBatchNormGatherStatsFused", ins, G.make_attrs(momentum=0.1, eps=1e-5, cores=64))
    g.outputs = [g.add_node("ViewCopy", [r, o], redirect=True).outputs[0]
                 for r, o in zip(node.outputs, outs)] + (ins[:1] if extra_output else [])
    rng = np.random.default_rng(2)
    arrays = {"mean": rng.standard_normal((W, C)).astype(np.float32),
              "invstd": (rng.random((W, C)) + 0.25).astype(np.float32), "counts": np.float32([4, 9, 2]),
              "rm": rng.standard_normal((1, C)).astype(np.float32),
              "rv": (rng.random((1, C)) + 0.5).astype(np.float32),
              **{f"o{k}": np.zeros((1, C), np.float32) for k in range(copied)}}
    return g, arrays


@pytest.mark.parametrize("copied, extra_output, direct", [(4, False, True), (3, False, False),
                                                          (4, True, False)])
def test_gather_runs_direct_only_when_its_results_are_exactly_the_outputs(copied, extra_output, direct):
    """The gather runs as its direct C call when all four results are placed in bound tensors
    and are the graph's outputs; a result left in the workspace, or another graph output (an
    input given back), and it runs node by node. The same bits either way."""
    exe = _same_runs(*_gather_graph(copied, extra_output))
    assert (exe.gather is not None) == direct


@pytest.mark.parametrize("new_tensors", [False, True])
def test_repeatable_run_in_another_workspace_uses_that_one(new_tensors):
    """run_repeatable binds its steps to the workspace of the runs that repeat; a run in another
    workspace (with the same tensors, or new ones of the same layouts) keeps its intermediates
    there, not in the bound one."""
    g, mid = _chain_graph()
    plan = plan_memory(g)
    exe = get("native").compile(g, plan, get_platform())
    arrays = _inputs()
    slot = exe.slots[mid]
    tensors = lambda: {"x": opgraph.tensor(arrays["x"].copy()), "w": opgraph.tensor(arrays["w"].copy()),  # noqa: E731
                       "o": opgraph.tensor(np.zeros((6, 40), np.float32))}
    t, ws1, ws2 = tensors(), bytearray(plan.size), bytearray(plan.size)
    for _ in range(2):
        exe.run_repeatable(t, ws1)
    assert exe.bound is not None
    ws1[:] = bytes(len(ws1))
    t2 = tensors() if new_tensors else t
    exe.run_repeatable(t2, ws2)
    mid_bytes = np.frombuffer(ws2, np.float32, 240, slot.offset).reshape(6, 40)
    assert not any(ws1) and same_bits(mid_bytes, arrays["x"] * arrays["w"])
    assert same_bits(t2["o"].view(), arrays["x"] * arrays["w"] + arrays["x"])


def _repeatable_runs(g: Graph, arrays: dict, runs: int = 4):
    """``runs`` run_repeatable calls on the same tensors (the third on runs bound), each
    checked against the numpy backend's bits; the native executable."""
    plan = plan_memory(g)
    want, _ = _run_graph("numpy", g, arrays, runs=1)
    exe = get("native").compile(g, plan, get_platform())
    ws, bound = bytearray(plan.size), {n: np.array(a) for n, a in arrays.items()}
    tensors = {n: opgraph.tensor(a) for n, a in bound.items()}
    for _ in range(runs):
        for n, a in arrays.items():
            bound[n][...] = a
        out = exe.run_repeatable(tensors, ws)
        assert all(same_bits(out[v.name], w) for v, w in zip(g.outputs, want[0][0]))
        assert all(same_bits(bound[n], want[0][1][n]) for n in arrays)
    assert exe.bound is not None
    return exe


def test_kernel_without_a_c_prologue_is_not_a_direct_launch():
    """A kernel whose per-channel part has no C prologue (pow by 3 of a per-channel input: numpy
    computes it per call) takes no direct launch, nor a bound C call in repeated runs: its
    lowering runs it, with the reference's bits."""
    body = (Instr(op="fill", args=(), dtype=F, value=3.0), Instr(op="pow", args=("in1", "t0"), dtype=F),
            Instr(op="mul", args=("in0", "t1"), dtype=F))
    a = FusedAttrs(shape=(6, 40), body=body, result="t2", out_dtype=F)
    g = Graph("cube")
    x, w = g.add_input("x", TensorType((6, 40), F)), g.add_input("w", TensorType((1, 40), F))
    o = g.add_input("o", TensorType((6, 40), F))
    node = g.add_node("FusedElementwise", [x, w], a)
    g.outputs = [g.add_node("ViewCopy", [node.outputs[0], o], redirect=True).outputs[0]]
    arrays = {**_inputs(), "o": np.zeros((6, 40), np.float32)}
    assert not launch_for(a, [arrays["x"], arrays["w"]], arrays["o"]).fused
    exe = _same_runs(g, arrays)
    assert exe.launches is None and exe.direct is None
    _repeatable_runs(g, arrays)  # nor a bound C call: the lowering runs it, as node by node


def test_rebound_reduction_follows_a_threshold_moved_between_runs(monkeypatch):
    """run_repeatable rebinds a FusedReduce for new tensors of the same layouts keeping its C
    plan, unless the threshold moved across its size in between: then the serial call's plan
    is not taken for the passes (nor the other way round). Every run the reference's bits."""
    body = (Instr(op="mul", args=("in0", "in0"), dtype=F),
            Instr(op="sum", args=("t0",), dtype=F, shape=(1, 3, 1)), Instr(op="sqrt", args=("t1",), dtype=F))
    a = FusedReduceAttrs(body=body, results=("t2", "t1"), out_shapes=((3,), (3,)))
    x = np.random.default_rng(0).standard_normal((4, 3, 50)).astype(np.float32)
    g, plan = _reduce_program(a, x.shape, 2)
    exe = get("native").compile(g, plan, get_platform())
    ws, want = bytearray(plan.size), FusedReduce.compute([x], a)
    for limit in (10 ** 6, 10 ** 6, 0, 0, 10 ** 6):  # serial, serial (bound), passes, ..., serial
        reduce_limits_at(monkeypatch, limit)
        outs = [np.zeros(3, np.float32) for _ in range(2)]
        exe.run_repeatable({"x": opgraph.tensor(x.copy()), "o0": opgraph.tensor(outs[0]),
                            "o1": opgraph.tensor(outs[1])}, ws)
        assert all(same_bits(o, w) for o, w in zip(outs, want))
    assert exe.bound is not None


def test_repeated_runs_below_min_fused_elements_run_on_numpy(monkeypatch):
    """Bound steps honour ``min_fused_elements`` as the lowering does: below it every repeated
    run's kernel runs on numpy (counted in ``small``), with the same bits."""
    b = get("native")
    monkeypatch.setattr(native.NativeBackend, "min_fused_elements", 10 ** 9)
    before = b.small
    g, _ = _chain_graph()
    _repeatable_runs(g, {**_inputs(), "o": np.zeros((6, 40), np.float32)}, runs=4)
    assert b.small == before + 2 * 4  # two kernels a run


def test_direct_reduction_whose_pass_reads_a_per_channel_input(monkeypatch):
    """A direct reduction whose pass reads a per-channel input (sum((x - m) * x): the
    family's backward sums read the mean) fills that register's rows every run, so it does not
    run from the input addresses alone; every run the reference's bits."""
    reduce_limits_at(monkeypatch, 0)  # the passes at any size
    C = 3
    body = (Instr(op="sub", args=("in0", "in1"), dtype=F), Instr(op="mul", args=("t0", "in0"), dtype=F),
            Instr(op="sum", args=("t1",), dtype=F, shape=(1, C, 1)), Instr(op="sqrt", args=("t2",), dtype=F))
    a = FusedReduceAttrs(body=body, results=("t3", "t2"), out_shapes=((C,), (C,)))
    g = Graph("centred")
    x, m = g.add_input("x", TensorType((4, C, 50), F)), g.add_input("m", TensorType((1, C, 1), F))
    outs = [g.add_input(f"o{k}", TensorType((C,), F)) for k in range(2)]
    node = g.add_node("FusedReduce", [x, m], a)
    g.outputs = [g.add_node("ViewCopy", [r, o], redirect=True).outputs[0] for r, o in zip(node.outputs, outs)]
    arrays = {"x": np.random.default_rng(0).standard_normal((4, C, 50)).astype(np.float32),
              "m": np.float32([0.5, -1, 2]).reshape(1, C, 1), "o0": np.zeros(C, np.float32),
              "o1": np.zeros(C, np.float32)}
    exe = _same_runs(g, arrays)
    assert exe.direct_reduce is not None and not exe.direct_reduce.passes.by_address


@pytest.mark.parametrize("reader", ["a", "b"])
def test_direct_blocked_pair_whose_pass_reads_a_per_channel_input(monkeypatch, reader):
    """Two passes run as one blocked C call (64 channels), pass a or pass b reading a
    per-channel input w (b besides what a derived): sum(x * w) then sum((x - 0.01 Σ)²), or
    Σx then sum(((x - 0.01 Σx) * w) * (x - 0.01 Σx)). Its rows are filled every run, not taken
    from the input addresses alone; the reference's bits."""
    reduce_limits_at(monkeypatch, 0)  # the passes at any size
    C = 64
    head = (Instr(op="mul", args=("in0", "in1"), dtype=F),) if reader == "a" else ()
    off = len(head)  # the register numbers after the head
    t = [f"t{k + off}" for k in range(8)]
    body = head + (Instr(op="sum", args=("t0" if head else "in0",), dtype=F, shape=(1, C, 1)),
                   Instr(op="fill", args=(), dtype=F, value=0.01), Instr(op="mul", args=(t[0], t[1]), dtype=F),
                   Instr(op="sub", args=("in0", t[2]), dtype=F),
                   Instr(op="mul", args=(t[3], "in1" if reader == "b" else t[3]), dtype=F),
                   Instr(op="mul", args=(t[4], t[3]), dtype=F),
                   Instr(op="sum", args=(t[5],), dtype=F, shape=(1, C, 1)), Instr(op="sqrt", args=(t[6],), dtype=F))
    a = FusedReduceAttrs(body=body, results=(t[7], t[0]), out_shapes=((C,), (C,)))
    g = Graph("blocked")
    x, w = g.add_input("x", TensorType((2, C, 50), F)), g.add_input("w", TensorType((1, C, 1), F))
    outs = [g.add_input(f"o{k}", TensorType((C,), F)) for k in range(2)]
    node = g.add_node("FusedReduce", [x, w], a)
    g.outputs = [g.add_node("ViewCopy", [r, o], redirect=True).outputs[0] for r, o in zip(node.outputs, outs)]
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((2, C, 50)).astype(np.float32),
              "w": (rng.random((1, C, 1)) + 0.5).astype(np.float32),
              "o0": np.zeros(C, np.float32), "o1": np.zeros(C, np.float32)}
    exe = _same_runs(g, arrays)
    d = exe.direct_reduce
    assert d is not None and d.plan.steps[0][0] == "blocked" and not d.passes.by_address


def test_passes_result_broadcast_to_its_output_without_a_c_epilogue():
    """A one-element result (the sum of everything, cubed: no C epilogue) broadcast to an output
    of three elements by the passes' numpy epilogue: the reference's bits."""
    body = (Instr(op="sum", args=("in0",), dtype=F, shape=(1, 1, 1)),
            Instr(op="fill", args=(), dtype=F, value=3.0), Instr(op="pow", args=("t0", "t1"), dtype=F))
    a = FusedReduceAttrs(body=body, results=("t2",), out_shapes=((1, 3, 1),))
    x = np.float32(np.arange(24).reshape(2, 3, 4) / 10)
    assert plan_for(a, [x]).tail is None
    got = run_fused_reduce_native(a, [x])
    assert len(got) == 1 and same_bits(got[0], FusedReduce.compute([x], a)[0])
    assert got[0].shape == (1, 3, 1) and len(set(got[0].ravel().tolist())) == 1


def test_resized_launch_keeps_the_attrs_result_and_the_overlap_check():
    """The last launch of a body is taken over at another batch size only for the same result
    register (attrs made from others keep the body object), and, resized, still refuses an
    output at a float16 input's address (float32: twice its bytes), as a new launch does."""
    a0 = _cast_mul((8, 40))
    w = np.float32(np.arange(40).reshape(1, 40) / 5 - 3)
    x = np.float32(np.arange(320).reshape(8, 40) / 9)
    assert same_bits(run_fused_native(a0, [x, w]), run_fused(a0, [x, w]))
    a1 = a0.model_copy(update={"result": "t0", "shape": (6, 40)})  # the cast alone
    assert a1.body is a0.body
    assert same_bits(run_fused_native(a1, [x[:6], w]), x[:6])
    x16 = np.float16(x)
    assert same_bits(run_fused_native(a0, [x16, w]), run_fused(a0, [x16, w]))
    buf = np.zeros(7 * 40, np.float32)
    xin = buf.view(np.float16)[:7 * 40].reshape(7, 40)
    xin[:] = x16[:7]
    with pytest.raises(native.Unsupported, match="partly overlaps"):
        run_fused_native(a0.model_copy(update={"shape": (7, 40)}), [xin, w], buf.reshape(7, 40))


def test_serial_call_refuses_what_its_prologue_cannot_read_or_give():
    """The serial call's C prologue refuses an input whose byte strides are not a multiple of
    its element size, and a result that is not a float register (an int32 input given back):
    Unsupported, with its reason (the lowering then runs numpy)."""
    body = (Instr(op="mul", args=("in0", "in0"), dtype=F), Instr(op="sum", args=("t0",), dtype=F, shape=(1, 3)))
    a = FusedReduceAttrs(body=body, results=("t1",), out_shapes=((3,),))
    raw = np.zeros(64, np.uint8)
    x = np.lib.stride_tricks.as_strided(raw.view(np.float32)[:1], (2, 3), (18, 6))
    with pytest.raises(native.Unsupported, match="multiple of its element size"):
        run_small_reduce_native(a, [x])
    b = FusedReduceAttrs(body=body, results=("t1", "in1"), out_shapes=((3,), (3,)))
    with pytest.raises(native.Unsupported, match="not a float register"):
        run_small_reduce_native(b, [np.ones((2, 3), np.float32), np.int32([1, 2, 3])])
