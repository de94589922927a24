"""Behaviours of the passes and of the l0 ops' numerics that a mutation audit found unpinned:
each test fails on a small change of the code (a flipped comparison, a dropped check, a constant
off by one) that the rest of the suite let pass. Expected values are worked out by hand, in
float64 or by numpy's own conversions, never by the code under test."""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import opgraph
from backends import get as get_backend
from l0ops.channel_blocks import channel_ranges, channel_split
from l0ops.chunking import chunks, per_block_dims, row_blocks
from l0ops.fused import FusedAttrs, Instr
from l0ops.interpreter import run_fused
from l0ops.ordered import ordered_sum, tree_fold
from l0ops.primitives import cast_array, pow_array
from l0ops.rounding import widen
from opgraph.core.dtypes import DataType
from opgraph.core.ir import Graph, TensorType
from opgraph.core.opdef import L0Error
from opgraph.passes import (constant_fold, cse, fuse_elementwise, fuse_reductions, optimize,
                             viewcopy_redirect)
from sum_model import loop_sum

F32, F16 = DataType.FLOAT, DataType.FLOAT16


def test_constant_fold_of_a_broadcast_fill_is_a_fill_of_the_broadcast_shape():
    """A move (BroadcastTo) of a one-element Fill folds to the Fill's value at the new shape;
    the value is not recomputed by the op (a broadcast array is no single value)."""
    g = Graph()
    f = g.add_node("Fill", [], shape=(), value=2.5, dtype=F32).outputs[0]
    b = g.add_node("BroadcastTo", [f], shape=(2, 3)).outputs[0]
    g.outputs = [b]
    new, _ = constant_fold.run(g)
    assert [n.op for n in new.nodes] == ["Fill"]
    fill = new.nodes[0]
    assert fill.attrs.shape == (2, 3) and fill.attrs.value == 2.5 and fill.attrs.dtype == F32



def test_a_nan_constant_folds_though_its_payload_does_not_survive_a_float():
    """Cast(Fill(f16 signalling NaN 0x7C01), FLOAT) is the float32 signalling NaN 0x7F802000
    (numpy's half conversions keep it); as a Python float and back it comes out quiet,
    0x7FC02000 — other bytes, but a NaN either way, so the fold still happens (which NaN comes
    out is left open; that one does is not)."""
    snan = np.uint16(0x7C01).view(np.float16).item()
    widened = np.full((), snan, np.float16).astype(np.float32)
    assert widened.view(np.uint32) == 0x7F802000  # (the premise: numpy keeps it signalling)
    assert np.float32(float(widened)).view(np.uint32) == 0x7FC02000
    g = Graph()
    f = g.add_node("Fill", [], shape=(), value=snan, dtype=F16).outputs[0]
    g.outputs = [g.add_node("Cast", [f], to=F32).outputs[0]]
    with warnings.catch_warnings():  # (IEEE special values fold without numpy warnings)
        warnings.simplefilter("error")
        new, _ = constant_fold.run(g)
    assert [n.op for n in new.nodes] == ["Fill"]
    assert new.nodes[0].attrs.dtype == F32 and np.isnan(new.nodes[0].attrs.value)


def test_a_reduction_of_a_fill_is_not_folded_as_one_element():
    """Folding evaluates a node on one element per Fill: right for element-wise ops and moves,
    wrong for a reduction, whose sum of four 1.5s is 6 (not 1.5): it stays a kernel."""
    g = Graph()
    f = g.add_node("Fill", [], shape=(4,), value=1.5, dtype=F32).outputs[0]
    g.outputs = [g.add_node("ReduceSum", [f], axes=(0,)).outputs[0]]
    new, _ = constant_fold.run(g)
    assert [n.op for n in new.nodes] == ["Fill", "ReduceSum"]
    got = get_backend("numpy").run(new, {})
    assert float(got[new.outputs[0].name]) == 6.0


def test_widening_a_0d_half_gives_a_0d_array():
    """A rank-0 float16 widens to a rank-0 float32 *array* (the table lookup would give a numpy
    scalar, which has no buffer to compute into)."""
    w = widen(np.asarray(np.float16(3.0)))
    assert type(w) is np.ndarray and w.shape == () and w.dtype == np.float32 and float(w) == 3.0


def test_cse_keeps_reads_apart_across_a_first_write_after_another_tensor_was_written():
    """Add(out, x) before and after the first write into ``out`` read two values of ``out``:
    CSE keeps both, also when another tensor was written first (so that the version counts of
    every read are in use). By hand: [11, 22, 33, 44] and x*x + x = [2, 6, 12, 20]."""
    g = Graph("versions")
    t4 = TensorType((4,), F32)
    x, out, other = (g.add_input(n, t4) for n in ("x", "out", "other"))
    g.add_node("ViewCopy", [x, other])
    before = g.add_node("Add", [out, x]).outputs[0]
    g.add_node("ViewCopy", [g.add_node("Mul", [x, x]).outputs[0], out])
    after = g.add_node("Add", [out, x]).outputs[0]
    g.outputs = [before, after]
    new, _ = cse.run(g)
    assert [n.op for n in new.nodes].count("Add") == 2
    xs, outs = np.float32([1, 2, 3, 4]), np.float32([10, 20, 30, 40])
    for level in (0, 2):
        opt = optimize(g, level)
        got = get_backend("numpy").run(opt, {"x": opgraph.tensor(xs.copy()),
                                             "out": opgraph.tensor(outs.copy()),
                                             "other": opgraph.tensor(np.zeros(4, np.float32))})
        assert [got[v.name].tolist() for v in opt.outputs] == [[11, 22, 33, 44], [2, 6, 12, 20]]


def test_tree_fold_of_no_lanes_is_zero_per_row():
    """The halving tree of an empty last axis: a zero per row, in the data's dtype."""
    got = tree_fold(np.ones((2, 3, 0), np.float32))
    assert got.shape == (2, 3) and got.dtype == np.float32 and not got.any()


X4, OUT4 = np.float32([1, 2, 3, 4]), np.float32([10, 20, 30, 40])


def _run_levels(g: Graph, levels=(0, 1, 2)):
    """Per level: the outputs (lists, in order) and ``out`` as written, on fresh copies."""
    for level in levels:
        opt = optimize(g, level)
        arrays = {"x": X4.copy(), "out": OUT4.copy()}
        got = get_backend("numpy").run(opt, {k: opgraph.tensor(a) for k, a in arrays.items()})
        yield level, opt, [got[v.name].tolist() for v in opt.outputs], arrays["out"].tolist()


def _copied_then_overwritten(view_read: bool, marked: bool = False) -> Graph:
    """s = x*x is copied into out, then x overwrites out; s is still read afterwards — through
    a view made right after it (view_read) or as a graph output. Redirecting the first copy
    (s made in out) would hand that read x instead of s."""
    g = Graph("redirect")
    t4 = TensorType((4,), F32)
    x, out = g.add_input("x", t4), g.add_input("out", t4)
    s = g.add_node("Mul", [x, x]).outputs[0]
    v = g.add_node("UnsqueezeNd", [s], dims=(0,)).outputs[0] if view_read else None
    g.add_node("ViewCopy", [s, out], redirect=marked)  # (marked: as a redirect, unsafe)
    g.add_node("ViewCopy", [x, out])
    g.outputs = [g.add_node("Add", [v, x]).outputs[0]] if view_read else [s]
    return g


def test_no_redirect_when_a_view_of_the_source_is_read_after_the_destination_is_rewritten():
    g = _copied_then_overwritten(view_read=True)
    for level, opt, outs, out in _run_levels(g):
        assert outs == [[[2, 6, 12, 20]]] and out == [1, 2, 3, 4], level  # s + x; out = x
        if level == 1:
            assert not any(n.op == "ViewCopy" and n.attrs.redirect for n in opt.nodes)


def test_no_redirect_when_the_source_is_a_graph_output_and_the_destination_is_rewritten():
    g = _copied_then_overwritten(view_read=False)
    for level, opt, outs, out in _run_levels(g):
        assert outs == [[1, 4, 9, 16]] and out == [1, 2, 3, 4], level
        if level == 1:
            assert not any(n.op == "ViewCopy" and n.attrs.redirect for n in opt.nodes)


def test_a_copy_whose_source_nobody_reads_later_is_redirected_though_the_tensor_is_rewritten():
    """s = x*x copied into out, then x copied over it, then u*u of an unrelated u = x + x: no
    read of s follows the rewrite, so the first copy is a redirect (Mul writes into out)."""
    g = Graph("redirect")
    t4 = TensorType((4,), F32)
    x, out = g.add_input("x", t4), g.add_input("out", t4)
    s = g.add_node("Mul", [x, x]).outputs[0]
    u = g.add_node("Add", [x, x]).outputs[0]
    g.add_node("ViewCopy", [s, out])
    g.add_node("ViewCopy", [x, out])
    g.outputs = [g.add_node("Mul", [u, u]).outputs[0]]
    for level, opt, outs, out_after in _run_levels(g):
        assert outs == [[4, 16, 36, 64]] and out_after == [1, 2, 3, 4], level
        if level == 1:
            copies = [n for n in opt.nodes if n.op == "ViewCopy"]
            assert [c.attrs.redirect for c in copies] == [True, False]
    assert viewcopy_redirect.run(g)[1].counts == {"redirected": 1}


def _copy_then_read() -> Graph:
    """s = x*x copied into out, then read again (s + x)."""
    g = Graph("redirect")
    t4 = TensorType((4,), F32)
    x, out = g.add_input("x", t4), g.add_input("out", t4)
    s = g.add_node("Mul", [x, x]).outputs[0]
    g.add_node("ViewCopy", [s, out])
    g.outputs = [g.add_node("Add", [s, x]).outputs[0]]
    return g


def test_a_copy_whose_source_is_read_after_it_is_redirected():
    """s = x*x copied into out and read afterwards (s + x): the redirect makes s in out, where
    its later reader finds it (no copy kernel)."""
    g = _copy_then_read()
    for level, opt, outs, out_after in _run_levels(g):
        assert outs == [[2, 6, 12, 20]] and out_after == [1, 4, 9, 16], level
    new, stats = viewcopy_redirect.run(g)
    assert stats.counts == {"redirected": 1}
    assert [n.attrs.redirect for n in new.nodes if n.op == "ViewCopy"] == [True]


def test_the_redirect_pass_is_idempotent_and_undoes_a_redirect_it_finds_unsafe():
    """Run again on its own result, the pass changes nothing (0 redirected); a ViewCopy marked
    as a redirect where it is unsafe (the destination rewritten while the source is still read)
    becomes a copy again and is counted as undone."""
    g = _copy_then_read()
    once, stats = viewcopy_redirect.run(g)
    assert stats.counts == {"redirected": 1}
    again, stats = viewcopy_redirect.run(once)
    assert stats.counts == {"redirected": 0}
    assert [n.attrs.redirect for n in again.nodes if n.op == "ViewCopy"] == [True]

    bad = _copied_then_overwritten(view_read=False, marked=True)
    fixed, stats = viewcopy_redirect.run(bad)
    assert stats.counts == {"redirected": 0, "undone": 1}
    assert [n.attrs.redirect for n in fixed.nodes if n.op == "ViewCopy"] == [False, False]


def _run_reduce(op: str, arrays: dict, dtype: DataType, level: int, **attrs):
    """``op`` over graph inputs of ``arrays`` (names in order), every output, at ``level``."""
    g = Graph(op)
    ins = [g.add_input(k, TensorType(a.shape, dtype)) for k, a in arrays.items()]
    g.outputs = list(g.add_node(op, ins, **attrs).outputs)
    opt = optimize(g, level)
    got = get_backend("numpy").run(opt, {k: opgraph.tensor(a) for k, a in arrays.items()})
    return [got[v.name] for v in opt.outputs]


@pytest.mark.parametrize("np_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("level", [0, 2])
def test_reduce_sum_and_mean_of_half_and_float_accumulate_in_float32_and_round_once(np_dtype, level):
    """x = [[2048, 1], [1, 1], [1, 1]]: the column sums are 2050 and 3 and the total 2053, all
    exact in float32; to float16 2053 rounds (a tie) to even, 2052 — one rounding at the end
    (float16 accumulation would give 2048). Every shape: keepdims or not, some axes or all."""
    x = np.array([[2048, 1], [1, 1], [1, 1]], np_dtype)
    dt = DataType.FLOAT16 if np_dtype is np.float16 else F32
    to = np.dtype(np_dtype).type
    third, sixth = np.float32(1 / 3), np.float32(1 / 6)  # the means' float32 scales
    cases = {("ReduceSum", (0,)): [to(2050), to(3)], ("ReduceSum", (0, 1)): to(np.float32(2053)),
             ("ReduceMean", (0,)): [to(np.float32(2050) * third), to(np.float32(3) * third)],
             ("ReduceMean", (0, 1)): to(np.float32(2053) * sixth)}
    assert to(np.float32(2053)) == (2052 if np_dtype is np.float16 else 2053)
    for (op, axes), want in cases.items():
        for keepdims in (False, True):
            want_arr = np.asarray(want, np_dtype)
            if keepdims:
                want_arr = want_arr.reshape((1, 2) if axes == (0,) else (1, 1))
            got, = _run_reduce(op, {"x": x}, dt, level, axes=axes, keepdims=keepdims)
            assert got.dtype == np_dtype and got.shape == want_arr.shape, (op, axes, keepdims)
            assert got.tobytes() == want_arr.tobytes(), (op, axes, keepdims)


@pytest.mark.parametrize("level", [0, 2])
def test_reductions_with_a_correction_divide_by_r_minus_it(level):
    """x = [0, 2], correction 1: mean 1, deviations ±1; the variance is (1 + 1)/(2 - 1) = 2
    (not 2/3 or 1), the standard deviation around mean [1, 1] (eps 0) sqrt(2) in float32."""
    x = np.float32([0, 2])
    var, mean = _run_reduce("ReduceVar", {"x": x}, F32, level, axes=(0,), correction=1)
    assert float(var) == 2.0 and float(mean) == 1.0
    std, = _run_reduce("ReduceStdWithMean", {"x": x, "m": np.float32([1, 1])}, F32, level,
                       axes=(0,), correction=1, invert=False, eps=0.0)
    assert std.view(np.uint32) == np.sqrt(np.float32(2)).view(np.uint32)


def test_a_mean_over_axis_0_of_a_0d_tensor_is_the_value():
    got, = _run_reduce("ReduceMean", {"x": np.float32(3.5)}, F32, 0, axes=(0,))
    assert got.shape == () and float(got) == 3.5


def test_reduce_mean_with_count_refuses_a_count_sum_of_another_shape():
    g = Graph()
    x, c = (g.add_input(k, TensorType((3, 2), F32)) for k in ("x", "c"))
    cs = g.add_input("cs", TensorType((3, 1), F32))
    with pytest.raises(L0Error, match="countSum"):
        g.add_node("ReduceMeanWithCount", [x, c, cs], axes=(0,))


def test_a_sum_over_no_axes_is_the_identity_bool_included():
    """ReduceSum with no axes is the identity (no kernel): a BOOL tensor stays BOOL at every
    level (it was typed INT64, while level 0 gave the bools and level 1 forwarded the input)."""
    x = np.array([True, False, True])
    g = Graph()
    s = g.add_node("ReduceSum", [g.add_input("x", TensorType((3,), DataType.BOOL))], axes=())
    assert s.outputs[0].dtype == DataType.BOOL
    for level in (0, 1, 2):
        got, = _run_reduce("ReduceSum", {"x": x}, DataType.BOOL, level, axes=())
        assert got.dtype == np.bool_ and got.tolist() == [True, False, True], level


def _odd_size1_stride(shape: tuple, dim: int) -> np.ndarray:
    """A C-contiguous float32 array of ``shape`` whose size-1 dim ``dim`` has a stride no
    layout would give it (never used to address an element)."""
    base = np.zeros(shape, np.float32)
    strides = list(base.strides)
    strides[dim] = 1 << 20
    return np.lib.stride_tricks.as_strided(base, shape, strides)


def test_chunks_with_every_dim_fixed_are_single_elements():
    assert [c[:2] for c in chunks((2, 3), limit=8, fixed=(0, 1))] == \
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_chunks_within_a_channel_need_min_run_elements_after_the_channel_itself():
    """16 channels of 8x8: 64 elements after the channel (< MIN_RUN = 1024), though the
    channels hold 1024 together: no chunking within channels."""
    big = np.zeros((2, 16, 8, 8), np.float32)
    assert per_block_dims(big.shape, [np.ones((1, 16, 1, 1), np.float32)], [big]) == ()
    big = np.zeros((2, 16, 32, 32), np.float32)
    assert per_block_dims(big.shape, [np.ones((1, 16, 1, 1), np.float32)], [big]) == (1,)


def test_a_size_1_dim_s_stride_does_not_decide_the_chunk_layout():
    """The layouts compare the strides of dims of more than one element only: a size-1 dim
    with any stride leaves a channel-major array channel-major and its rows one run."""
    odd = _odd_size1_stride((2, 3, 1, 2048), 2)
    assert per_block_dims(odd.shape, [np.ones((1, 3, 1, 1), np.float32)], [odd]) == (1,)
    rows = row_blocks(odd.shape, [np.ones((1, 3, 1, 1), np.float32)], [odd], 1 << 12, 1 << 12)
    assert rows is not None and rows[0] == 1


def test_the_channel_is_the_first_keepdims_sum_s_kept_dim_past_a_scalar_sum_and_a_view():
    """channel_split takes the channel from the first *keepdims* sum: a scalar sum before it
    (of a small input without the channel) and a view with a shape are not that sum; a view of
    a register without the channel is neither labelled nor renamed."""
    body = (Instr(op="sum", args=("in1",), dtype=F32),
            Instr(op="view", args=("in2",), dtype=F32, shape=(1, 6, 1)),
            Instr(op="mul", args=("in0", "t1"), dtype=F32),
            Instr(op="sum", args=("t2",), dtype=F32, shape=(1, 6, 1), over=(4, 6, 5)),
            Instr(op="mul", args=("t3", "t0"), dtype=F32),
            Instr(op="view", args=("t4",), dtype=F32, shape=(6,)),
            Instr(op="view", args=("in3",), dtype=F32, shape=(1, 1, 1)))  # (no channel in it)
    types = (TensorType((4, 6, 5), F32), TensorType((2,), F32), TensorType((6,), F32),
             TensorType((1,), F32))
    split = channel_split(body, types, ("t5", "t6"))
    assert split is not None
    assert (split.channels, split.in_axes, split.result_axes, split.summed) == \
        (6, (1, None, 0, None), (0, None), 120)
    assert split.renamed == (None, 1, None, 1, None, 0, None)


def test_a_full_size_view_of_an_input_stays_outside_the_fused_kernel():
    """(x·x) + x read through Reshape(x) to [6, 4]: the view moves nothing, so the kernel reads
    the input through it rather than taking it in as a per-element view. By hand: v² + v."""
    g = Graph("view")
    x = g.add_input("x", TensorType((2, 3, 4), F32))
    v = g.add_node("Reshape", [x], shape=(6, 4)).outputs[0]
    g.outputs = [g.add_node("Add", [g.add_node("Mul", [v, v]).outputs[0], v]).outputs[0]]
    opt = optimize(g, 2)
    assert [n.op for n in opt.nodes] == ["Reshape", "FusedElementwise"]
    assert all(i.op != "view" for i in opt.nodes[1].attrs.body)
    xs = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    got = get_backend("numpy").run(opt, {"x": opgraph.tensor(xs)})[opt.outputs[0].name]
    assert got.tolist() == (xs * xs + xs).reshape(6, 4).tolist()
    # one kernel of the two arithmetic nodes, which are then dead
    assert fuse_elementwise.run(g)[1].counts == {"fused": 1, "absorbed": 2, "dead": 2}


def test_pow_array_takes_its_path_from_the_exponent_s_own_size_by_default():
    """A one-element exponent of -0.5 is 1/sqrt(x) in float32 (two roundings: at 6 that is
    0x3ED105EB, where x**-0.5 rounded once is 0x3ED105EC); an exponent of two elements is
    element by element, x**2 and x**3."""
    x = np.float32([6, 7])
    special = np.float32(1) / np.sqrt(x)
    assert special.view(np.uint32)[0] == 0x3ED105EB
    assert np.array_equal(pow_array(x, np.float32(-0.5)).view(np.uint32), special.view(np.uint32))
    assert pow_array(np.float32([2, 3]), np.float32([2, 3])).tolist() == [4.0, 27.0]


def test_cast_array_float_to_float_integer_to_integer_and_bf16_to_integer():
    """float -> float rounds to nearest even; int64 -> uint64 is exact beyond 2**53 (no trip
    through float64); bfloat16 -> int truncates, saturates and maps NaN to 0, as float32 does."""
    assert cast_array(np.float32([1.5, 1 + 2 ** -11]), F16).tolist() == [1.5, 1.0]
    assert cast_array(np.int64([2 ** 53 + 1]), DataType.UINT64).tolist() == [2 ** 53 + 1]
    bf = np.array([np.nan, 1e10, -2.7], ml_dtypes.bfloat16)
    assert cast_array(bf, DataType.INT32).tolist() == [0, 2 ** 31 - 1, -2]


def _f16_body(*body: Instr, inputs: list) -> np.ndarray:
    """A float16 fused body (result: its last register) run by the numpy interpreter."""
    a = FusedAttrs(shape=inputs[0].shape, body=body, result=f"t{len(body) - 1}", out_dtype=F16)
    return run_fused(a, inputs)


def test_a_half_sqrt_and_an_integer_to_half_cast_round_to_half_before_the_next_step():
    """Every float16 step rounds its float32 result to float16, so the next step sees the
    rounded value: sqrt(27.34) (x, y as float16) times 0.882 is 4.613, where the unrounded
    sqrt would give 4.61; int32 2049 -> float16 is 2048 (a tie to even), plus 1 is 2049 -> 2048
    again, where an unrounded cast would give 2050."""
    x, y = np.float16([27.34, 4.58]), np.float16([0.882, 1.624])
    want = (np.sqrt(x.astype(np.float32)).astype(np.float16).astype(np.float32)
            * y.astype(np.float32)).astype(np.float16)  # numpy's float16 steps, by hand
    assert want.tolist() == [np.float16(4.613), np.float16(3.477)]
    got = _f16_body(Instr(op="sqrt", args=("in0",), dtype=F16),
                    Instr(op="mul", args=("t0", "in1"), dtype=F16), inputs=[x, y])
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    n = np.int32([2049, 2051])
    got = _f16_body(Instr(op="cast", args=("in0",), dtype=F16),
                    Instr(op="fill", dtype=F16, value=1.0),
                    Instr(op="add", args=("t0", "t1"), dtype=F16), inputs=[n])
    assert got.tolist() == [2048, 2052]  # 2048 + 1 -> 2048; 2052 + 1 -> 2052 (ties to even)


def test_channel_ranges_take_channels_without_elements_and_no_thread_count():
    assert channel_ranges(4, 0, 2, block_elems=8) == [(0, 2), (2, 4)]
    assert channel_ranges(4, 10, 0, block_elems=20) == [(0, 2), (2, 4)]


def test_a_chain_fuses_once_and_its_absorbed_nodes_seed_nothing():
    """Sub(Add(Mul(x, x), x), x): one kernel of the three; the absorbed Add and Mul are not
    seeds of kernels of their own afterwards (which would be dead copies of the same work)."""
    g = Graph("chain")
    x = g.add_input("x", TensorType((4, 5), F32))
    sq = g.add_node("Mul", [x, x]).outputs[0]
    g.outputs = [g.add_node("Sub", [g.add_node("Add", [sq, x]).outputs[0], x]).outputs[0]]
    new, stats = fuse_elementwise.run(g)
    assert stats.counts == {"fused": 1, "absorbed": 3, "dead": 3}
    assert [n.op for n in new.nodes] == ["FusedElementwise"]


def test_a_block_tail_shorter_than_the_lanes_folds_only_its_own_lanes():
    """32768 + 5 elements: one full block (zeros here), then a tail of five, whose five lanes
    fold as ((x0 + x3) + x2) + (x1 + x4) — 2 for [1e8, 1, 0, -1e8, 1] — not as 64 lanes
    padded with -0.0, which pairs them ((x0 + x4) + x2) + (x1 + x3), 0 in float32. The same
    as the loop model of the order (tests/sum_model.py); an empty sum is zeros."""
    x = np.zeros(32768 + 5, np.float32)
    x[32768:] = [1e8, 1, 0, -1e8, 1]
    assert float(ordered_sum(x, (0,))) == 2.0 == float(loop_sum(x))
    assert ordered_sum(np.zeros((3, 0), np.float32), (1,)).tolist() == [0.0, 0.0, 0.0]


def test_ordered_sums_of_pairs_across_a_leading_axis_and_of_many_rows_on_threads():
    """Two elements over axis 0 of a square: the pair is x[0] + x[1] per column, [4, 6] (the
    summed axis is not the last, though the rows' shape is the array's); 4 rows of 2**18 small
    integers (exact in float32 in any order) summed on the worker threads, each row its own."""
    assert ordered_sum(np.float32([[1, 2], [3, 4]]), (0,)).tolist() == [4.0, 6.0]
    x = np.random.default_rng(3).integers(0, 4, (4, 1 << 18)).astype(np.float32)
    assert ordered_sum(x, (1,)).tolist() == x.astype(np.int64).sum(axis=1).tolist()


def test_fuse_reductions_reports_what_it_fused_and_absorbed():
    """Two sums over (0, 2) of x and x*x: one FusedReduce of the three nodes, all then dead."""
    g = Graph()
    x = g.add_input("x", TensorType((4, 3, 5), F32))
    sq = g.add_node("Mul", [x, x]).outputs[0]
    g.outputs = [g.add_node("ReduceSum", [v], axes=(0, 2)).outputs[0] for v in (sq, x)]
    new, stats = fuse_reductions.run(g)
    assert [n.op for n in new.nodes] == ["FusedReduce"]
    assert stats.counts == {"fused": 1, "absorbed": 3, "dead": 3}
