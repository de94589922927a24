"""l0 ops at their edges, found by an audit of each op alone: attributes a builder must refuse
at ``add_node`` (an L0Error naming the op and the rule, not a numpy error in a pass or a
backend), and results that must keep level 0's bits at every level on numpy and native
(expected values from float64 / numpy formulas written here)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import opgraph
from backends import get as get_backend, native
from l0ops import L0Error
from l0ops.fused_reduce import FusedReduceAttrs
from l0ops.primitives import FusedAttrs, Instr
from opgraph import passes
from opgraph.core.dtypes import DataType
from opgraph.core.ir import Graph, TensorType

F, F16, BF16 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16
BACKENDS = ["numpy"] + (["native"] if native.available() else [])


def node(g: Graph, op: str, *args, **attrs):
    return g.add_node(op, list(args), **attrs).outputs[0]


def run(g: Graph, level: int, backend: str, arrays: dict) -> list[np.ndarray]:
    """The graph's outputs at ``level`` on ``backend``."""
    opt = passes.optimize(g, level)
    got = get_backend(backend).run(opt, {k: opgraph.tensor(np.array(v)) for k, v in arrays.items()})
    return [np.asarray(got[v.name]) for v in opt.outputs]


def raw(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("dtype, value", [
    (DataType.INT32, 1e10), (DataType.INT32, 2.0 ** 31), (DataType.INT8, 300.0),
    (DataType.INT8, -129.0), (DataType.UINT8, -1.0), (DataType.INT64, 2.0 ** 63),
    (DataType.INT32, float("nan")), (DataType.INT32, float("inf"))])
def test_fill_refuses_a_value_its_integer_dtype_cannot_hold(dtype, value):
    """An integer Fill of a value out of its dtype's range (NaN, inf) was recorded; level 0 then
    filled garbage (numpy's unsafe cast) and level 2 raised OverflowError / ValueError while
    compiling the fused body. Refused where it is built, as a hand-built fused fill is."""
    g = Graph("fill")
    with pytest.raises(L0Error, match=r"Fill: value .* does not convert to"):
        node(g, "Fill", shape=(2,), value=value, dtype=dtype)
    body = (Instr(op="fill", args=(), dtype=dtype, value=value),)
    with pytest.raises(L0Error, match=r"FusedElementwise: t0 .* does not convert to"):
        g.add_node("FusedElementwise", [], FusedAttrs(shape=(2,), body=body, result="t0",
                                                       out_dtype=dtype))


@pytest.mark.parametrize("dtype, value, want", [
    (DataType.INT8, 127.9, 127), (DataType.INT8, -128.5, -128), (DataType.UINT8, 255.0, 255),
    (DataType.INT32, -2.5, -2), (F16, 1e6, np.inf), (DataType.BOOL, 2.0, True)])
def test_fill_keeps_values_its_dtype_holds(dtype, value, want):
    g = Graph("fill")
    g.outputs = [node(g, "Fill", shape=(3,), value=value, dtype=dtype)]
    for backend in BACKENDS:
        for level in (0, 2):
            with np.errstate(over="ignore"):
                got = run(g, level, backend, {})[0]
            assert got.dtype == dtype.np and np.array_equal(got, np.full(3, want, dtype.np))


@pytest.mark.parametrize("shape", [(-1,), (2, -3), (2 ** 62, 2 ** 62), (1,) * 65])
def test_fill_refuses_a_shape_no_tensor_has(shape):
    """Fill(shape=(-1,)) was recorded as f32[-1] (numpy then failed at run time); an element
    count beyond int64 or a rank beyond numpy's likewise."""
    with pytest.raises(L0Error, match="Fill: shape"):
        node(Graph("fill"), "Fill", shape=shape, value=1.0, dtype=F)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [F16, BF16, F, DataType.INT32])
@pytest.mark.parametrize("value", [1 + 2 ** -11 + 2 ** -40, 1 + 2 ** -8 + 2 ** -40, 16777217.0, 0.1])
def test_convert_to_tensor_rounds_through_float32_at_every_level(value, dtype, backend):
    """ConvertToTensor holds the float32 scalar rounded to its dtype; fused (level 2), its
    expansion filled the double value rounded once to the dtype instead: 1 + 2^-11 + 2^-40 was
    1.0 in f16 at level 0 and 1.0009766 at level 2."""
    g = Graph("const")
    x = g.add_input("x", TensorType((3,), dtype))
    g.outputs = [node(g, "Mul", x, node(g, "ConvertToTensor", value=value, dtype=dtype))]
    with np.errstate(over="ignore"):  # float64 -> float32 (RNE) -> dtype (RNE)
        want = np.float32(value).astype(dtype.np)
    for level in (0, 1, 2):
        got = run(g, level, backend, {"x": np.ones(3, dtype.np)})[0]
        assert raw(got) == raw(np.full(3, want, dtype.np)), (level, got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, out", [(DataType.INT32, DataType.INT32),
                                        (DataType.BOOL, DataType.INT64)])
@pytest.mark.parametrize("axes", [(0,), (-1,)])
def test_integer_reduce_sum_of_a_0d_tensor(axes, dtype, out, backend):
    """ReduceSum over axis 0 of a 0-d integer tensor (its type infers as the tensor itself, as
    for floats) raised numpy's AxisError when it ran."""
    g = Graph("sum0d")
    x = g.add_input("x", TensorType((), dtype))
    g.outputs = [node(g, "ReduceSum", x, axes=axes)]
    assert str(g.outputs[0].type) == f"{out.short}[]"
    for level in (0, 1, 2):
        got = run(g, level, backend, {"x": np.array(1, dtype.np)})[0]
        assert got.dtype == out.np and got.shape == () and got == 1


@pytest.mark.parametrize("fmt", ["XX", None, 999])
def test_reformat_refuses_an_unknown_format_naming_the_op(fmt):
    """An unknown format was a bare ValueError ('unknown format ...') from the attribute
    model's constructor, naming neither the op nor the attribute."""
    g = Graph("reformat")
    x = g.add_input("x", TensorType((1, 3), F))
    with pytest.raises(L0Error, match="ReFormat: invalid attributes: format"):
        node(g, "ReFormat", x, format=fmt)
    assert str(node(g, "ReFormat", x, format="NC").type) == "f32[1,3]@NC"


def test_sub_refuses_bool_operands():
    """Sub of two BOOL tensors (and a fused body's sub of bool registers) was recorded, then
    numpy raised TypeError ('boolean subtract ... is not supported') at run time."""
    g = Graph("sub")
    a, b = (g.add_input(n, TensorType((4,), DataType.BOOL)) for n in "ab")
    with pytest.raises(L0Error, match="Sub: bool operands do not subtract"):
        node(g, "Sub", a, b)
    body = (Instr(op="sub", args=("in0", "in1"), dtype=DataType.BOOL),)
    with pytest.raises(L0Error, match="t0 .*: bool registers do not subtract"):
        g.add_node("FusedElementwise", [a, b], FusedAttrs(shape=(4,), body=body, result="t0",
                                                           out_dtype=DataType.BOOL))


@pytest.mark.parametrize("op", ["FusedElementwise", "FusedReduce"])
def test_a_sum_to_shape_empty_keeps_the_rank_of_what_it_sums(op):
    """A body's ``sum`` with shape=() of a [3] register type-checked as a scalar, but ran as a
    keepdims sum over no axis (the [3] register itself): the kernel then failed to broadcast
    [3] to its result. shape=() sums only a rank-0 register (shape None sums all elements)."""
    g = Graph("sum")
    x = g.add_input("x", TensorType((3,), F))

    def add(shape):
        body = (Instr(op="sum", args=("in0",), dtype=F, shape=shape),)
        if op == "FusedElementwise":
            return g.add_node(op, [x], FusedAttrs(shape=(1,), body=body, result="t0", out_dtype=F))
        return g.add_node(op, [x], FusedReduceAttrs(body=body, results=("t0",), out_shapes=((),)))
    with pytest.raises(L0Error, match=r"sum of \[3\] over \[3\] to \[\]"):
        add(())
    g.outputs = [add(None).outputs[0]]
    for backend in BACKENDS:
        got = run(g, 0, backend, {"x": np.float32([1, 2, 4])})[0]
        assert got.reshape(-1).tolist() == [7.0]


def _gather_fused_graph(W: int, C: int, cores: int) -> Graph:
    g = Graph("gather_fused")
    shapes = [(W, C), (W, C), (W,), (1, C), (1, C)]
    ins = [g.add_input(f"x{k}", TensorType(s, F)) for k, s in enumerate(shapes)]
    g.outputs = list(g.add_node("SyncBatchNormGatherStatsFused", ins, momentum=0.1, eps=1e-5,
                                cores=cores).outputs)
    return g


def test_gather_stats_fused_on_one_core_sums_in_order():
    """With cores=1 and more than 255 ranks the numpy kernel recursed for ever (one block of all
    W rows, split again: RecursionError); one core's block is the sequential sum. (The native
    kernel's twin of sum_rows overflows its stack the same way: reported, not run here.)"""
    W, C = 300, 3
    rng = np.random.default_rng(0)
    mean = rng.standard_normal((W, C)).astype(np.float32)
    arrays = {"x0": mean, "x1": np.ones((W, C), np.float32), "x2": np.full(W, 4, np.float32),
              "x3": np.zeros((1, C), np.float32), "x4": np.ones((1, C), np.float32)}
    want = np.zeros(C, np.float32)
    for n in range(W):  # Σ f32(f32(mean·count) / Σcount), row by row from 0
        want = want + (mean[n] * np.float32(4)) / np.float32(4 * W)
    got = run(_gather_fused_graph(W, C, 1), 0, "numpy", arrays)[0]
    assert raw(got) == raw(want.reshape(1, C))


@pytest.mark.parametrize("cores", [0, -1])
def test_gather_stats_kernels_refuse_no_cores(cores):
    """cores=0 raised ZeroDivisionError when the graph ran (SyncBatchNormGatherStatsFused) or
    was built (SyncBatchNormGatherStats' 950 tiling); a negative count was recorded."""
    with pytest.raises(L0Error, match=f"SyncBatchNormGatherStatsFused: cores must be at least 1, got {cores}"):
        _gather_fused_graph(2, 3, cores)
    g = Graph("gather")
    shapes = [((2, 3), F), ((2, 3), F), ((2,), DataType.INT32), ((3,), F), ((3,), F)]
    ins = [g.add_input(f"x{k}", TensorType(s, d)) for k, (s, d) in enumerate(shapes)]
    with pytest.raises(L0Error, match=f"SyncBatchNormGatherStats: cores must be at least 1, got {cores}"):
        g.add_node("SyncBatchNormGatherStats", ins, momentum=0.1, eps=1e-5, arch=3510, cores=cores)


@pytest.mark.parametrize("op, shapes, attrs", [
    ("ReduceStdWithMean", [(2, 3), (2, 3)], {"axes": (0,), "eps": 1e39}),
    ("BNInfer", [(1, 2, 1, 1)] * 5, {"eps": -1e39}),
    ("BatchNormV3", [(1, 2, 1, 1)] + [(2,)] * 4, {"eps": 1e39}),
    ("SyncBNTrainingUpdate", [(3,), (3,)], {"momentum": 1e39})])
def test_expanding_an_attribute_beyond_float32_warns_nothing(op, shapes, attrs):
    """An eps or momentum beyond float32's range (inf in float32, as the kernels take it):
    level-2 fusion expanded it with numpy's 'overflow encountered in cast' RuntimeWarning in
    phase 1, outside any errstate (an error under -W error)."""
    g = Graph("attr")
    ins = [g.add_input(f"x{k}", TensorType(s, F)) for k, s in enumerate(shapes)]
    g.outputs = [node(g, "Cast", g.add_node(op, ins, **attrs).outputs[0], to=F16)]  # (a group)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = passes.optimize(g, 2)
    assert any(n.op in ("FusedElementwise", "FusedReduce") for n in opt.nodes)
