"""Graph dumps: JSON round trips and rejection of malformed files (never executing anything), DOT
accepted by pydot / graphviz, and the networkx view."""
from __future__ import annotations

import builtins
import json
import re
import shutil
import subprocess
import uuid

import numpy as np
import networkx as nx
import pytest

import l0ops
from backends.numpy_backend import NumpyBackend
from opgraph import DataType, Graph, GraphError, TensorType
from opgraph.passes import optimize
from reference import BF16, F16, F32, assert_bits_equal, make_case
from test_graph import check_structure, record, recorded

try:  # optional: networkx reads DOT files through it
    import pydot
except ImportError:
    pydot = None

FLOAT = DataType.FLOAT

# --------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------
JSON_CASES = {
    "f32": dict(shape=(2, 3, 4), dtype=F32),
    "f16": dict(shape=(2, 3, 4), dtype=F16),
    "null-weight": dict(shape=(2, 3, 4), dtype=F16, weight=False),
    "rank2": dict(shape=(5, 3), dtype=F32),
    "bf16-counter-f16": dict(shape=(2, 3, 2), dtype=BF16, counter_dtype=F16, counter_shape=(2, 2)),
    "mixed-out": dict(shape=(2, 3, 4), dtype=F32, dtypes={"gradOut": F16}, out_dtype=BF16),
}


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("name", list(JSON_CASES))
def test_json_round_trip(name, soc):
    case = make_case(seed=5, **JSON_CASES[name])
    ex = record(case, soc, layouts={"input": "perm", "sumDy": "offset"})
    g = ex.graph
    text = g.to_json()
    raw = json.loads(text)
    assert raw["schema"] == "opgraph.graph" and raw["version"] == 1
    assert len(raw["nodes"]) == len(g.nodes) and [n["op"] for n in raw["nodes"]] == [n.op for n in g.nodes]
    g2 = Graph.from_json(text)
    assert g2 == g
    assert str(g2) == str(g)
    assert g2.to_json() == text
    assert Graph.from_json(text.encode()) == g
    check_structure(g2, case, soc)
    # the loaded graph computes the same bits as the reference
    out = ex.bindings["gradInput"]
    out.view()[...] = 0
    NumpyBackend().run(g2, ex.bindings)
    assert_bits_equal(out.numpy(), case.expected(soc))


def test_json_round_trip_of_empty_graph():
    case = make_case((0, 3, 4), F32)
    ex = record(case)
    assert ex.graph.nodes == []
    assert Graph.from_json(ex.graph.to_json()) == ex.graph


def _tiny() -> dict:
    g = Graph("tiny")
    x = g.add_input("x", TensorType((2,), FLOAT))
    g.outputs = [g.add_node("Cast", [x], to=DataType.FLOAT16).outputs[0]]
    return json.loads(g.to_json())


def _mut(fn):
    d = _tiny()
    fn(d)
    return json.dumps(d)


BAD_JSON = [
    ("truncated", '{"schema": "opgraph.graph", "version": 1, "name": ', "malformed"),
    ("not-json", "graph tiny { }", "malformed"),
    ("non-utf8", b"\xff\xfe{", "malformed"),
    ("array", "[]", "must be an object"),
    ("wrong-schema", _mut(lambda d: d.update(schema="torch.fx")), "not an opgraph graph"),
    ("no-schema", _mut(lambda d: d.pop("schema")), "not an opgraph graph"),
    ("version-2", _mut(lambda d: d.update(version=2)), "version"),
    ("version-str", _mut(lambda d: d.update(version="1")), "version"),
    ("missing-nodes", _mut(lambda d: d.pop("nodes")), "nodes"),
    ("extra-field", _mut(lambda d: d.update(code="print(1)")), "code"),
    ("nodes-not-list", _mut(lambda d: d.update(nodes=5)), "nodes"),
    ("bad-shape", _mut(lambda d: d["inputs"][0].update(shape="2")), "shape"),
    # type confusion is refused, not coerced (a JSON true read as the dim 1, "2" as 2)
    ("bool-dim", _mut(lambda d: d["inputs"][0].update(shape=[True])), "inputs.0.shape.0"),
    ("string-dim", _mut(lambda d: d["inputs"][0].update(shape=["2"])), "inputs.0.shape.0"),
    ("float-dim", _mut(lambda d: d["nodes"][0]["outputs"][0].update(shape=[2.0])), "shape.0"),
    ("version-true", _mut(lambda d: d.update(version=True)), "version"),
    ("version-float", _mut(lambda d: d.update(version=1.0)), "version"),
    ("bad-input-dtype", _mut(lambda d: d["inputs"][0].update(dtype="float17")), "dtype"),
    ("bad-value-name", _mut(lambda d: d["inputs"][0].update(name='x" -> evil')), "name"),
    ("unknown-op", _mut(lambda d: d["nodes"][0].update(op="Conv9D")), "unknown l0 op 'Conv9D'"),
    ("bad-attr-value", _mut(lambda d: d["nodes"][0]["attrs"].update(to="FLOAT17")), "node 0"),
    ("unknown-attr", _mut(lambda d: d["nodes"][0]["attrs"].update(bogus=1)), "bogus"),
    ("missing-attr", _mut(lambda d: d["nodes"][0].update(attrs={})), "to"),
    ("undefined-input", _mut(lambda d: d["nodes"][0].update(inputs=["y"])), "undefined value %y"),
    ("wrong-arity", _mut(lambda d: d["nodes"][0].update(inputs=["x", "x"])), "type-check"),
    ("type-mismatch", _mut(lambda d: d["nodes"][0]["outputs"][0].update(dtype="BF16")), "differs"),
    ("shape-mismatch", _mut(lambda d: d["nodes"][0]["outputs"][0].update(shape=[3])), "differs"),
    ("redefined", _mut(lambda d: d["nodes"][0]["outputs"][0].update(name="x")), "defined twice"),
    ("undefined-output", _mut(lambda d: d.update(outputs=["zz"])), "%zz"),
]


@pytest.mark.parametrize("text,match", [c[1:] for c in BAD_JSON], ids=[c[0] for c in BAD_JSON])
def test_bad_json_raises_graph_error(text, match):
    with pytest.raises(GraphError, match=re.escape(match)) as e:
        Graph.from_json(text)
    assert "\n" not in str(e.value), "one line per error"


def test_tiny_json_is_valid():
    """The base document of BAD_JSON loads (so each failure above is due to its mutation)."""
    g = Graph.from_json(json.dumps(_tiny()))
    assert [n.op for n in g.nodes] == ["Cast"]


def test_loading_never_executes_code(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    calls = []
    monkeypatch.setattr(builtins, "eval", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(builtins, "exec", lambda *a, **k: calls.append(a))
    for fn in (lambda d: d["nodes"][0].update(op=payload),
               lambda d: d["nodes"][0].update(op="__import__('os')"),
               lambda d: d["nodes"][0]["attrs"].update(to=payload),
               lambda d: d["inputs"][0].update(dtype=payload)):
        with pytest.raises(GraphError):
            Graph.from_json(_mut(fn))
    # a name is data: it loads and stays a string
    g = Graph.from_json(_mut(lambda d: d.update(name=payload)))
    assert g.name == payload
    assert not marker.exists() and calls == []


def _called(arg: dict) -> str:
    """The tiny graph as recorded by a call of ``aclnnDemo`` with ``x`` and ``arg``."""
    return _mut(lambda d: d.update(call={"api": "aclnnDemo", "args": [
        {"name": "x", "kind": "tensor", "value": "x"}, arg]}))


BAD_CALLS = [  # the recorded call is data a backend reads: a value must suit its kind
    ("tensor-dict", {"name": "y", "kind": "tensor", "value": {"a": [1]}}, "kind tensor"),
    ("double-str", {"name": "eps", "kind": "double", "value": "abc"}, "kind double"),
    ("double-bool", {"name": "eps", "kind": "double", "value": True}, "kind double"),
    ("int-float", {"name": "n", "kind": "int", "value": 1.5}, "kind int"),
    ("int-past-int64", {"name": "n", "kind": "int", "value": 2 ** 70}, "outside int64"),
    ("bool-int", {"name": "g", "kind": "bool", "value": 1}, "kind bool"),
    ("nul-name", {"name": "e\u0000", "kind": "double", "value": 1.0}, "call argument name"),
    ("empty-name", {"name": "", "kind": "double", "value": 1.0}, "call argument name"),
    # names a backend may spell in generated code (emit-cpp's call0_<name> variables)
    ("code-name", {"name": "x=0;system(0);int y", "kind": "double", "value": 1.0}, "identifier"),
    ("code-tensor", {"name": "y", "kind": "tensor", "value": "y;abort()"}, "kind tensor"),
]


@pytest.mark.parametrize("arg,match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_a_call_argument_must_suit_its_kind(arg, match):
    with pytest.raises(GraphError, match=re.escape(match)):
        Graph.from_json(_called(arg))


def test_good_call_arguments_load():
    g = Graph.from_json(_called({"name": "eps", "kind": "double", "value": "nan"}))
    assert g.call.kinds() == ("tensor", "double") and np.isnan(g.call.value("eps"))
    assert Graph.from_json(_called({"name": "y", "kind": "tensor", "value": None})).call.value("y") is None


@pytest.mark.parametrize("field,where", [("api", "call"), ("source", "node")])
@pytest.mark.parametrize("bad", ["a\ud800b", "a\u001b[2Jb"])
def test_call_api_and_node_source_are_checked(field, where, bad):
    """A lone surrogate would fail every later write (the ONNX export, an HTML page), an ESC
    would drive a terminal: refused on loading like names."""
    def put(d):
        if where == "call":
            d["call"] = {"api": bad, "args": []}
        else:
            d["nodes"][0]["source"] = bad
    with pytest.raises(GraphError, match=f"{where}.*not an identifier" if where == "call" else
                       f"{where}.*holds"):
        Graph.from_json(_mut(put))


@pytest.mark.parametrize("fn", [lambda d: d["nodes"][0].update(op="X" * 10 ** 6),
                                lambda d: d["nodes"][0].update(inputs=["y" * 10 ** 6]),
                                lambda d: d["nodes"][0]["attrs"].update({"z" * 10 ** 6: 1}),
                                lambda d: d.update(schema="s" * 10 ** 6)],
                         ids=["op", "input", "attr", "schema"])
def test_an_error_quoting_a_huge_value_is_short(fn):
    with pytest.raises(GraphError) as e:
        Graph.from_json(_mut(fn))
    assert len(str(e.value)) < 1100 and str(e.value).endswith("more characters)")


def test_errors_about_a_fused_node_are_one_line():
    """A fused node prints with its body on several lines; loading errors quote its header."""
    d = json.loads(optimize(recorded(), 2).to_json())
    fused = next(n for n in d["nodes"] if n["op"] == "FusedElementwise")
    out = fused["outputs"][0]
    dtype, out["dtype"] = out["dtype"], "INT8"
    with pytest.raises(GraphError, match="differs from the inferred") as e:
        Graph.from_json(json.dumps(d))
    assert "\n" not in str(e.value)
    out["dtype"] = dtype  # and now a store into an intermediate: a copy of gradInput
    copy = {"op": "Contiguous", "inputs": ["gradInput"], "attrs": {},
            "outputs": [dict(out, name="c", strides=None)]}
    d["nodes"].insert(0, copy)
    fused["inputs"][-1], out["strides"] = "c", None
    with pytest.raises(GraphError, match="not a user tensor") as e:
        Graph.from_json(json.dumps(d))
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# DOT
# --------------------------------------------------------------------------------------------
def _unescape(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s):
            nxt = s[i + 1]
            out.append({"n": "\n", '"': '"', "\\": "\\"}.get(nxt, "\\" + nxt))
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def dot_tokens(text: str) -> list[tuple[str, str]]:
    toks, i = [], 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c == '"':
            j, buf = i + 1, []
            while True:
                assert j < len(text), "unterminated string in DOT"
                if text[j] == "\\":
                    buf.append(text[j:j + 2])
                    j += 2
                    continue
                if text[j] == '"':
                    break
                assert text[j] != "\n", "raw newline inside a DOT string"
                buf.append(text[j])
                j += 1
            toks.append(("str", _unescape("".join(buf))))
            i = j + 1
        elif text.startswith("->", i):
            toks.append(("op", "->"))
            i += 2
        elif c in "{}[];,=":
            toks.append(("op", c))
            i += 1
        else:
            m = re.match(r"[A-Za-z0-9_.#-]+", text[i:])
            assert m, f"unexpected character {c!r} in DOT at {i}"
            toks.append(("id", m.group()))
            i += m.end()
    return toks


def parse_dot(text: str):
    """A structural DOT check: returns (graph name, declared node ids, edges)."""
    toks = dot_tokens(text)
    assert toks[0] == ("id", "digraph") and toks[1][0] in ("str", "id") and toks[2] == ("op", "{")
    assert toks[-1] == ("op", "}")
    depth = {"{": 0, "[": 0}
    for _, t in toks:
        if t in "{[":
            depth[t] += 1
        elif t == "}":
            depth["{"] -= 1
        elif t == "]":
            depth["["] -= 1
        assert depth["{"] >= 0 and depth["["] >= 0
    assert depth == {"{": 0, "[": 0}, "unbalanced braces"
    body, stmts, cur, inside = toks[3:-1], [], [], 0
    for tok in body:
        if tok == ("op", "["):
            inside += 1
        elif tok == ("op", "]"):
            inside -= 1
        if tok == ("op", ";") and not inside:
            stmts.append(cur)
            cur = []
        else:
            cur.append(tok)
    assert not cur, "statement without ';'"
    nodes, edges = set(), []
    for s in stmts:
        head = s[:s.index(("op", "["))] if ("op", "[") in s else s
        if ("op", "->") in head:
            assert len(head) == 3 and head[1] == ("op", "->"), head
            edges.append((head[0][1], head[2][1]))
        elif len(head) == 1 and head[0][1] not in ("node", "edge", "graph"):
            nodes.add(head[0][1])
        else:
            assert ("op", "=") in head or head[0][1] in ("node", "edge", "graph"), s
    return toks[1][1], nodes, edges


@pytest.mark.parametrize("kw", [{}, {"weight": False}, {"shape": (4, 5), "dtype": F16}])
def test_dot_is_well_formed(kw, tmp_path):
    g = recorded(**kw)
    text = g.to_dot()
    name, nodes, edges = parse_dot(text)
    assert name == g.name
    assert len(nodes) == len(g.inputs) + len(g.nodes) + len(g.outputs)
    assert len(edges) == sum(len(n.inputs) for n in g.nodes) + len(g.outputs)
    assert all(a in nodes and b in nodes for a, b in edges), "edge to an undeclared node"
    path = tmp_path / "g.dot"
    path.write_text(text)
    if pydot is not None:
        G = nx.drawing.nx_pydot.read_dot(str(path))
        assert G.number_of_edges() == len(edges)
    if shutil.which("dot"):
        r = subprocess.run(["dot", "-Tsvg", str(path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "<svg" in r.stdout


def test_dot_escapes_quotes_in_names(tmp_path):
    weird = 'my "quoted" graph \\ with {braces} -> and\nnewline'
    g = Graph(weird)
    x = g.add_input('x', TensorType((2,), FLOAT))
    g.outputs = [g.add_node("Cast", [x], to=DataType.FLOAT16).outputs[0]]
    text = g.to_dot()
    name, nodes, edges = parse_dot(text)
    assert name == weird
    assert len(nodes) == 3 and len(edges) == 2
    if shutil.which("dot"):
        path = tmp_path / "w.dot"
        path.write_text(text)
        r = subprocess.run(["dot", "-Tsvg", str(path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr


def test_dot_labels_ops_and_types():
    g = recorded()
    text = g.to_dot()
    vc = [ln for ln in text.splitlines() if "ViewCopy" in ln and "[shape=box" in ln]
    assert len(vc) == 1
    assert "f32[2,3,4]" in text and "arch=2201" in text


# --------------------------------------------------------------------------------------------
# networkx
# --------------------------------------------------------------------------------------------
def test_to_networkx_structure():
    g = recorded(weight=False)
    G = g.to_networkx()
    assert isinstance(G, nx.MultiDiGraph)
    assert G.number_of_nodes() == len(g.inputs) + len(g.nodes)
    assert G.number_of_edges() == sum(len(n.inputs) for n in g.nodes)
    assert nx.is_directed_acyclic_graph(G)
    k = next(i for i, n in enumerate(g.nodes) if n.op == "SyncBatchNormBackwardElemt")
    data = G.nodes[f"n{k}"]
    assert data["op"] == "SyncBatchNormBackwardElemt" and data["attrs"]["arch"] == 2201
    in_edges = sorted(G.in_edges(f"n{k}", keys=True, data=True), key=lambda e: e[2])
    assert [e[2] for e in in_edges] == list(range(7))
    assert [e[3]["value"] for e in in_edges] == [v.name for v in g.nodes[k].inputs]
    # the gradInput user tensor feeds exactly the ViewCopy
    assert [v for _, v in G.out_edges("in:gradInput")] == [f"n{len(g.nodes) - 1}"]
    assert "in:weight" not in G


def _mul_op():
    name = f"TestMul_{uuid.uuid4().hex[:8]}"
    return l0ops.define_op(
        name, num_inputs=2, kind="elementwise",
        infer=lambda ts, a: [ts[0].with_()],
        compute=lambda xs, a: [np.multiply(xs[0], xs[1])])


def test_to_networkx_has_one_edge_per_operand_use():
    Mul = _mul_op()
    g = Graph("sq")
    x = g.add_input("x", TensorType((3,), FLOAT))
    y = Mul(g, x, x)
    g.outputs = [Mul(g, y, x)]
    G = g.to_networkx()
    assert G.number_of_edges("in:x", "n0") == 2
    assert G.number_of_edges("in:x", "n1") == 1 and G.number_of_edges("n0", "n1") == 1
    assert G.number_of_edges() == 4
