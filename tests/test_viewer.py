"""The HTML viewer without a browser: the page's data (what the script draws), styling of what
costs what, provenance, pass diffs, per-node times, both layout engines (dot hidden for the
fallback), and ``opgraph view`` (the browser tests are in test_viewer_browser.py)."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import types

import numpy as np
import pytest

import opgraph
from opgraph import passes
from opgraph.cli import main
from passnames import pass_stems, stem
from opgraph.core import layout as layout_mod
from opgraph.core.graphdiff import diff_nodes
from opgraph.core.html import Panel, Tab, diff_tab, panel_data, render_html
from opgraph.core.layout import Box, Link, LayoutUnavailable, layout

OP = "aclnnBatchNormElemtBackward"
HAVE_DOT = shutil.which("dot") is not None
HAVE_GRANDALF = importlib.util.find_spec("grandalf") is not None
ENGINES = [pytest.param("dot", marks=pytest.mark.skipif(not HAVE_DOT, reason="install graphviz")),
           pytest.param("grandalf", marks=pytest.mark.skipif(
               not HAVE_GRANDALF, reason="pip install grandalf (opgraph[viz])"))]


def recorded(shape=(2, 3, 1, 4), dtype=np.float16):
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    c = lambda: opgraph.tensor(np.ones(shape[1], dtype))  # noqa: E731
    out = np.zeros_like(x)
    st, _, ex = opgraph.aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
        opgraph.tensor(x), opgraph.tensor(x), c(), c(), c(), c(), c(),
        opgraph.tensor(np.full(shape[1], 4, np.int32)), opgraph.tensor(out))
    assert st == 0
    return ex.graph


def page_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="graph-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def fused_attrs(g):
    (node,) = [n for n in g.nodes if n.op == "FusedElementwise"]
    return node.attrs


def nodes_of(panel: dict, kind: str = "op") -> list[dict]:
    return [n for n in panel["nodes"] if n["kind"] == kind]


# --- the page ------------------------------------------------------------------------------------
def test_page_is_self_contained_with_no_external_url():
    page = passes.optimize(recorded(), 2).to_html()
    assert page.startswith("<!DOCTYPE html>")
    for bad in ("://", "src=", "href=", "@import", "url(http", "<link"):
        assert bad not in page, bad
    assert "<script>" in page and "<style>" in page  # inline script and stylesheet


@pytest.mark.parametrize("level", [0, 1, 2])
def test_one_drawn_node_per_graph_node_and_edges_typed(level):
    g = passes.optimize(recorded(), level)
    panel = page_data(g.to_html())["tabs"][0]["panels"][0]
    ops = nodes_of(panel)
    assert [n["key"] for n in ops] == [n.outputs[0].name for n in g.nodes]
    assert len(nodes_of(panel, "input")) == len(g.inputs) and len(nodes_of(panel, "output")) == 1
    uses = sum(len(n.inputs) for n in g.nodes) + len(g.outputs)
    assert len(panel["edges"]) == uses
    labels = {e["label"] for e in panel["edges"] if e["label"]}
    assert "f16[2,3,1,4]" in labels or "write f16[2,3,1,4]" in labels
    for e in panel["edges"]:  # drawn top-down: every edge ends below where it starts
        assert e["pts"][-1][1] > e["pts"][0][1]


def test_kernels_free_nodes_writes_and_fused_are_styled_apart():
    g0, g1, g2 = (passes.optimize(recorded(), n) for n in (0, 1, 2))
    by_op = lambda g: {n["info"]["op"] + n["key"]: n for n in nodes_of(  # noqa: E731
        page_data(g.to_html())["tabs"][0]["panels"][0])}
    p0, p1 = by_op(g0), by_op(g1)
    assert "free" in p0["Contiguous0"]["cls"] and "kernel" in p0["ReduceSum16"]["cls"]
    assert "free" in p0["Cast8"]["cls"]  # identity cast f16 -> f16
    assert "kernel" in p0["Cast17"]["cls"]  # f16 -> f32 is a launch
    view_copy = p0["ViewCopy41"]  # a real copy into the user tensor at level 0
    assert {"kernel", "writes"} <= set(view_copy["cls"]) and view_copy["info"]["writes"] == ["%gradInput"]
    redirected = p1["ViewCopy41"]  # level 1: redirected, no kernel, still writes gradInput
    assert {"free", "writes", "redirect"} <= set(redirected["cls"])
    assert "redirected" in redirected["info"]["cost"]
    panel2 = page_data(g2.to_html())["tabs"][0]["panels"][0]
    (fused,) = nodes_of(panel2)
    assert "fused" in fused["cls"] and "writes" in fused["cls"]
    body = fused["body"]
    assert body[0] == "in0 = %counter: s32[3]" and body[-1] == f"store {fused_attrs(g2).result}"
    assert any(line.startswith(f"{fused_attrs(g2).result}: f16 = mul(") for line in body)
    written = [n for n in nodes_of(panel2, "input") if "written" in n["cls"]]
    assert [n["key"] for n in written] == ["in:gradInput"]  # the written user tensor stands out
    assert [e["cls"] for e in panel2["edges"] if e["label"].startswith("write")] == ["write"]


def test_nodes_carry_op_attributes_types_and_recording_line():
    g = recorded()
    panel = page_data(g.to_html())["tabs"][0]["panels"][0]
    cast = next(n for n in nodes_of(panel) if n["key"] == "17")
    info = cast["info"]
    assert info["op"] == "Cast" and info["attrs"] == [["to", "f32"]]
    assert info["inputs"] == [["%13", "f16[3]", "Cast"]] and info["outputs"] == [["%17", "f32[3]"]]
    path, line = info["source"].rsplit(":", 1)
    assert path == "opgraph/aclnn/batch_norm_elemt_backward.py"
    src = open(path).read().splitlines()[int(line) - 1]
    assert "Cast(" in src  # the op_api line that recorded this node
    assert json.loads(g.to_json())["nodes"][17]["source"] == info["source"]  # also in the JSON


def test_pass_diff_marks_added_removed_rewritten_and_rewired():
    g = recorded()
    before = passes.optimize(g, 0)
    after, _ = passes.PassManager([passes.identities]).run(before)
    d = diff_nodes(before, after)
    assert "0" in d.removed and "8" in d.removed  # Contiguous(%gradOut), identity Cast
    assert "39" in d.rewired  # the kernel now reads %gradOut directly
    assert set(d.added) == {"42", "43", "44", "45", "46"}  # merged UnsqueezeNd chains
    tab = diff_tab("p", "01-prune-identities", before, after)
    data = page_data(render_html([tab]))
    b, a = data["tabs"][0]["panels"]
    assert (b["caption"], a["caption"]) == ("before", "after")
    assert {n["key"] for n in nodes_of(b) if "removed" in n["cls"]} == set(d.removed)
    assert {n["key"] for n in nodes_of(a) if "added" in n["cls"]} == set(d.added)
    assert {n["key"] for n in nodes_of(a) if "rewired" in n["cls"]} == set(d.rewired)
    k39 = next(n for n in nodes_of(a) if n["key"] == "39")
    assert k39["info"]["was"].startswith("%39: f16[2,3,1,4] = SyncBatchNormBackwardElemt(%8, %9,")
    redirected, _ = passes.PassManager([passes.identities, passes.viewcopy_redirect]).run(before)
    assert diff_nodes(after, redirected).rewritten == ["41"]  # redirect=True: attrs changed


def test_times_are_shown_per_node_with_their_share():
    g = passes.optimize(recorded(), 1)
    times = {n.outputs[0].name: 1e-6 * (i + 1) for i, n in enumerate(g.nodes)}
    panel = page_data(g.to_html(times=times))["tabs"][0]["panels"][0]
    total = sum(times.values())
    for n in nodes_of(panel):
        assert n["info"]["time"] == f"{times[n['key']] * 1e6:.1f} µs"
        assert n["heat"] == pytest.approx(times[n["key"]] / total)


def test_text_is_escaped_not_markup():
    g = recorded().copy()  # the executor cache keeps the recorded graph: change a copy
    g.name = "</script><script>alert(1)</script>"
    page = g.to_html()
    assert "<script>alert(1)" not in page and page.count("</script>") == 2
    assert page_data(page)["title"] == g.name


def test_render_rejects_bad_tabs():
    g = recorded()
    with pytest.raises(ValueError, match="at least one tab"):
        render_html([])
    with pytest.raises(ValueError, match="unique"):
        render_html([Tab("a", "a", [Panel(g)]), Tab("a", "b", [Panel(g)])])
    with pytest.raises(ValueError, match="selected tab 'zz'"):
        render_html([Tab("a", "a", [Panel(g)])], selected="zz")


# --- layout ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_layout_engines_place_boxes_apart_and_top_down(engine):
    boxes = [Box("a", 90, 30), Box("b", 60, 30), Box("c", 70, 45), Box("d", 50, 20)]
    links = [Link("a", "b", "f32[2]"), Link("a", "c"), Link("b", "c", "x"), Link("a", "c", "again")]
    p = layout(boxes, links, engine)
    assert p.engine == engine and len(p.edges) == len(links) == len(p.labels)
    y = {k: v[1] for k, v in p.nodes.items()}
    assert y["a"] < y["b"] < y["c"]
    size = {b.id: b for b in boxes}
    for i, a in enumerate(boxes):  # no two boxes overlap
        for b in boxes[i + 1:]:
            (xa, ya), (xb, yb) = p.nodes[a.id], p.nodes[b.id]
            assert (abs(xa - xb) >= (size[a.id].width + size[b.id].width) / 2 - 1
                    or abs(ya - yb) >= (size[a.id].height + size[b.id].height) / 2 - 1)
    for k, b in size.items():  # inside the drawing
        x, yy = p.nodes[k]
        assert b.width / 2 <= x <= p.width - b.width / 2 and b.height / 2 <= yy <= p.height - b.height / 2
    assert p.labels[1] is None and p.labels[0] is not None


def test_fallback_layout_without_dot(monkeypatch):
    if not HAVE_GRANDALF:
        pytest.skip("pip install grandalf (opgraph[viz]) for the fallback layout")
    real = shutil.which
    monkeypatch.setattr(layout_mod.shutil, "which", lambda name, *a, **k: None if name == "dot" else real(name, *a, **k))
    assert layout_mod.default_engine() == "grandalf"
    g = passes.optimize(recorded(), 1)
    page = g.to_html()
    data = page_data(page)
    assert 'data-layout="grandalf"' in page and data["tabs"][0]["panels"][0]["engine"] == "grandalf"
    assert len(nodes_of(data["tabs"][0]["panels"][0])) == len(g.nodes)


def test_no_layout_engine_is_one_clear_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(layout_mod.shutil, "which", lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "grandalf", None)  # import grandalf -> ImportError
    with pytest.raises(LayoutUnavailable, match=r"apt-get install graphviz.*pip install 'opgraph\[viz\]'"):
        recorded().to_html()
    code = main(["view", OP, "--shape", "2,3", "-o", str(tmp_path / "g.html")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith("opgraph: error: laying out")
    assert not (tmp_path / "g.html").exists()


# --- opgraph view ------------------------------------------------------------------------------------
def test_view_writes_levels_and_a_tab_per_pass_that_changed_something(capsys, tmp_path):
    out = tmp_path / "g.html"
    case = ["--shape", "2,3,1,4", "--dtype", "float16"]
    assert main(["view", OP, *case, "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    data = page_data(out.read_text())
    keys = [t["key"] for t in data["tabs"]]
    assert keys[:3] == ["level0", "level1", "level2"] and data["selected"] == "level2"
    for n in (0, 1, 2):  # the same graphs as `opgraph dump` prints
        assert main(["dump", OP, *case, "--level", str(n), "--format", "json"]) == 0
        dumped = json.loads(capsys.readouterr().out)["nodes"]
        drawn = nodes_of(data["tabs"][n]["panels"][0])
        assert [d["key"] for d in drawn] == [m["outputs"][0]["name"] for m in dumped]
    titles = [t["title"] for t in data["tabs"][3:]]
    assert titles == [stem(2, "prune-identities"), stem(2, "fuse-elementwise"),  # --dump-dir's numbers
                      stem(2, "fuse-store")]
    for t in data["tabs"][3:]:
        assert [p["caption"] for p in t["panels"]] == ["before", "after"]
    assert any(line.startswith("identity-cast on %8 ") for line in data["tabs"][3]["notes"])


def test_view_level1_and_run_backend_times_every_node(capsys, tmp_path):
    out = tmp_path / "g.html"
    assert main(["view", OP, "--shape", "2,3,4", "--level", "1", "--run", "numpy", "-o", str(out)]) == 0
    data = page_data(out.read_text())
    assert data["selected"] == "level1"
    titles = [t["title"] for t in data["tabs"][3:]]  # level 1's pipeline, the passes that changed it
    assert titles == pass_stems(1)
    for tab in data["tabs"][:3]:
        ops = nodes_of(tab["panels"][0])
        assert ops and all(re.fullmatch(r"[\d.]+ (µs|ms)", n["info"]["time"]) for n in ops)
        assert any(line.startswith("phase 2 on numpy (after a warm-up run): ") for line in tab["notes"])


def test_view_netron_missing_says_how_to_install(capsys, tmp_path, monkeypatch):
    pytest.importorskip("onnx")
    monkeypatch.setitem(sys.modules, "netron", None)
    code = main(["view", OP, "--shape", "2,3", "-o", str(tmp_path / "g.html"), "--netron"])
    err = capsys.readouterr().err
    assert code == 1 and "pip install netron" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # refused: neither the page nor the .onnx is left


def test_view_netron_serves_the_onnx_file(capsys, tmp_path, monkeypatch):
    onnx = pytest.importorskip("onnx")
    served = []
    fake = types.SimpleNamespace(start=lambda path, *a, **k: served.append(path), wait=lambda: None)
    monkeypatch.setitem(sys.modules, "netron", fake)
    assert main(["view", OP, "--shape", "2,3", "--level", "1", "-o", str(tmp_path / "g.html"),
                 "--netron"]) == 0
    assert served == [str(tmp_path / "g.level1.onnx")]
    model = onnx.load(served[0])
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node][-1] == "ViewCopy"


@pytest.mark.parametrize("argv,option", [
    (["--run", "nope"], "--run"), (["--layout", "neato"], "--layout"), (["--level", "5"], "--level")])
def test_view_bad_options_name_the_option(capsys, argv, option):
    assert main(["view", OP, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opgraph: error:") and option in err and err.count("\n") == 1


def test_an_op_output_named_like_an_input_or_output_box_keeps_its_edges():
    """An op's box is keyed by its output's name, which may read "in:x" or "out:0" — the keys
    of the input and output boxes: each edge still joins the boxes it joins in the graph."""
    g = opgraph.Graph("keys")
    x = g.add_input("x", opgraph.TensorType((3,), opgraph.DataType.FLOAT))
    a = g.add_node("Cast", [x], to=opgraph.DataType.FLOAT16, out_names=["in:x"]).outputs[0]
    b = g.add_node("Cast", [a], to=opgraph.DataType.FLOAT, out_names=["out:0"]).outputs[0]
    g.outputs = [b]
    data = panel_data(Panel(g), engine="grandalf" if HAVE_GRANDALF else None)
    kind = {d["id"]: (d["kind"], d["lines"][0]) for d in data["nodes"]}
    edges = sorted((kind[e["from"]], kind[e["to"]]) for e in data["edges"])
    assert edges == sorted([(("input", "%x"), ("op", "%in:x = Cast")),
                            (("op", "%in:x = Cast"), ("op", "%out:0 = Cast")),
                            (("op", "%out:0 = Cast"), ("output", "return %out:0"))])


@pytest.mark.skipif(not HAVE_GRANDALF, reason="pip install grandalf (opgraph[viz])")
def test_a_graph_too_wide_for_grandalf_is_layout_unavailable():
    """grandalf recurses once per box of a layer: 1000 users of one value overflowed Python's
    stack (a raw RecursionError); it is LayoutUnavailable, naming dot as the way out."""
    g = opgraph.Graph("wide")
    x = g.add_input("x", opgraph.TensorType((1,), opgraph.DataType.FLOAT))
    g.outputs = [[g.add_node("Add", [x, x]) for _ in range(1000)][0].outputs[0]]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's default, whatever ran before
    try:
        with pytest.raises(LayoutUnavailable, match="grandalf cannot lay out this graph .*graphviz"):
            panel_data(Panel(g), engine="grandalf")
    finally:
        sys.setrecursionlimit(limit)
