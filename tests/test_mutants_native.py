"""Behaviours of the native backend's Python side that a mutation audit found unpinned: which
path a call takes (thresholds, layout checks, memos) and that every path gives the numpy
reference's bits."""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from backends import native
from backends.native import gather_fused
from backends.native.direct_reduce import DirectReduce
from backends.native.launch import run_fused_native
from backends.native.reduce import plan_for
from backends.native.small import plan_small, run_small_reduce_native, SmallCall
from l0ops.fused_reduce import FusedReduce, FusedReduceAttrs, Instr
from l0ops.interpreter import run_fused
from l0ops.primitives import FusedAttrs, Instr as EInstr
from l0ops.syncbn import SyncBatchNormGatherStatsFused as G
from native_limits import reduce_limits_at
import opgraph
from opgraph import aclnn as A
from opgraph.aclnn.cache import EXECUTOR_CACHE
from opgraph.core import backend as registry
from opgraph.core.backend import get
from opgraph.core.dtypes import DataType as D
from opgraph.core.ir import Graph, TensorType
from opgraph.core.memory import plan_memory
from opgraph.core.platform import get_platform

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])
F = D.FLOAT


def same_bits(got, want) -> bool:
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    return got.dtype == want.dtype and got.shape == want.shape and \
        np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_serial_call_of_a_body_reading_no_input():
    """A FusedReduce body of constants reads no input: its serial call still gets a pointer
    slot (a NULL it never reads) and gives the reference's values."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    a = FusedReduceAttrs(body=(Instr(op="fill", args=(), dtype=F, value=2.5, shape=(1, 3)),),
                         results=("t0",), out_shapes=((3,),))
    got = run_small_reduce_native(a, [x])
    assert all(same_bits(g, w) for g, w in zip(got, FusedReduce.compute([x], a)))
    assert got[0].tolist() == [2.5, 2.5, 2.5]


def _sum_of_squares(k: int):
    body = (Instr(op="mul", args=("in0", "in0"), dtype=F),
            Instr(op="sum", args=("t0",), dtype=F, shape=(1, k)))
    return FusedReduceAttrs(body=body, results=("t1",), out_shapes=((k,),))


def test_serial_plan_is_kept_per_layout():
    """The serial call's plan is remembered per operand layout: the same body on a strided view
    of the same shape after a contiguous array (and back) reads each with its own strides."""
    a = _sum_of_squares(3)
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    for x in (np.ascontiguousarray(base[:, :3]), base[:, ::2], base.T[::2, ::2].T.copy()[:, :3],
              base[:, 1::2]):
        got = run_small_reduce_native(a, [x])
        assert same_bits(got[0], FusedReduce.compute([x], a)[0])
        assert got[0].tolist() == (x.astype(np.float64) ** 2).sum(0).tolist()


def test_serial_call_spans_only_float32_results():
    """SmallCall.spans gives byte spans for float32 results laid out row-major with the output's
    size (a byte copy can place them), and None when a result is another dtype."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    a = _sum_of_squares(3)
    call = SmallCall(plan_small(a, [x]), a)
    spans = call.spans(a)
    assert spans is not None and len(spans) == 1 and spans[0][1] == 3 * 4
    call.compute([x.ctypes.data])
    assert (ctypes.c_float * 3).from_address(spans[0][0])[:] == [9.0, 17.0, 29.0]
    body = _sum_of_squares(3).body + (Instr(op="cast", args=("t1",), dtype=D.FLOAT16),)
    h = FusedReduceAttrs(body=body, results=("t2",), out_shapes=((3,),))
    call = SmallCall(plan_small(h, [x]), h)
    assert call.spans(h) is None
    assert same_bits(call([x.ctypes.data])[0], FusedReduce.compute([x], h)[0])
    # a one-element result broadcast to its output of 3: no byte copy either
    body = _sum_of_squares(3).body[:1] + (Instr(op="sum", args=("t0",), dtype=F, shape=(1, 1)),)
    b = FusedReduceAttrs(body=body, results=("t1",), out_shapes=((1, 3),))
    call = SmallCall(plan_small(b, [x]), b)
    assert call.spans(b) is None
    assert same_bits(call([x.ctypes.data])[0], FusedReduce.compute([x], b)[0])


def _stats(backend: str, x: np.ndarray, outs: list):
    """BatchNormStats at level 2 into ``outs`` (arrays, any layout); its executor."""
    with opgraph.use_backend(backend), opgraph.opt_level(2):
        status, ws, ex = A.aclnnBatchNormStatsGetWorkspaceSize(
            opgraph.tensor(x), 1e-5, *[opgraph.tensor(o) for o in outs])
        assert status == 0
        assert A.aclnnBatchNormStats(bytearray(ws) if ws else None, ws, ex) == 0
    return ex


def _direct_reduce(ex):
    return ex.program.built_executable(registry.get("native")).direct_reduce


def _data(seed: int, shape=(2, 5, 3)) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 3 + 1).astype(np.float32)


def test_direct_reduce_at_exactly_the_threshold_takes_the_passes(monkeypatch):
    """A FusedReduce whose input elements equal the threshold is not below it: the direct run
    is prepared for the passes, as the node's lowering decides, and then taken on every call
    (a run on the other side of the threshold would give up and go node by node)."""
    x = _data(1)
    reduce_limits_at(monkeypatch, x.size)
    taken = []
    real = DirectReduce.run
    monkeypatch.setattr(DirectReduce, "run", lambda self, *a: taken.append(real(self, *a)) or taken[-1])
    EXECUTOR_CACHE.clear()
    for seed in range(3):
        x = _data(seed)
        got = [np.full(5, np.nan, np.float32) for _ in range(2)]
        want = [np.full(5, np.nan, np.float32) for _ in range(2)]
        ex = _stats("native", x, got)
        _stats("numpy", x, want)
        assert all(same_bits(g, w) for g, w in zip(got, want))
    d = _direct_reduce(ex)
    assert d is not None and d.elements == x.size and d.small is False
    assert taken == [True] * 3


@pytest.mark.parametrize("strided", [0, 1])
def test_direct_reduce_into_a_strided_output_places_it(strided):
    """DirectReduce byte-copies its results out of the call's scratch only into outputs that
    are one run of float32 bytes: into a strided one (the other output contiguous) it places
    them through the tensor's view, the gaps untouched."""
    EXECUTOR_CACHE.clear()
    x = _data(3)
    want = [np.full(5, np.nan, np.float32) for _ in range(2)]
    ex = _stats("native", x, [np.full(5, np.nan, np.float32) for _ in range(2)])
    _stats("numpy", x, want)
    exe = ex.program.built_executable(registry.get("native"))
    node, dests, outputs = exe.reduce
    backing = np.full(10, -7.0, np.float32)
    outs = [np.full(5, np.nan, np.float32) for _ in range(2)]
    outs[strided] = backing[::2]
    bindings = {node.inputs[0].name: opgraph.tensor(x)}
    bindings.update({name: opgraph.tensor(o) for (name, _), o in zip(dests, outs)})
    limits = native.NativeBackend().limits()
    d = DirectReduce.prepare(node, bindings, limits, dests, outputs)
    assert d is not None and d.small and d.run(bindings, limits)
    assert backing[1::2].tolist() == [-7.0] * 5
    assert all(same_bits(g, w) for g, w in zip(outs, want))


def _reduce_program(a: FusedReduceAttrs, shape: tuple, n_out: int):
    """A graph of one FusedReduce over input ``x`` whose results are copied (redirected) into
    inputs ``o0``, ``o1``, ...: the shape of the family's statistics at level 2."""
    g = Graph("reduce")
    x = g.add_input("x", TensorType(shape, F))
    outs = [g.add_input(f"o{k}", TensorType(s, F)) for k, s in zip(range(n_out), a.out_shapes)]
    node = g.add_node("FusedReduce", [x], a)
    g.outputs = [g.add_node("ViewCopy", [r, o], redirect=True).outputs[0]
                 for r, o in zip(node.outputs, outs)]
    return g, plan_memory(g)


def _run_program(backend: str, g, plan, x: np.ndarray, runs: int = 2):
    """The outputs of ``runs`` runs of the compiled program (new output arrays each time)."""
    exe = get(backend).compile(g, plan, get_platform())
    for _ in range(runs):
        outs = [np.full(v.type.shape, np.nan, np.float32) for v in g.inputs[1:]]
        bindings = {"x": opgraph.tensor(x), **{f"o{k}": opgraph.tensor(o) for k, o in enumerate(outs)}}
        exe.run(bindings, bytearray(plan.size))
    return outs, exe


def _pow_body_program():
    """sum(x) over (0, 2), then cubed (pow by 3: no serial C call covers it, the passes with a
    numpy epilogue do); the program and an input."""
    body = (Instr(op="sum", args=("in0",), dtype=F, shape=(1, 3, 1)),
            Instr(op="fill", args=(), dtype=F, value=3.0),
            Instr(op="pow", args=("t0", "t1"), dtype=F))
    a = FusedReduceAttrs(body=body, results=("t2", "t0"), out_shapes=((3,), (3,)))
    x = np.random.default_rng(0).standard_normal((4, 3, 50)).astype(np.float32)
    return a, x, *_reduce_program(a, x.shape, 2)


def test_direct_reduce_without_a_c_epilogue(monkeypatch):
    """A direct reduction whose epilogue the C renderer does not cover (pow by 3: the plan has
    no tail) runs its passes and the numpy epilogue on every call, with the reference's bits."""
    reduce_limits_at(monkeypatch, 0)  # the passes at any size
    a, x, g, plan = _pow_body_program()
    assert plan_for(a, [x]).tail is None
    got, exe = _run_program("native", g, plan, x, runs=3)
    want, _ = _run_program("numpy", g, plan, x)
    assert exe.direct_reduce is not None and not exe.direct_reduce.small
    assert all(same_bits(g_, w) for g_, w in zip(got, want))


def _fused(result: str, body_args=("in1", "in1")):
    return FusedAttrs(shape=(2, 3), body=(EInstr(op="mul", args=body_args, dtype=F),),
                      result=result, out_dtype=F)


def test_fused_result_that_is_per_channel_is_refused():
    """A body whose result does not vary over the iteration space (made from per-channel
    values only) is not a kernel: Unsupported, with its reason (the lowering then runs numpy)."""
    x, w = np.arange(6, dtype=np.float32).reshape(2, 3), np.float32([[1, 2, 3]])
    with pytest.raises(native.Unsupported, match="does not vary"):
        run_fused_native(_fused("t0"), [x, w])


def test_fused_result_that_is_a_full_size_input():
    """A body whose result is one of its full-size inputs (the other instruction dead): the
    kernel copies that input, the reference's bits."""
    x, w = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5, np.float32([[1, 2, 3]])
    a = _fused("in0")
    assert same_bits(run_fused_native(a, [x, w]), run_fused(a, [x, w]))


def test_float16_result_stored_as_float32_keeps_its_rounding():
    """A float16 result stored into a float32 output: the instruction's own rounding to float16
    stays (only an f16 store may take it over), the reference's bits."""
    rng = np.random.default_rng(0)
    x, y = ((rng.standard_normal((4, 300)) * 30).astype(np.float16) for _ in range(2))
    a = FusedAttrs(shape=(4, 300), body=(EInstr(op="mul", args=("in0", "in1"), dtype=D.FLOAT16),),
                   result="t0", out_dtype=F)
    got = run_fused_native(a, [x, y])
    assert same_bits(got, run_fused(a, [x, y]))
    assert np.array_equal(got, (x.astype(np.float32) * y).astype(np.float16).astype(np.float32))


def _cast_mul(shape=(8, 40)):
    """cast(in0) * in1 (per-channel) at ``shape``, float32 out."""
    body = (EInstr(op="cast", args=("in0",), dtype=F), EInstr(op="mul", args=("t0", "in1"), dtype=F))
    return FusedAttrs(shape=shape, body=body, result="t1", out_dtype=F)


def test_launch_of_a_body_is_reused_only_for_the_same_operand_dtypes():
    """The last launch per body object is resized for a new batch size, but not taken for
    inputs of another dtype (its kernel loads float32): float32, float16 and back, at two sizes,
    each the reference's bits."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1, 40)).astype(np.float32)
    a0 = _cast_mul()
    for rows, dt in ((8, np.float32), (8, np.float16), (6, np.float16), (6, np.float32), (5, np.float16)):
        a = a0.model_copy(update={"shape": (rows, 40)})
        assert a.body is a0.body  # (the memo is per body object)
        x = rng.standard_normal((rows, 40)).astype(dt)
        assert same_bits(run_fused_native(a, [x, w]), run_fused(a, [x, w]))


def test_pointer_memo_of_a_launch_notices_a_new_output():
    """The same input arrays into a new output array: the kernel writes the new one (the
    remembered pointers are of the inputs and the output), the old one keeps its values."""
    rng = np.random.default_rng(1)
    a = _cast_mul()
    x, w = rng.standard_normal((8, 40)).astype(np.float32), rng.standard_normal((1, 40)).astype(np.float32)
    want = run_fused(a, [x, w])
    first = run_fused_native(a, [x, w], np.zeros((8, 40), np.float32))
    outs = [np.full((8, 40), -1.0, np.float32) for _ in range(3)]
    for o in outs:
        assert run_fused_native(a, [x, w], o) is o
    assert all(same_bits(o, want) for o in [first, *outs])
    x[:] = 0
    assert run_fused_native(a, [x, w], outs[1]) is outs[1] and not outs[1].any()
    assert same_bits(outs[0], want) and same_bits(outs[2], want)


def test_operand_strides_not_a_multiple_of_the_element_size_are_refused():
    """A full-size input whose byte strides are not a multiple of its element size (a float32
    view every 6 bytes) has no element strides for the kernel: Unsupported."""
    raw = np.zeros(8 * 40 * 6 + 8, np.uint8)
    x = np.lib.stride_tricks.as_strided(raw.view(np.float32)[:1], (8, 40), (240, 6))
    w = np.ones((1, 40), np.float32)
    with pytest.raises(native.Unsupported, match="multiple of its element size"):
        run_fused_native(_cast_mul(), [x, w])


def test_output_next_to_an_input_is_not_an_overlap():
    """An output that ends where an input starts, or starts where it ends, shares no byte with
    it: the kernel runs (no Unsupported), the reference's bits."""
    a, w = _cast_mul(), np.float32(np.arange(40) / 8 - 2).reshape(1, 40)
    for x_first in (True, False):
        buf = np.zeros(2 * 320, np.float32)
        x, out = (buf[:320], buf[320:]) if x_first else (buf[320:], buf[:320])
        x[:] = np.arange(320) / 16 - 10
        x, out = x.reshape(8, 40), out.reshape(8, 40)
        want = run_fused(a, [x, w])
        assert run_fused_native(a, [x, w], out) is out and same_bits(out, want)


def test_output_at_an_input_address_with_other_strides_is_refused():
    """An output at an input's address but not of its layout (its transpose), or of its layout
    one element further on, overwrites elements before they are read: Unsupported. Exactly the
    input's layout at its address (in place) runs."""
    a = _cast_mul((40, 40))
    x = np.float32(np.arange(1600) / 64 - 12).reshape(40, 40)
    w = np.float32(np.arange(40) / 8 - 2).reshape(1, 40)
    with pytest.raises(native.Unsupported, match="partly overlaps"):
        run_fused_native(a, [x, w], x.T)
    shifted = np.zeros(1601, np.float32)  # the input's layout, one element further on
    with pytest.raises(native.Unsupported, match="partly overlaps"):
        run_fused_native(a, [shifted[:1600].reshape(40, 40), w], shifted[1:].reshape(40, 40))
    want = run_fused(a, [x, w])
    assert run_fused_native(a, [x, w], x) is x and same_bits(x, want)


def test_fused_kernel_of_exactly_min_fused_elements_runs_in_c(monkeypatch):
    """``min_fused_elements`` is the smallest kernel that runs in C: at level 2 one of exactly
    that many elements runs as the direct launch on every call; one element more of threshold
    sends it node by node to numpy (counted in ``small``); a profiled run, node by node, draws
    the same line. The same bits either way."""
    b = registry.get("native")
    lowered = []
    real = native.run_fused_native
    monkeypatch.setattr(native, "run_fused_native", lambda *a: lowered.append(1) or real(*a))
    x, c = np.float32(np.arange(24).reshape(2, 3, 4) / 7), np.float32([0.5, 2, 3])
    args = (x, x, c, c, c, c, c, np.int32([2]))
    with opgraph.use_backend("numpy"), opgraph.opt_level(2):
        want = opgraph.ops.batch_norm_elemt_backward(*args)
    for limit, to_numpy in ((24, 0), (25, 1)):
        monkeypatch.setattr(native.NativeBackend, "min_fused_elements", limit)
        for _ in range(3):
            before = b.small
            with opgraph.use_backend("native"), opgraph.opt_level(2):
                got = opgraph.ops.batch_norm_elemt_backward(*args)
            assert same_bits(got, want) and b.small == before + to_numpy
    assert lowered == []  # neither size ran the kernel node by node
    # profiled: node by node, where the lowering draws the same line
    monkeypatch.setattr(native.NativeExecutable, "profile", staticmethod(lambda node, start, stop: None))
    for limit, to_numpy in ((24, 0), (25, 1)):
        monkeypatch.setattr(native.NativeBackend, "min_fused_elements", limit)
        before, calls = b.small, len(lowered)
        with opgraph.use_backend("native"), opgraph.opt_level(2):
            got = opgraph.ops.batch_norm_elemt_backward(*args)
        assert same_bits(got, want) and b.small == before + to_numpy
        assert len(lowered) == calls + 1 - to_numpy


def test_one_element_launch_resized_for_a_new_attrs_object():
    """A kernel of one element (every dim 1) taken over by new attrs of the same body (the
    resized launch): its loop is still one element, the reference's bits."""
    body = (EInstr(op="add", args=("in0", "in0"), dtype=F), EInstr(op="mul", args=("t0", "in1"), dtype=F))
    a0 = FusedAttrs(shape=(1, 1), body=body, result="t1", out_dtype=F)
    for k in range(3):
        a = a0.model_copy(update={"shape": (1, 1)})
        x, w = np.float32([[1.5 + k]]), np.float32([[3.0]])
        got = run_fused_native(a, [x, w])
        assert same_bits(got, run_fused(a, [x, w])) and got.item() == (3 + 2 * k) * 3


def test_reduce_lowering_at_exactly_the_threshold_takes_the_passes(monkeypatch):
    """Node by node (profiled), a FusedReduce whose input elements equal the threshold runs
    the passes: a body the serial call does not cover still runs in C (``small`` unchanged);
    one element more of threshold and it is a small body on numpy (``small`` counts it)."""
    b = registry.get("native")
    a, x, g, plan = _pow_body_program()
    want, _ = _run_program("numpy", g, plan, x)
    monkeypatch.setattr(native.NativeExecutable, "profile", staticmethod(lambda node, start, stop: None))
    for limit, small in ((x.size, 0), (x.size + 1, 1)):
        reduce_limits_at(monkeypatch, limit)
        before, fallbacks = b.small, sum(b.fallbacks.values())
        got, _ = _run_program("native", g, plan, x, runs=1)
        assert b.small == before + small and sum(b.fallbacks.values()) == fallbacks
        assert all(same_bits(g_, w) for g_, w in zip(got, want))


def test_gather_call_is_kept_per_dtype_of_every_operand():
    """The 950's gather call is compiled per dtype of the mean, invstd and both running stats:
    float32 statistics with running stats of each dtype in turn (and back), each call the
    numpy semantics' bits. Counts of another dtype than float32 are refused."""
    rng = np.random.default_rng(5)
    a = G.make_attrs(momentum=0.1, eps=1e-5, cores=64)
    mean, invstd = (rng.standard_normal((3, 7)) * 3).astype(np.float32), (rng.random((3, 7)) + 0.25).astype(np.float32)
    counts = np.float32([4, 9, 2])
    for rm_dt, rv_dt in ((np.float32, np.float32), (ml_dtypes.bfloat16, np.float32),
                         (np.float32, np.float16), (np.float16, ml_dtypes.bfloat16), (np.float32, np.float32)):
        rm, rv = rng.standard_normal((1, 7)).astype(rm_dt), (rng.random((1, 7)) + 0.5).astype(rv_dt)
        xs = [mean, invstd, counts, rm, rv]
        got, want = gather_fused.run_gather_fused(a, xs), G.compute(xs, a)
        assert len(got) == 4 and all(same_bits(g, w) for g, w in zip(got, want))
    for counts in (np.float16([4, 9, 2]), np.float64([4, 9, 2])):  # the call reads float32 counts
        with pytest.raises(native.Unsupported, match="counts other than float32"):
            gather_fused.run_gather_fused(a, [mean, invstd, counts, rm, rv])


def test_launch_is_kept_per_operand_and_output_strides():
    """The same attrs on operands of one shape but other strides (a column-strided input, then
    a row-strided output) each get their own launch: every call the reference's bits."""
    a = _cast_mul()
    base = np.float32(np.arange(16 * 80).reshape(16, 80) / 9 - 40)
    w = np.float32(np.arange(40).reshape(1, 40) / 5 - 3)
    for x in (np.ascontiguousarray(base[:8, :40]), base[:8, ::2], base[::2, 1::2]):
        want = run_fused(a, [x, w])
        for out in (np.zeros((8, 40), np.float32), np.zeros((16, 40), np.float32)[::2]):
            assert same_bits(run_fused_native(a, [x, w], out), want)


def test_output_over_the_last_element_of_a_strided_input_is_refused():
    """An output starting at the last element a strided input reads overlaps it (by that one
    element): Unsupported."""
    buf = np.zeros(2 * 320 + 320, np.float32)
    x = buf[:640:2].reshape(8, 40)  # every other element: its last at 638
    out = buf[638:638 + 320].reshape(8, 40)
    with pytest.raises(native.Unsupported, match="partly overlaps"):
        run_fused_native(_cast_mul(), [x, np.ones((1, 40), np.float32)], out)
