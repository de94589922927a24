"""ONNX export for Netron: the model passes onnx.checker at every level, l0 ops sit in a custom
domain with typed values and mapped attributes, fused kernels are ONNX functions, and without
the onnx package the error says how to install it."""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest

import backends
import opgraph
from opgraph import passes
from opgraph.cli import main
from opgraph.core.onnx_export import DOMAIN_FUSED, DOMAIN_L0, DOMAIN_PRIM, OnnxUnavailable
from family import shipped_op_apis

onnx = pytest.importorskip("onnx", reason="pip install onnx (opgraph[onnx])")
OP = "aclnnBatchNormElemtBackward"
TP = onnx.TensorProto


def recorded(dtype=np.float16):
    x = np.linspace(-1, 1, 24).reshape(2, 3, 4).astype(dtype)
    c = lambda: opgraph.tensor(np.ones(3, dtype))  # noqa: E731
    st, _, ex = opgraph.aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
        opgraph.tensor(x), opgraph.tensor(x), c(), c(), c(), c(), c(),
        opgraph.tensor(np.full(3, 4, np.float32)), opgraph.tensor(np.zeros_like(x)))
    assert st == 0
    return ex.graph


def attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("level", [0, 1, 2])
def test_every_level_passes_the_checker_with_every_value_typed(level):
    g = passes.optimize(recorded(), level)
    model = g.to_onnx()
    onnx.checker.check_model(model, full_check=True)
    m = onnx.load_from_string(model.SerializeToString())  # survives the wire format
    assert [n.name for n in m.graph.node] == [f"%{n.outputs[0].name}" for n in g.nodes]
    typed = {v.name: v.type.tensor_type for v in [*m.graph.input, *m.graph.output, *m.graph.value_info]}
    for v in g.values():
        t = typed[v.name]
        assert [d.dim_value for d in t.shape.dim] == list(v.shape)
        assert t.elem_type == {"f16": TP.FLOAT16, "f32": TP.FLOAT, "s32": TP.INT32}[v.dtype.short]
    assert {i.domain for i in m.opset_import} >= {DOMAIN_L0}


def test_l0_ops_in_the_custom_domain_with_attributes_mapped():
    g = recorded()
    m = g.to_onnx()
    nodes = {n.name: n for n in m.graph.node}
    cast = nodes["%17"]
    assert (cast.op_type, cast.domain) == ("Cast", DOMAIN_L0)
    assert list(cast.input) == ["13"] and list(cast.output) == ["17"]
    assert attrs(cast) == {"to": b"f32"}
    assert attrs(nodes["%22"]) == {"dims": [0]}  # UnsqueezeNd dims: INTS
    assert attrs(nodes["%24"]) == {"shape": [2, 3, 4]}  # BroadcastTo
    assert attrs(nodes["%39"])["arch"] == 2201  # an INT
    assert attrs(nodes["%41"]) == {"redirect": 0}  # a bool as 0/1
    assert "recorded at opgraph/aclnn/batch_norm_elemt_backward.py:" in cast.doc_string
    assert "writes user tensor %gradInput" in nodes["%41"].doc_string


def test_fused_kernel_is_an_onnx_function_of_primitives():
    g = passes.optimize(recorded(), 2)
    (node,) = g.nodes
    m = g.to_onnx()
    (fn,) = m.functions
    (onode,) = m.graph.node
    assert (onode.op_type, onode.domain) == (fn.name, DOMAIN_FUSED) and fn.domain == DOMAIN_FUSED
    assert len(fn.input) == len(onode.input) == len(node.inputs)
    body = node.attrs.body
    assert [n.op_type for n in fn.node] == [i.op for i in body] + ["store"]
    assert all(n.domain == DOMAIN_PRIM for n in fn.node)
    assert list(fn.node[-1].input) == [node.attrs.result, "dst"] and list(fn.output) == ["out"]
    views = [(n, i) for n, i in zip(fn.node, body) if i.op == "view"]
    assert views and all(attrs(n)["shape"] == list(i.shape) for n, i in views)


def test_bfloat16_maps_to_onnx_bfloat16():
    m = recorded(ml_dtypes.bfloat16).to_onnx()
    assert m.graph.input[0].type.tensor_type.elem_type == TP.BFLOAT16


def test_without_onnx_the_error_says_how_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(OnnxUnavailable, match=r"pip install onnx"):
        recorded().to_onnx()
    out = tmp_path / "g.onnx"
    assert main(["dump", OP, "--format", "onnx", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("opgraph: error: --format onnx:") and "pip install onnx" in err
    assert err.count("\n") == 1 and not out.exists()


def test_cli_dump_format_onnx(capsys, tmp_path):
    out = tmp_path / "g.onnx"
    assert main(["dump", OP, "--shape", "2,3,4", "--level", "1", "--format", "onnx", "-o", str(out)]) == 0
    m = onnx.load(str(out))
    onnx.checker.check_model(m)
    assert m.graph.node[-1].op_type == "ViewCopy" and m.graph.name == OP
    assert main(["dump", OP, "--format", "onnx"]) == 2  # binary: not to the terminal
    assert "give -o FILE.onnx" in capsys.readouterr().err


def _family_graphs():
    """(op_api, SoC) for every op_api opgraph ships, on both SoC families."""
    for spec in shipped_op_apis():
        for soc in ("Ascend910B", "Ascend950"):
            if soc in spec.platforms:
                yield pytest.param(spec.name, soc, id=f"{spec.name}-{soc}")


@pytest.mark.parametrize("name, soc", list(_family_graphs()))
def test_every_op_api_exports_at_every_level(name, soc, tmp_path):
    """Every level of every op_api passes the checker; a fused reduction is a function with one
    output per result (its sums keep their ``over`` shape)."""
    for level in (0, 1, 2):
        path = tmp_path / f"{level}.onnx"
        assert main(["dump", name, "--platform", soc, "--level", str(level), "--format", "onnx",
                     "-o", str(path)]) == 0
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)
        for node in model.graph.node:
            if node.domain == DOMAIN_FUSED:
                (fn,) = [f for f in model.functions if f.name == node.op_type]
                assert len(fn.output) == len(node.output)
                returns = [n for n in fn.node if n.op_type in ("return", "store")]
                assert [o for n in returns for o in n.output] == list(fn.output)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean"])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_a_0d_reduction_runs_and_exports_at_every_level(op, level):
    """Axis 0 of a 0-d tensor is the tensor itself (as numpy and torch take it): the mean's
    count is 1 (it indexed the empty shape), and the fused body's empty ``over`` exports."""
    g = opgraph.Graph("zero_d")
    x = g.add_input("x", opgraph.TensorType((), opgraph.DataType.FLOAT))
    g.outputs = [g.add_node(op, [x], axes=(0,), keepdims=False).outputs[0]]
    opt = passes.optimize(g, level)
    model = onnx.load_from_string(opt.to_onnx().SerializeToString())
    onnx.checker.check_model(model)
    got = backends.get("numpy").run(opt, {"x": opgraph.tensor(np.array(3.5, np.float32))})
    assert [float(got[v.name]) for v in opt.outputs] == [3.5]
