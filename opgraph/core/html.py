"""The offline HTML viewer: one self-contained page (no external URL; inline CSS, JS and data)
that draws graphs top-down as SVG, with tabs, per-node details on hover or click, fused kernels
that open to their body, before/after diffs of a pass and per-node times.

    >>> import l0ops
    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType
    >>> g = Graph("demo"); x = g.add_input("x", TensorType((2, 3), DataType.FLOAT16))
    >>> g.outputs = [g.add_node("Cast", [x], to=DataType.FLOAT).outputs[0]]
    >>> page = render_html([Tab("graph", "demo", [Panel(g)])], title="demo")
    >>> page.startswith("<!DOCTYPE html>") and "://" not in page
    True

Layout is :mod:`opgraph.core.layout` (graphviz's dot, else grandalf); the page's script builds
the SVG from the laid-out data, so what a browser shows is what the script drew.
"""
from __future__ import annotations

import html as _html
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from .graphdiff import diff_nodes, node_key
from .html_assets import CSS, JS, LEGEND
from .layout import Box, Link, Placed, layout
from .types import format_attr

Graph = Node = Any  # opgraph.core.ir types (ir imports this module)

CHAR_W, LINE_H, PAD = 6.6, 15.0, 8.0  # the node font: 11px monospace
MAX_LINE = 44  # characters of an attribute line before it is cut


@dataclass
class Panel:
    """One graph drawn in a tab. ``marks``: node key → added / removed / rewritten / rewired;
    ``was``: node key → its dump line before the pass; ``times``: node key → seconds."""

    graph: Graph
    caption: str = ""
    marks: Mapping[str, str] = field(default_factory=dict)
    was: Mapping[str, str] = field(default_factory=dict)
    times: Optional[Mapping[str, float]] = None


@dataclass
class Tab:
    """A tab of the page: ``key`` (its URL hash ``#tab=<key>``), a title, notes and panels."""

    key: str
    title: str
    panels: list[Panel]
    notes: list[str] = field(default_factory=list)


def diff_tab(key: str, title: str, before: Graph, after: Graph,
             notes: Sequence[str] = ()) -> Tab:
    """A before/after tab: removed nodes marked before, added / rewritten / rewired after."""
    d = diff_nodes(before, after)
    return Tab(key, title, [Panel(before, "before", d.marks_before()),
                            Panel(after, "after", d.marks_after(), d.was)], list(notes))


# --- what a node is ------------------------------------------------------------------------------
def node_classes(node: Node) -> list[str]:
    """CSS classes of an op node: kernel or free, plus writes / fused / redirect."""
    opdef = node.opdef
    cls = ["free" if opdef.is_free(node) else "kernel"]
    if opdef.written(node):
        cls.append("writes")
    if opdef.format_body is not None and opdef.format_body(node.attrs):
        cls.append("fused")
    if opdef.redirects(node):
        cls.append("redirect")
    return cls


def _cost_text(node: Node) -> str:
    opdef = node.opdef
    if opdef.redirects(node):
        return "free: no kernel (redirected copy: the producer writes straight into the destination)"
    if opdef.is_free(node):
        return "free: no kernel launched (identity or view)"
    return "kernel launch"


def _attr_line(node: Node) -> str:
    fields = type(node.attrs).model_fields
    parts = [f"{k}={format_attr(v)}" for k, v in node.attr_items()
             if k != "body" and not (not fields[k].is_required() and v == fields[k].default)]
    text = ", ".join(parts)
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 1] + "…"


def _fmt_time(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.1f} µs" if us < 1000 else f"{us / 1000:.2f} ms"


def _body(node: Node) -> list[str]:
    """A fused node's body with its operands named: ``in0 = %counter: f32[3]`` lines first."""
    fmt = node.opdef.format_body
    lines = fmt(node.attrs) if fmt is not None else []
    if not lines:
        return []
    ins = [f"in{k} = %{v.name}: {v.type}" for k, v in enumerate(node.inputs)]
    if getattr(node.attrs, "store", False):
        ins[-1] = f"store into %{node.inputs[-1].name}: {node.inputs[-1].type}"
    return ins + lines


# --- one panel as data -----------------------------------------------------------------------------
def _op_node(node: Node, panel: Panel, total: float) -> dict:
    key = node_key(node)
    cls = node_classes(node)
    head = ", ".join(f"%{v.name}" for v in node.outputs) + f" = {node.op}"
    lines = [head]
    written = [node.inputs[k] for k in node.opdef.written(node)]
    body = _body(node)
    if body:
        steps = len(node.opdef.format_body(node.attrs)) - 1
        dst = f" → store %{written[0].name}" if written else ""
        lines.append(f"{steps} steps{dst}")
    else:
        attrs = _attr_line(node)
        if attrs:
            lines.append(attrs)
        if written:
            lines.append(("redirected into %" if "redirect" in cls else "writes %") + written[0].name)
    mark = panel.marks.get(key)
    info: dict[str, Any] = {
        "op": node.op, "cost": _cost_text(node),
        "attrs": [[k, format_attr(v)] for k, v in node.attr_items() if k != "body"],
        "inputs": [[f"%{v.name}", str(v.type),
                    v.producer.op if v.producer is not None else "graph input"] for v in node.inputs],
        "outputs": [[f"%{v.name}", str(v.type)] for v in node.outputs],
        "writes": [f"%{v.name}" for v in written],
        "source": node.source or "", "mark": mark or "", "was": panel.was.get(key, ""),
    }
    time = None
    if panel.times is not None and key in panel.times:
        time = panel.times[key]
        lines.append(_fmt_time(time) + (f" ({100 * time / total:.0f}%)" if total > 0 else ""))
        info["time"] = _fmt_time(time)
    return {"key": key, "kind": "op", "cls": cls + ([mark] if mark else []), "lines": lines,
            "body": body, "info": info, "heat": (time / total) if time and total > 0 else None}


def _input_node(v: Any, written: bool) -> dict:
    lines = [f"%{v.name}", str(v.type)] + (["user tensor, written"] if written else [])
    return {"key": f"in:{v.name}", "kind": "input", "cls": ["input"] + (["written"] if written else []),
            "lines": lines, "body": [], "info": {
                "op": "graph input (user tensor)", "outputs": [[f"%{v.name}", str(v.type)]],
                "cost": "written by the graph" if written else "read only"}}


def panel_data(panel: Panel, engine: Optional[str] = None) -> dict:
    """Lay out one panel's graph and return what the page's script draws."""
    g = panel.graph
    written = {node.inputs[k].name for node in g.nodes for k in node.opdef.written(node)}
    times = panel.times or {}
    total = sum(times.values())
    nodes = [_input_node(v, v.name in written) for v in g.inputs]
    nodes += [_op_node(n, panel, total) for n in g.nodes]
    nodes += [{"key": f"out:{k}", "kind": "output", "cls": ["output"], "lines": [f"return %{v.name}"],
               "body": [], "info": {"op": "graph output", "outputs": [[f"%{v.name}", str(v.type)]]}}
              for k, v in enumerate(g.outputs)]
    ids = {}  # by (kind, key): an op's key is its output's name, which may read "in:x"
    for i, d in enumerate(nodes):
        d["id"] = f"v{i}"
        ids[d["kind"], d["key"]] = d["id"]
        width = max(len(s) for s in d["lines"]) * CHAR_W + 2 * PAD
        d["w"], d["h"] = round(max(width, 56.0), 1), LINE_H * len(d["lines"]) + PAD
    source = lambda v: (ids["op", node_key(v.producer)] if v.producer is not None  # noqa: E731
                        else ids["input", f"in:{v.name}"])
    links, kinds = [], []
    for n in g.nodes:
        dst = set(n.opdef.written(n))
        for k, v in enumerate(n.inputs):
            links.append(Link(source(v), ids["op", node_key(n)], ("write " if k in dst else "") + str(v.type)))
            kinds.append("write" if k in dst else "")
    for k, v in enumerate(g.outputs):
        links.append(Link(source(v), ids["output", f"out:{k}"], ""))
        kinds.append("out")
    placed: Placed = layout([Box(d["id"], d["w"], d["h"]) for d in nodes], links, engine)
    for d in nodes:
        d["x"], d["y"] = placed.nodes[d["id"]]
    edges = [{"from": e.src, "to": e.dst, "label": e.label, "cls": kind, "pts": pts, "lp": lp}
             for e, kind, pts, lp in zip(links, kinds, placed.edges, placed.labels)]
    return {"caption": panel.caption, "width": placed.width, "height": placed.height,
            "curved": placed.curved, "engine": placed.engine, "nodes": nodes, "edges": edges,
            "count": len(g.nodes)}


# --- the page ------------------------------------------------------------------------------------
def _script_json(data: Any) -> str:
    """JSON safe inside a <script> element (no ``</script>``, no ``<!--``)."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).replace("<", "\\u003c")


def render_html(tabs: Sequence[Tab], title: str = "opgraph", selected: Optional[str] = None,
                engine: Optional[str] = None, subtitle: str = "") -> str:
    """The page for ``tabs`` (``selected``: the tab shown first unless the URL says
    ``#tab=<key>``; ``engine``: the layout engine, default :func:`layout.default_engine`)."""
    if not tabs:
        raise ValueError("render_html needs at least one tab")
    keys = [t.key for t in tabs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"tab keys must be unique, got {keys}")
    if selected is not None and selected not in keys:
        raise ValueError(f"selected tab {selected!r} is not one of {keys}")
    data = {"title": title, "selected": selected or keys[0], "tabs": [
        {"key": t.key, "title": t.title, "notes": list(t.notes),
         "panels": [panel_data(p, engine) for p in t.panels]} for t in tabs]}
    engines = sorted({p["engine"] for t in data["tabs"] for p in t["panels"]})
    esc = _html.escape
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="opgraph">
<title>{esc(title)}</title>
<style>{CSS}</style></head>
<body data-layout="{esc(",".join(engines))}">
<header><h1>{esc(title)}</h1><p class="sub">{esc(subtitle)}</p>
<nav id="tabs" role="tablist"></nav></header>
<div id="legend">{LEGEND}</div>
<main id="tabpanels"></main>
<aside id="details"><p class="hint">Hover or click a node for its op, attributes, types and
the op_api line that recorded it; click ▸ on a fused kernel to open its body.</p></aside>
<pre id="errors" hidden></pre>
<svg id="svgns" width="0" height="0" aria-hidden="true"></svg>
<script type="application/json" id="graph-data">{_script_json(data)}</script>
<script>{JS}</script>
</body></html>
"""


def graph_html(graph: Graph, times: Optional[Mapping[str, float]] = None,
               engine: Optional[str] = None, title: Optional[str] = None) -> str:
    """One graph on one tab (what :meth:`Graph.to_html` returns)."""
    name = title or graph.name
    return render_html([Tab("graph", name, [Panel(graph, times=times)])], title=name, engine=engine)


__all__ = ["Panel", "Tab", "diff_tab", "graph_html", "node_classes", "panel_data", "render_html"]
