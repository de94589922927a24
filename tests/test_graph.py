"""The recorded graph (reference §5.5 emission order, promote type), the IR checks (verify) and
user-defined l0 ops. Dumps (JSON, DOT, networkx) are tested in test_dumps.py."""
from __future__ import annotations

import inspect

import json
import re
import uuid

import numpy as np
import pytest

import l0ops
import opgraph
from backends.numpy_backend import NumpyBackend
from l0ops import OpAttrs
from l0ops.basic import CastAttrs
from l0ops.reduce import ReduceAttrs
from opgraph.core.opapi import Param
from opgraph import DataType, Graph, GraphError, TensorType, aclnn
from opgraph.core.ir import Value

from reference import BF16, F16, F32, NAMES, make_case, to_tensors

FLOAT = DataType.FLOAT


def record(case, soc="Ascend910B", layouts=None, out=None):
    """Phase 1 only; returns the executor."""
    out = opgraph.tensor(np.zeros(case.input.shape, case.out_dtype)) if out is None else out
    with opgraph.platform(soc):
        st, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*to_tensors(case, layouts), out)
    assert st == 0, aclnn.aclGetRecentErrMsg()
    return ex


def expected_ops(rank: int, null_weight: bool) -> list[str]:
    ops = ["Fill"] if null_weight else []
    ops += ["Contiguous"] * 8 + ["Cast"] * 7
    ops += ["Cast", "ReduceSum", "Cast", "Cast", "Cast", "RealDiv", "RealDiv"]
    per_param = ["UnsqueezeNd"] + (["UnsqueezeNd"] if rank > 2 else []) + ["BroadcastTo"]
    ops += per_param * 5
    ops += ["Cast", "Cast", "SyncBatchNormBackwardElemt", "Cast", "ViewCopy"]
    return ops


def check_structure(g: Graph, case, soc: str = "Ascend910B") -> DataType:
    """Walk the recorded graph against reference §5.5; returns the promote type found."""
    shape, C, rank = case.input.shape, case.input.shape[1], case.input.ndim
    null_weight = case.weight is None
    assert [n.op for n in g.nodes] == expected_ops(rank, null_weight)
    names = [n for n in NAMES if not (n == "weight" and null_weight)] + ["gradInput"]
    assert [v.name for v in g.inputs] == names
    inp = {v.name: v for v in g.inputs}
    it = iter(g.nodes)
    if null_weight:
        fill = next(it)
        assert fill.inputs == []
        assert (fill.attrs.shape, fill.attrs.value, fill.attrs.dtype) == ((C,), 1.0, FLOAT)
        inp["weight"] = fill.outputs[0]
    contig = {}
    for n in NAMES:  # Contiguous in the order gradOut, input, mean, invstd, weight, sumDy, sumDyXmu, counter
        node = next(it)
        assert node.inputs == [inp[n]], f"Contiguous #{len(contig)} should read {n}: {node}"
        contig[n] = node.outputs[0]
    all_f16 = all(np.dtype(a.dtype) == F16 for a in case.arrays()[:7] if a is not None) and not null_weight
    promote = DataType.FLOAT16 if all_f16 else FLOAT
    cast = {}
    for n in NAMES[:7]:
        node = next(it)
        assert node.inputs == [contig[n]] and node.attrs.to == promote, str(node)
        cast[n] = node.outputs[0]
    # MeanByCounter
    c_cnt = next(it)
    assert c_cnt.inputs == [contig["counter"]] and c_cnt.attrs.to == FLOAT
    red = next(it)
    assert red.inputs == [c_cnt.outputs[0]]
    assert tuple(red.attrs.axes) == tuple(range(case.counter.ndim)) and red.attrs.keepdims is False
    assert red.outputs[0].shape == ()
    c_sdy, c_sdyx, c_tot = next(it), next(it), next(it)
    assert c_sdy.inputs == [cast["sumDy"]] and c_sdyx.inputs == [cast["sumDyXmu"]]
    assert c_tot.inputs == [red.outputs[0]]
    assert all(c.attrs.to == FLOAT for c in (c_sdy, c_sdyx, c_tot))
    d1, d2 = next(it), next(it)
    assert d1.inputs == [c_sdy.outputs[0], c_tot.outputs[0]]
    assert d2.inputs == [c_sdyx.outputs[0], c_tot.outputs[0]]
    assert d1.outputs[0].type.dtype == FLOAT and d1.outputs[0].shape == (C,)
    # broadcasts: mean, invstd, weight, meanDy, meanDyXmu
    bcast = []
    for src in (cast["mean"], cast["invstd"], cast["weight"], d1.outputs[0], d2.outputs[0]):
        u = next(it)
        assert u.inputs == [src] and tuple(u.attrs.dims) == (0,)
        v = u.outputs[0]
        assert v.shape == (1, C)
        if rank > 2:
            u2 = next(it)
            assert u2.inputs == [v] and tuple(u2.attrs.dims) == tuple(range(2, rank))
            v = u2.outputs[0]
            assert v.shape == (1, C) + (1,) * (rank - 2)
        b = next(it)
        assert b.inputs == [v] and tuple(b.attrs.shape) == shape and b.outputs[0].shape == shape
        bcast.append(b.outputs[0])
    cm1, cm2 = next(it), next(it)
    assert cm1.inputs == [bcast[3]] and cm2.inputs == [bcast[4]]
    assert cm1.attrs.to == promote and cm2.attrs.to == promote
    k = next(it)
    assert k.inputs == [cast["gradOut"], cast["input"], bcast[0], bcast[1], bcast[2],
                        cm1.outputs[0], cm2.outputs[0]]
    assert all(v.dtype == promote and v.shape == shape for v in k.inputs)
    arch = {"Ascend910B": 2201, "Ascend910_93": 2201, "Ascend950": 3510, "Ascend910": 1001}[soc]
    assert k.attrs.arch == arch
    assert k.outputs[0].dtype == promote and k.outputs[0].shape == shape
    last_cast = next(it)
    assert last_cast.inputs == [k.outputs[0]]
    assert last_cast.attrs.to == opgraph.dtype_of(case.out_dtype)
    vc = next(it)
    assert vc.inputs == [last_cast.outputs[0], inp["gradInput"]]
    assert g.outputs == [vc.outputs[0]]
    return promote


# --------------------------------------------------------------------------------------------
# emission order
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4), (2, 3, 2, 2), (1, 2, 1, 1, 1, 1, 1, 2)])
@pytest.mark.parametrize("null_weight", [False, True])
@pytest.mark.parametrize("lvl", [0, 2])
def test_emission_order(shape, null_weight, lvl):
    case = make_case(shape, F32, weight=not null_weight, counter_shape=(2, 2))
    with opgraph.opt_level(lvl):
        ex = record(case)
    check_structure(ex.graph, case)
    ex.graph.verify()


@pytest.mark.parametrize("soc", ["Ascend950", "Ascend910_93", "Ascend910"])
def test_emission_order_on_other_platforms(soc):
    case = make_case((2, 3, 4), F16)
    check_structure(record(case, soc).graph, case, soc)


def test_strided_inputs_are_recorded_with_strides():
    case = make_case((2, 3, 4), F32)
    ex = record(case, layouts={"input": "perm", "mean": "step"})
    check_structure(ex.graph, case)
    inp = {v.name: v for v in ex.graph.inputs}
    assert not inp["input"].type.is_contiguous and inp["input"].type.strides is not None
    assert inp["mean"].type.strides == (2,)
    assert inp["gradOut"].type.is_contiguous


def test_counter_cast_and_reduce_for_multidim_counter():
    case = make_case((2, 3), F32, counter_shape=(2, 1, 3), counter_dtype=F16)
    g = record(case).graph
    check_structure(g, case)
    red = [n for n in g.nodes if n.op == "ReduceSum"][0]
    assert tuple(red.attrs.axes) == (0, 1, 2)


def test_recorded_graph_uses_no_kernel_for_free_nodes():
    """Contiguous of contiguous tensors, same-dtype Casts and UnsqueezeNd are free (reference §10.7);
    Cast(counter), ReduceSum, RealDiv×2, BroadcastTo×5 and the kernel are not."""
    g = record(make_case((2, 3, 4), F32)).graph
    kernels = [n.op for n in g.nodes if not n.opdef.is_free(n) and n.op != "ViewCopy"]
    assert sorted(kernels) == sorted(["Cast", "ReduceSum", "RealDiv", "RealDiv"] + ["BroadcastTo"] * 5
                                     + ["SyncBatchNormBackwardElemt"])


# --------------------------------------------------------------------------------------------
# promote type via the recorded graph
# --------------------------------------------------------------------------------------------
PROMOTE_CASES = [
    ("all-f16", dict(dtype=F16), DataType.FLOAT16, F16),
    ("f16-null-weight", dict(dtype=F16, weight=False), FLOAT, F16),
    ("all-f32", dict(dtype=F32), FLOAT, F32),
    ("all-bf16", dict(dtype=BF16), FLOAT, BF16),
    ("f16-except-sumDyXmu", dict(dtype=F16, dtypes={"sumDyXmu": F32}), FLOAT, F16),
    ("f16-except-weight-bf16", dict(dtype=F16, dtypes={"weight": BF16}), FLOAT, F16),
    ("f16-data-f32-params", dict(dtype=F32, dtypes={"gradOut": F16, "input": F16}), FLOAT, F16),
    ("f32-in-f16-out", dict(dtype=F32, out_dtype=F16), FLOAT, F16),
    ("f16-in-f32-out", dict(dtype=F16, out_dtype=F32), DataType.FLOAT16, F32),
    ("bf16-in-f16-out", dict(dtype=BF16, out_dtype=F16), FLOAT, F16),
]


@pytest.mark.parametrize("kw,promote,out", [c[1:] for c in PROMOTE_CASES], ids=[c[0] for c in PROMOTE_CASES])
def test_promote_type_in_recorded_graph(kw, promote, out):
    case = make_case((2, 3, 4), **kw)
    assert case.out_dtype == out
    g = record(case).graph
    assert check_structure(g, case) is promote
    casts = [n for n in g.nodes if n.op == "Cast"]
    assert len(casts) == 7 + 4 + 2 + 1
    assert [c.attrs.to for c in casts[:7]] == [promote] * 7
    k = next(n for n in g.nodes if n.op == "SyncBatchNormBackwardElemt")
    assert {v.dtype for v in k.inputs} == {promote}
    assert casts[-1].attrs.to == opgraph.dtype_of(out) and casts[-1].inputs[0].dtype == promote


# --------------------------------------------------------------------------------------------
# text dump
# --------------------------------------------------------------------------------------------
def test_text_dump_lists_every_node_typed():
    case = make_case((2, 3, 4), F16)
    g = record(case).graph
    text = str(g)
    lines = text.splitlines()
    assert lines[0].startswith("graph aclnnBatchNormElemtBackward(%gradOut: f16[2,3,4], %input: f16[2,3,4]")
    assert lines[-1] == "}" and lines[-2].startswith("  return %")
    assert len(lines) == len(g.nodes) + 3
    assert re.search(r"= SyncBatchNormBackwardElemt\(%\w+, .*arch=2201\)", text)
    assert "%counter: s32[2]" in lines[0]
    assert any(re.fullmatch(r"  %\w+: f32\[\] = ReduceSum\(%\w+, axes=\[0\]\)", ln) for ln in lines)


# --------------------------------------------------------------------------------------------
# verify(): passes on recorded graphs, fails on corrupted ones
# --------------------------------------------------------------------------------------------
def recorded(weight=True, shape=(2, 3, 4), dtype=F32, soc="Ascend910B"):
    return record(make_case(shape, dtype, weight=weight), soc).graph


@pytest.mark.parametrize("kw", [{}, {"weight": False}, {"shape": (4, 5)}, {"dtype": F16},
                                {"soc": "Ascend950"}, {"dtype": BF16}])
def test_verify_passes_on_recorded_graphs(kw):
    g = recorded(**kw)
    assert g.verify() is g
    assert g.copy().verify() == g


def _node(g, op, k=0):
    return [n for n in g.nodes if n.op == op][k]


def corrupt_type(g):
    v = _node(g, "RealDiv").outputs[0]
    v.type = v.type.with_(dtype=DataType.FLOAT16)


def corrupt_order(g):
    k = _node(g, "SyncBatchNormBackwardElemt")
    g.nodes.remove(k)
    g.nodes.insert(0, k)


def corrupt_op(g):
    _node(g, "BroadcastTo").op = "NoSuchOp"


def corrupt_arity(g):
    _node(g, "SyncBatchNormBackwardElemt").inputs.pop()


def corrupt_users(g):
    n = _node(g, "ReduceSum")
    n.inputs[0].users.remove(n)


def corrupt_duplicate(g):
    _node(g, "Cast", 3).outputs[0].name = _node(g, "Cast", 1).outputs[0].name


def corrupt_output(g):
    g.outputs = [Value("nowhere", TensorType((2, 3, 4), FLOAT))]


def corrupt_attrs(g):
    b = _node(g, "BroadcastTo")
    b.attrs = b.opdef.make_attrs(shape=(2, 3, 5))


CORRUPTIONS = [
    (corrupt_type, "differ"), (corrupt_order, "before it is defined"), (corrupt_op, "NoSuchOp"),
    (corrupt_arity, "type-check"), (corrupt_users, "users"), (corrupt_duplicate, "defined twice"),
    (corrupt_output, "nowhere"), (corrupt_attrs, "BroadcastTo"),
]


@pytest.mark.parametrize("corrupt,match", CORRUPTIONS, ids=[c[0].__name__ for c in CORRUPTIONS])
def test_verify_fails_on_corrupted_graphs(corrupt, match):
    g = recorded().copy()
    g.verify()
    corrupt(g)
    with pytest.raises(GraphError, match=match):
        g.verify()


def test_verify_rejects_a_write_to_an_intermediate():
    g = Graph("bad-write")
    x = g.add_input("x", TensorType((3,), FLOAT))
    a = g.add_node("Cast", [x], to=DataType.FLOAT16).outputs[0]
    b = g.add_node("Cast", [x], to=DataType.FLOAT16).outputs[0]
    g.outputs = [g.add_node("ViewCopy", [a, b]).outputs[0]]
    with pytest.raises(GraphError, match="not a user tensor"):
        g.verify()


def test_verify_error_quotes_the_node():
    g = recorded().copy()
    corrupt_type(g)
    with pytest.raises(GraphError) as e:
        g.verify()
    assert "RealDiv(%" in str(e.value)


def test_add_node_type_checks():
    g = Graph("g")
    x = g.add_input("x", TensorType((3,), FLOAT))
    y = g.add_input("y", TensorType((3,), DataType.FLOAT16))
    with pytest.raises(ValueError, match="RealDiv"):
        g.add_node("RealDiv", [x, y])
    with pytest.raises(GraphError, match="defined twice"):
        g.add_input("x", TensorType((3,), FLOAT))


# --------------------------------------------------------------------------------------------
# user-defined l0 ops
# --------------------------------------------------------------------------------------------
class AxpyAttrs(OpAttrs):
    alpha: float


AXPY = f"TestAxpy_{uuid.uuid4().hex[:8]}"
Axpy = l0ops.define_op(
    AXPY, attrs=AxpyAttrs, num_inputs=2, kind="elementwise",
    infer=lambda ts, a: [ts[0].with_()],
    compute=lambda xs, a: [(xs[0] * xs[0].dtype.type(a.alpha) + xs[1]).astype(xs[0].dtype)],
    doc="alpha·x + y")


@aclnn.op_api("aclnnTestAxpy", params=(Param("x", "tensor", "input"), Param("y", "tensor", "input"),
                                        Param("out", "tensor", "output")), aclnn_api=None)
def axpy_api(ex, x, y, out):
    aclnn.check_not_null(x=x, y=y, out=out)
    vx = l0ops.Contiguous(ex, ex.input("x", x))
    vy = l0ops.Contiguous(ex, ex.input("y", y))
    z = Axpy(ex, vx, vy, alpha=2.0)
    ex.output(l0ops.ViewCopy(ex, l0ops.Cast(ex, z, to=out.dtype), ex.input("out", out)))


def test_user_op_runs_on_the_numpy_backend():
    g = Graph("axpy")
    x = g.add_input("x", TensorType((3,), FLOAT))
    y = g.add_input("y", TensorType((3,), FLOAT))
    o = g.add_input("o", TensorType((3,), DataType.FLOAT16))
    z = Axpy(g, x, y, alpha=2.0)
    g.outputs = [l0ops.ViewCopy(g, l0ops.Cast(g, z, to="float16"), o)]
    g.verify()
    assert f"{AXPY}(%x, %y, alpha=2.0)" in str(g)
    out = np.zeros(3, np.float16)
    NumpyBackend().run(g, {"x": opgraph.tensor(np.float32([1, 2, 3])),
                           "y": opgraph.tensor(np.float32([10, 20, 30])), "o": opgraph.tensor(out)})
    assert out.tolist() == [12.0, 24.0, 36.0]
    assert Graph.from_json(g.to_json()) == g


@pytest.mark.parametrize("lvl", [0, 1, 2])
def test_user_op_api_two_phase(lvl):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = np.full((2, 3), 0.5, np.float32)
    out = np.zeros((3, 2), np.float16).T  # a transposed (non-contiguous) output
    with opgraph.opt_level(lvl):
        st, ws, ex = axpy_api(opgraph.tensor(x.T.copy().T), opgraph.tensor(y), opgraph.tensor(out))
    assert st == 0, aclnn.aclGetRecentErrMsg()
    assert [n.op for n in ex.graph.nodes] == ["Contiguous", "Contiguous", AXPY, "Cast", "ViewCopy"]
    assert aclnn.run_executor(bytearray(ws) if ws else None, ws, ex) == 0
    assert out.tolist() == [[0.5, 2.5, 4.5], [6.5, 8.5, 10.5]]
    st, _, _ = axpy_api(None, opgraph.tensor(y), opgraph.tensor(out))
    assert st == 161001 and "x" in aclnn.aclGetRecentErrMsg()


def test_user_op_api_is_registered_with_its_real_signature():
    assert "aclnnTestAxpy" in aclnn.op_apis()
    spec = aclnn.get_op_api("aclnnTestAxpy")
    assert spec.get_workspace_size is axpy_api and [p.name for p in spec.tensor_params("output")] == ["out"]
    assert list(inspect.signature(axpy_api).parameters) == ["x", "y", "out"]
    assert axpy_api.__name__ == "axpy_api"
    with pytest.raises(ValueError, match="differ from the declared"):
        aclnn.op_api("aclnnTestBad", params=(Param("x", "tensor", "input"),))(lambda ex, y: None)


def test_define_op_rejects_duplicates_and_bad_kinds():
    with pytest.raises(ValueError, match="already defined"):
        l0ops.define_op(AXPY, infer=lambda ts, a: ts, compute=lambda xs, a: xs)
    with pytest.raises(ValueError, match="kind"):
        l0ops.define_op(f"TestBad_{uuid.uuid4().hex[:8]}", kind="magic",
                        infer=lambda ts, a: ts, compute=lambda xs, a: xs)
    with pytest.raises(KeyError, match="unknown l0 op"):
        l0ops.get_op("NoSuchOp")
    with pytest.raises(ValueError, match="alpha"):
        Axpy(Graph(), Value("x", TensorType((1,), FLOAT)), Value("y", TensorType((1,), FLOAT)))


def test_builtin_ops_are_registered():
    ops = l0ops.all_ops()
    for name in ("Contiguous", "Cast", "ReduceSum", "RealDiv", "UnsqueezeNd", "BroadcastTo", "Fill",
                 "ViewCopy", "SyncBatchNormBackwardElemt"):
        assert name in ops
    assert ops["ViewCopy"].has_effects and not ops["Cast"].has_effects


@pytest.mark.parametrize("level", [0, 1, 2])
def test_json_is_standard_with_non_finite_floats_and_round_trips(level):
    """eps=inf (the call and its attributes) and Fill values of ±inf and NaN, at every level
    (fused bodies too): the file parses as standard JSON (no bare NaN or Infinity, which
    JavaScript's JSON.parse and jq refuse) and loads back to the same floats."""
    x = opgraph.tensor(np.ones((2, 3, 4), np.float32))
    mean, invstd = (opgraph.tensor(np.zeros(3, np.float32)) for _ in range(2))
    with opgraph.opt_level(level):
        st, _, ex = opgraph.aclnn.aclnnBatchNormStatsGetWorkspaceSize(x, float("inf"), mean, invstd)
    assert st == 0
    g = ex.graph if level == 0 else ex.compiled
    g.call = ex.graph.call
    for v in (float("inf"), float("-inf"), float("nan")):
        g.add_node("Fill", [], shape=(2,), value=v, dtype=DataType.FLOAT)
    text = g.to_json()

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    json.loads(text, parse_constant=refuse)
    back = opgraph.Graph.from_json(text)
    assert back.to_json() == text
    assert dict((n, v) for n, _, v in back.call.args)["eps"] == float("inf")
    fills = [n.attrs.value for n in back.nodes if n.op == "Fill"][-3:]
    assert fills[:2] == [float("inf"), float("-inf")] and np.isnan(fills[2])


def test_add_node_refuses_what_is_not_the_ops_naming_it():
    """Attributes of another op's model raised AttributeError in its inference ('CastAttrs'
    object has no attribute 'axes') or were recorded (Mul(..., to=f16)); an operand that is
    not a value raised AttributeError; an unknown op a KeyError. Each is now refused where the
    node is added, naming the op."""
    g = Graph("bad")
    x = g.add_input("x", TensorType((2, 3), DataType.FLOAT))
    for op, ins, attrs, want in [("Cast", [x], ReduceAttrs(axes=(0,)), "CastAttrs, got ReduceAttrs"),
                                 ("ReduceSum", [x], CastAttrs(to=DataType.FLOAT16), "ReduceAttrs, got Cast"),
                                 ("Mul", [x, x], CastAttrs(to=DataType.FLOAT16), "OpAttrs, got CastAttrs")]:
        with pytest.raises(l0ops.L0Error, match=f"{op}: attributes must be {want}"):
            g.add_node(op, ins, attrs)
    with pytest.raises(l0ops.L0Error, match="Mul: input 1 is not a graph value: str"):
        g.add_node("Mul", [x, "x"])
    with pytest.raises(GraphError, match="unknown l0 op 'NoSuchOp'"):
        g.add_node("NoSuchOp", [x])
    assert g.nodes == []


@pytest.mark.parametrize("op,field,bad,want", [
    ("ReduceSum", "keepdims", "false", "valid boolean"),     # lax pydantic read it as False
    ("ReduceSum", "keepdims", 0, "valid boolean"),
    ("ReduceSum", "axes", ["1"], "axes.0: Input should be a valid integer"),
    ("Fill", "value", "1e3", "valid number"),                # only inf, -inf and nan are strings
    ("Fill", "shape", [2.0], "valid integer"),
])
def test_json_attributes_are_read_strictly(op, field, bad, want):
    """A graph file's attributes must have their fields' types: lax validation read the string
    "false" as False and ["1"] as axes (1,), so a hand-edited file meant something else than
    it said. The error names the node, the field and what it got; the written file loads."""
    g = Graph("strict")
    x = g.add_input("x", TensorType((2, 3), FLOAT))
    if op == "ReduceSum":
        g.outputs = [g.add_node("ReduceSum", [x], axes=(1,), keepdims=True).outputs[0]]
    else:
        g.outputs = [g.add_node("Fill", [], shape=(2,), value=float("-inf"), dtype=FLOAT).outputs[0]]
    raw = json.loads(g.to_json())
    assert Graph.from_json(json.dumps(raw)) == g
    raw["nodes"][0]["attrs"][field] = bad
    with pytest.raises(GraphError, match=f"node 0: {op}: invalid attributes: .*{want}.*got"):
        Graph.from_json(json.dumps(raw))
