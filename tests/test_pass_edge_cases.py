"""Valid graphs a fuzz of the passes crashed on or mis-shaped, each at levels 0/1/2 on numpy
and native, against values worked out by hand: constants folded from 0-d Fills, 0-d results
(fused kernels and Contiguous made them 1-d), a mean over no elements (NaN, not
ZeroDivisionError), a view of a broadcast (or of arithmetic on one) inside a fused group, a
fused store between one-element shapes that differ, and a fused reduction of constants only
(no input for the native call)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import opgraph
from backends import get as get_backend, native
from opgraph import passes
from opgraph.core.dtypes import DataType, Format
from opgraph.core.ir import Graph, TensorType

F = DataType.FLOAT
BACKENDS = ["numpy"] + (["native"] if native.available() else [])


def node(g: Graph, op: str, *args, **attrs):
    return g.add_node(op, list(args), **attrs).outputs[0]


def folded_0d_fills():
    g = Graph("fold")
    g.add_input("x", TensorType((), F))
    a, b = (node(g, "Fill", shape=(), value=v, dtype=F) for v in (2.0, 3.0))
    g.outputs = [node(g, "Add", a, b), node(g, "Mul", a, b)]
    return g, {"x": np.float32(1)}, [np.float32(5), np.float32(6)]


def zero_d_results():
    g = Graph("zero_d")
    a, b = (g.add_input(n, TensorType((), F)) for n in "ab")
    d = node(g, "Sub", a, b)
    g.outputs = [d, node(g, "BroadcastTo", node(g, "Add", d, d), shape=())]
    return g, {"a": np.float32(5), "b": np.float32(2)}, [np.float32(3), np.float32(6)]


def mean_of_nothing():
    g = Graph("empty_mean")
    x = g.add_input("x", TensorType((0, 3), F))
    g.outputs = [node(g, "ReduceMean", x, axes=(0,))]
    return g, {"x": np.zeros((0, 3), np.float32)}, [np.full(3, np.nan, np.float32)]


def view_of_a_broadcast():
    g = Graph("view_of_broadcast")
    x, y = g.add_input("x", TensorType((2, 1), F)), g.add_input("y", TensorType((2, 3), F))
    flat = node(g, "Reshape", node(g, "BroadcastTo", x, shape=(2, 3)), shape=(6,))
    g.outputs = [node(g, "Mul", flat, node(g, "Reshape", y, shape=(6,)))]
    return g, {"x": np.float32([[1], [2]]), "y": np.full((2, 3), 3, np.float32)}, \
        [np.float32([3, 3, 3, 6, 6, 6])]


def sum_of_a_view_of_a_broadcast():
    """The same view of a broadcast feeding a reduction: reduction fusion took the BroadcastTo
    in too (L0Error: the view does not fit its unbroadcast operand)."""
    g = Graph("sum_of_view_of_broadcast")
    c = g.add_input("c", TensorType((1,), F))
    flat = node(g, "Reshape", node(g, "BroadcastTo", c, shape=(4,)), shape=(-1,))
    g.outputs = [node(g, "ReduceSum", flat, axes=(0,), keepdims=True)]
    return g, {"c": np.float32([2.5])}, [np.float32([10])]


def view_of_arithmetic_on_a_broadcast_sum():
    """A view of Mul(BroadcastTo(sum), c): the reduction's kernel took the chain in, and its
    body viewed a one-element register as [2, 2] (L0Error; the group was left unfused). The
    Mul, fused with the broadcast, is left out of the reduction's kernel."""
    g = Graph("view_of_broadcast_sum")
    x, c = g.add_input("x", TensorType((4,), F)), g.add_input("c", TensorType((), F))
    total = node(g, "ReduceSum", x, axes=(0,), keepdims=True)
    g.outputs = [node(g, "Reshape", node(g, "Mul", node(g, "BroadcastTo", total, shape=(4,)), c),
                      shape=(2, 2))]
    return g, {"x": np.float32([1, 2, 3, 4]), "c": np.float32(0.5)}, [np.full((2, 2), 5, np.float32)]


def view_of_arithmetic_on_a_broadcast():
    """Reshape(Mul(BroadcastTo(x), …)) read by an elementwise seed: inside a body the Mul is as
    large as x, which the view cannot reshape (L0Error in elementwise fusion; fuzzer seed 408).
    The Mul is left out of the seed's kernel and fused with the broadcast on its own."""
    g = Graph("view_of_broadcast_mul")
    x, y = g.add_input("x", TensorType((1, 3), F)), g.add_input("y", TensorType((6,), F))
    b = node(g, "BroadcastTo", x, shape=(2, 3))
    g.outputs = [node(g, "Add", y, node(g, "Reshape", node(g, "Mul", b, b), shape=(6,)))]
    return g, {"x": np.float32([[1, 2, 3]]), "y": np.arange(6, dtype=np.float32)}, \
        [np.float32([1, 5, 11, 4, 8, 14])]


def sum_of_a_view_of_arithmetic_on_a_broadcast():
    """A reduction's group reaching a view of Mul(BroadcastTo(sum), c) that another kernel also
    reads (so elementwise fusion left the Mul alone): inside the body the Mul is one element,
    which the view cannot reshape (L0Error; the group was left unfused, reduction fuzzer seed
    401). The Mul is left out of the group, which fuses without it."""
    g = Graph("sum_of_view_of_broadcast_mul")
    x, y = g.add_input("x", TensorType((8,), F)), g.add_input("y", TensorType((8,), F))
    total = node(g, "ReduceSum", x, axes=(0,), keepdims=True)
    scaled = node(g, "Mul", node(g, "BroadcastTo", total, shape=(8,)),
                  node(g, "Fill", shape=(), value=0.5, dtype=F))
    g.outputs = [node(g, "Add", y, scaled),
                 node(g, "ReduceSum", node(g, "Reshape", scaled, shape=(2, 4)), axes=(0, 1))]
    return g, {"x": np.arange(8, dtype=np.float32), "y": np.ones(8, np.float32)}, \
        [np.full(8, 15, np.float32), np.float32(112)]


def view_inside_a_fused_member_of_a_reduction():
    """A reduction's group reaching a fused kernel whose own body views its operand, here
    Cast(Reshape(Cast(BroadcastTo(mean)))), the inner Cast also a result: inside the group's
    body the operand is one element, which the inner view cannot reshape (L0Error; the group was
    left unfused, reduction fuzzer big seed 8). The kernel that makes the operand is left out."""
    g = Graph("view_inside_a_fused_member")
    x = g.add_input("x", TensorType((8,), F))
    mean = node(g, "ReduceMean", x, axes=(0,), keepdims=True)
    half = node(g, "Cast", node(g, "BroadcastTo", mean, shape=(8,)), to=DataType.FLOAT16)
    g.outputs = [half, node(g, "Cast", node(g, "Reshape", half, shape=(2, 4)), to=F)]
    return g, {"x": np.arange(8, dtype=np.float32)}, \
        [np.full(8, 3.5, np.float16), np.full((2, 4), 3.5, np.float32)]


def integer_mean_over_no_axes():
    """A fused reduction whose result is its integer input (a mean over no axes): the native
    backend's prologue looked the result up among its float registers (KeyError 'in0'); it runs
    such a body on numpy."""
    g = Graph("int_mean_no_axes")
    x = g.add_input("x", TensorType((2, 3), DataType.INT32))
    g.outputs = [node(g, "ReduceMean", x, axes=(), keepdims=True)]
    return g, {"x": np.arange(6, dtype=np.int32).reshape(2, 3)}, \
        [np.arange(6, dtype=np.int32).reshape(2, 3)]


def store_between_one_element_shapes():
    g = Graph("one_element_store")
    x, out = g.add_input("x", TensorType((1, 1, 1), F)), g.add_input("out", TensorType((1, 1), F))
    g.outputs = [g.add_node("ViewCopy", [node(g, "Add", node(g, "Mul", x, x), x), out]).outputs[0]]
    return g, {"x": np.float32([[[3]]]), "out": np.zeros((1, 1), np.float32)}, [np.float32([[12]])]


def reduction_of_constants():
    g = Graph("constant_sum")
    g.add_input("x", TensorType((1,), F))
    g.outputs = [node(g, "ReduceSum", node(g, "Fill", shape=(3,), value=1.5, dtype=F), axes=(0,),
                      keepdims=True)]
    return g, {"x": np.float32([0])}, [np.float32([4.5])]


def contiguous_0d():
    g = Graph("contiguous_0d")
    x = g.add_input("x", TensorType((), DataType.BF16))
    same = node(g, "Contiguous", x)
    g.outputs = [same, node(g, "Cast", same, to=F)]
    return g, {"x": np.array(2.5, ml_dtypes.bfloat16)}, [np.array(2.5, ml_dtypes.bfloat16), np.float32(2.5)]


CASES = [folded_0d_fills, zero_d_results, contiguous_0d, mean_of_nothing, view_of_a_broadcast,
         sum_of_a_view_of_a_broadcast, view_of_arithmetic_on_a_broadcast_sum,
         view_of_arithmetic_on_a_broadcast, sum_of_a_view_of_arithmetic_on_a_broadcast,
         view_inside_a_fused_member_of_a_reduction, integer_mean_over_no_axes, store_between_one_element_shapes, reduction_of_constants]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_edge_graphs_run_at_every_level(case, level, backend):
    g, arrays, want = case()
    opt = passes.optimize(g, level)
    got = get_backend(backend).run(opt, {k: opgraph.tensor(np.array(v)) for k, v in arrays.items()})
    for v, w in zip(opt.outputs, want):
        r = np.asarray(got[v.name])
        assert r.shape == w.shape and r.dtype == w.dtype, (v.name, r.shape, w.shape)
        assert np.array_equal(r, w, equal_nan=True), (v.name, r, w)


def _scalar_broadcast_chain():
    """Fuzzer seed 408, minimised: a 0-d input broadcast twice, multiplied, viewed flat."""
    g = Graph("scalar_broadcast_chain")
    s, z = g.add_input("s", TensorType((), F)), g.add_input("z", TensorType((64,), F))
    b1, b2 = (node(g, "BroadcastTo", s, shape=(2, 4, 8)) for _ in range(2))
    flat = node(g, "Reshape", node(g, "Mul", s, node(g, "Mul", b1, b2)), shape=(-1,))
    g.outputs = [node(g, "RealDiv", z, flat)]
    return g


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("build, kernels", [
    (lambda: view_of_arithmetic_on_a_broadcast()[0], ["FusedElementwise"] * 2),
    (_scalar_broadcast_chain, ["FusedElementwise"] * 2),
    (lambda: sum_of_a_view_of_arithmetic_on_a_broadcast()[0],
     ["FusedReduce", "FusedElementwise", "FusedReduce"]),
    (lambda: view_inside_a_fused_member_of_a_reduction()[0],
     ["FusedReduce", "FusedElementwise", "FusedElementwise"])],
    ids=["broadcast_mul", "scalar_chain", "sum", "fused_member"])
def test_view_of_arithmetic_on_a_broadcast_fuses_with_level_0_bits(build, kernels, backend):
    """Level 2 fuses a view of a value computed from a broadcast (elementwise fusion raised
    L0Error; reduction fusion left the group unfused) and keeps level 0's bits, specials
    included."""
    g = build()
    opt = passes.optimize(g, 2)
    assert [n.op for n in opt.nodes if n.opdef.kind != "view"] == kernels
    rng = np.random.default_rng(0)
    arrays = {}
    for v in g.inputs:
        a = (rng.standard_normal(v.type.numel) * 3).astype(np.float32)
        a[:4] = np.float32([np.nan, np.inf, -0.0, 1e-30])[:a.size]
        arrays[v.name] = a.reshape(v.shape)
    run = lambda o, k: np.asarray(get_backend(backend).run(
        o, {n: opgraph.tensor(a.copy()) for n, a in arrays.items()})[o.outputs[k].name])
    for k in range(len(g.outputs)):
        want, got = run(passes.optimize(g, 0), k), run(opt, k)
        assert want.dtype == got.dtype and want.shape == got.shape
        assert np.array_equal(want.reshape(-1).view(np.uint8), got.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_results_keep_their_format_tag(backend):
    """Values tagged NCHW (their input's format) replaced by fused kernels' results: the results
    keep the tag, so the nodes reading them infer the types they recorded (PassErrors at level
    2 before, in elementwise and in reduction fusion; a helper's fuzz)."""
    g = Graph("formats")
    c = g.add_input("c", TensorType((1, 3, 1, 1), F, format=Format.NCHW))
    x = g.add_input("x", TensorType((2, 3, 2, 2), F, format=Format.NCHW))
    w = g.add_input("w", TensorType((2, 3, 2, 1), F))
    v = g.add_input("v", TensorType((2, 3, 2, 2), F))
    scaled = node(g, "Mul", c, node(g, "Fill", shape=(), value=0.1, dtype=F))  # c·0.1 into w
    g.add_node("ViewCopy", [node(g, "BroadcastTo", scaled, shape=(2, 3, 2, 1)), w])
    squares = g.add_node("BNTrainingReduce", [x], shape=(1, 3, 1, 1)).outputs[1]  # Σx² into v
    g.add_node("ViewCopy", [node(g, "BroadcastTo", squares, shape=(2, 3, 2, 2)), v])
    mean = g.add_node("ReduceVar", [v], axes=(0, 2, 3), keepdims=True).outputs[1]
    g.add_node("ViewCopy", [node(g, "BroadcastTo", squares, shape=(2, 3, 2, 2)), v])
    g.outputs = [c, mean]
    opt = passes.optimize(g, 2)
    assert {"FusedElementwise", "FusedReduce"} <= {n.op for n in opt.nodes}
    cs = np.float32([1, 2, 3]).reshape(1, 3, 1, 1)
    xs = np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2)
    sq = (xs * xs).sum(axis=(0, 2, 3), keepdims=True)  # small integers: exact in any order
    arrays = {"c": cs, "x": xs, "w": np.zeros((2, 3, 2, 1), np.float32),
              "v": np.zeros((2, 3, 2, 2), np.float32)}
    got = get_backend(backend).run(opt, {k: opgraph.tensor(a) for k, a in arrays.items()})
    assert np.array_equal(np.asarray(got[opt.outputs[1].name]), sq)
    assert np.array_equal(arrays["w"], np.broadcast_to(cs * np.float32(0.1), (2, 3, 2, 1)))
    assert np.array_equal(arrays["v"], np.broadcast_to(sq, (2, 3, 2, 2)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_constant_folding_keeps_values_a_fill_cannot_hold(backend):
    """Folding a 0-d node of Fills made a Fill of float(value): (2**27 + 1)**2 in int64 came
    out 2**54 + 2**28 at level 2 (1 lost), and a cast to complex raised TypeError in the pass.
    Such nodes stay as they are."""
    g = Graph("fold_int64")
    a = node(g, "Fill", shape=(), value=float(2 ** 27 + 1), dtype=DataType.INT64)
    c = node(g, "Cast", node(g, "Fill", shape=(), value=1.5, dtype=F), to=DataType.COMPLEX64)
    g.outputs = [node(g, "Mul", a, a), c, node(g, "Add", a, a)]
    want = [np.int64((2 ** 27 + 1) ** 2), np.complex64(1.5), np.int64(2 ** 28 + 2)]
    for level in (0, 1, 2):
        opt = passes.optimize(g, level)
        got = get_backend(backend).run(opt, {})
        for v, w in zip(opt.outputs, want):
            r = np.asarray(got[v.name])
            assert r.dtype == w.dtype and r.shape == () and r == w, (level, v.name, r, w)
    assert [n.op for n in passes.optimize(g, 2).nodes].count("Fill") == 3  # Add(a, a) folded


def test_constant_folding_keeps_a_format_tag():
    """A ReFormat of a Fill folded to a Fill: the graph output f32[2,3,2,2]@NCHW came out of
    level 2 as f32[2,3,2,2] (ND), the tag the other passes keep (a Fill has none)."""
    g = Graph("fold_format")
    tagged = node(g, "ReFormat", node(g, "Fill", shape=(2, 3, 2, 2), value=1.5, dtype=F),
                  format=Format.NCHW)
    g.outputs = [tagged, node(g, "Cast", tagged, to=DataType.FLOAT16)]
    opt = passes.optimize(g, 2)
    assert [str(v.type) for v in opt.outputs] == ["f32[2,3,2,2]@NCHW", "f16[2,3,2,2]@NCHW"]
    for backend in BACKENDS:
        got = get_backend(backend).run(opt, {})
        assert np.array_equal(np.asarray(got[opt.outputs[0].name]), np.full((2, 3, 2, 2), 1.5, np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("identity", ["Cast", "ReduceSum"])
def test_identity_of_a_strided_input_is_not_forwarded_to_views(identity, backend):
    """An identity Cast (or ReduceSum over no axes) of a strided input, read by UnsqueezeNd and
    Reshape: level-1 pruning forwarded the strided input to the views, which refuse it (a
    PassError at levels 1 and 2). Only contiguous operands are forwarded."""
    g = Graph("strided_identity")
    x = g.add_input("x", TensorType((2, 3), F, strides=(1, 2)))
    attrs = {"to": F} if identity == "Cast" else {"axes": ()}
    same = node(g, identity, x, **attrs)
    up = node(g, "UnsqueezeNd", same, dims=(0,))
    g.outputs = [node(g, "Mul", up, up), node(g, "Reshape", same, shape=(6,))]
    logical = np.float32([[0, 2, 4], [1, 3, 5]])  # storage 0..5 read with strides (1, 2)
    for level in (0, 1, 2):
        opt = passes.optimize(g, level)
        t = opgraph.Tensor(np.arange(6, dtype=np.float32), (2, 3), (1, 2))
        got = get_backend(backend).run(opt, {"x": t})
        assert np.array_equal(np.asarray(got[opt.outputs[0].name]), (logical * logical)[None])
        assert np.array_equal(np.asarray(got[opt.outputs[1].name]), logical.reshape(6))
