"""Top-down layered layout of boxes and links, for the HTML viewer: graphviz's ``dot`` when it
is on PATH, otherwise the pure-Python Sugiyama layout of ``grandalf`` (``pip install
'opgraph[viz]'``). Coordinates are pixels, y down, origin at the top-left corner.

    >>> placed = layout([Box("a", 80, 30), Box("b", 80, 30)], [Link("a", "b", "f32[2]")])
    >>> placed.nodes["a"][1] < placed.nodes["b"][1]   # a above b
    True
    >>> len(placed.edges) == 1 and placed.engine in ("dot", "grandalf")
    True
"""
from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Optional, Sequence

ENGINES = ("dot", "grandalf")
MARGIN = 12.0
DOT_TIMEOUT = 60  # seconds
LABEL_FONT = 9.0  # px; the viewer draws edge labels at this size


class LayoutUnavailable(RuntimeError):
    """Neither graphviz's dot nor grandalf is installed; the message says what to install."""


@dataclass(frozen=True)
class Box:
    """A node to place: ``id`` and its size in pixels."""

    id: str
    width: float
    height: float


@dataclass(frozen=True)
class Link:
    """A directed edge ``src -> dst`` with an optional label."""

    src: str
    dst: str
    label: str = ""


@dataclass
class Placed:
    """The layout: box centres by id; per link (in input order) its points and label position.
    ``curved``: the points are cubic Bezier control points (``M p0 C p1 p2 p3 ...``), else a
    polyline."""

    engine: str
    width: float
    height: float
    nodes: dict[str, tuple[float, float]] = field(default_factory=dict)
    edges: list[list[tuple[float, float]]] = field(default_factory=list)
    labels: list[Optional[tuple[float, float]]] = field(default_factory=list)
    curved: bool = False


def default_engine() -> str:
    """``"dot"`` when graphviz's dot is on PATH, else ``"grandalf"`` when it is importable;
    LayoutUnavailable naming both when neither is."""
    if shutil.which("dot"):
        return "dot"
    _require_grandalf()
    return "grandalf"


def _require_grandalf() -> None:
    try:
        import grandalf  # noqa: F401
    except ImportError:
        raise LayoutUnavailable(
            "laying out a graph needs graphviz's dot on PATH (apt-get install graphviz) or the "
            "grandalf package (pip install 'opgraph[viz]')") from None


def layout(boxes: Sequence[Box], links: Sequence[Link], engine: Optional[str] = None) -> Placed:
    """Place ``boxes`` top-down so that links point downwards (``engine``: dot or grandalf;
    default :func:`default_engine`)."""
    engine = engine or default_engine()
    if engine not in ENGINES:
        raise ValueError(f"layout engine must be one of {ENGINES}, got {engine!r}")
    if not boxes:
        return Placed(engine, 2 * MARGIN, 2 * MARGIN)
    placed = _dot(boxes, links) if engine == "dot" else _grandalf(boxes, links)
    return _normalise(placed, boxes, links)


# --- graphviz ----------------------------------------------------------------------------------
def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _points(text: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in (p.split(",")[:2] for p in text.split())]


def _dot(boxes: Sequence[Box], links: Sequence[Link]) -> Placed:
    lines = ["digraph G {", "  graph [rankdir=TB, nodesep=0.35, ranksep=0.42];",
             '  node [shape=box, fixedsize=true, label=""];',
             f'  edge [fontname="Courier", fontsize={LABEL_FONT:g}];']
    for b in boxes:
        lines.append(f"  {_quote(b.id)} [width={b.width / 72:.4f}, height={b.height / 72:.4f}];")
    for k, e in enumerate(links):
        label = f", label={_quote(e.label)}" if e.label else ""
        lines.append(f"  {_quote(e.src)} -> {_quote(e.dst)} [id={_quote(f'e{k}')}{label}];")
    lines.append("}")
    try:
        p = subprocess.run(["dot", "-Tjson"], input="\n".join(lines), capture_output=True,
                           text=True, timeout=DOT_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LayoutUnavailable(f"graphviz's dot failed to run: {e}") from None
    if p.returncode != 0:
        raise LayoutUnavailable(f"graphviz's dot failed: {p.stderr.strip()[:300]}")
    doc = json.loads(p.stdout)
    height = float(doc["bb"].split(",")[3])
    flip = lambda pt: (pt[0], height - pt[1])  # noqa: E731  (dot's y axis points up)
    out = Placed("dot", float(doc["bb"].split(",")[2]), height, curved=True)
    for obj in doc.get("objects", []):
        if "pos" in obj:
            out.nodes[obj["name"]] = flip(_points(obj["pos"])[0])
    by_id = {e.get("id"): e for e in doc.get("edges", [])}
    for k in range(len(links)):
        e = by_id[f"e{k}"]
        parts = e["pos"].split()
        end = None
        if parts and parts[0].startswith("e,"):
            end = _points(parts.pop(0)[2:])[0]
        if parts and parts[0].startswith("s,"):
            parts.pop(0)
        pts = [flip(p) for p in _points(" ".join(parts))]
        if end is not None:  # dot stops the spline short of the arrowhead: draw to its tip
            tip = flip(end)
            pts += [pts[-1], tip, tip]
        out.edges.append(pts)
        out.labels.append(flip(_points(e["lp"])[0]) if "lp" in e else None)
    return out


# --- grandalf --------------------------------------------------------------------------------
class _VertexView:
    def __init__(self, w: float, h: float):
        self.w, self.h, self.xy = w, h, (0.0, 0.0)


class _EdgeView:
    def __init__(self) -> None:
        self.pts: list[tuple[float, float]] = []

    def setpath(self, pts: list) -> None:
        self.pts = [(float(x), float(y)) for x, y in pts]


def _grandalf(boxes: Sequence[Box], links: Sequence[Link]) -> Placed:
    _require_grandalf()
    from grandalf.graphs import Edge, Graph, Vertex
    from grandalf.layouts import SugiyamaLayout
    from grandalf.routing import route_with_lines

    verts = {}
    for b in boxes:
        v = Vertex(b.id)
        v.view = _VertexView(b.width, b.height)
        verts[b.id] = v
    edges = []
    for e in links:
        ge = Edge(verts[e.src], verts[e.dst])
        ge.view = _EdgeView()
        edges.append(ge)
    g = Graph(list(verts.values()), edges)
    out = Placed("grandalf", 0.0, 0.0)
    x0 = 0.0
    for comp in g.C:  # components side by side, left to right
        sug = SugiyamaLayout(comp)
        sug.xspace, sug.yspace = 24, 34 if any(e.label for e in links) else 24
        sug.route_edge = route_with_lines
        try:
            sug.init_all()
            sug.draw()
        except RecursionError:  # grandalf recurses per node of a layer: a very wide graph
            raise LayoutUnavailable(f"grandalf cannot lay out this graph ({len(boxes)} boxes: "
                                    "too wide for its recursion); install graphviz for dot "
                                    "(apt-get install graphviz)") from None
        vs = list(comp.sV)
        left = min(v.view.xy[0] - v.view.w / 2 for v in vs)
        right = max(v.view.xy[0] + v.view.w / 2 for v in vs)
        dx = x0 - left
        for v in vs:
            out.nodes[v.data] = (v.view.xy[0] + dx, v.view.xy[1])
        for ge in comp.sE:
            ge.view.pts = [(x + dx, y) for x, y in ge.view.pts]
        x0 += right - left + 36
    for e, ge in zip(links, edges):
        pts = ge.view.pts
        out.edges.append(pts)
        out.labels.append(_mid_label(pts, e.label) if e.label else None)
    return out


def label_width(text: str) -> float:
    """Pixels a label takes in the viewer's monospace font."""
    return 0.6 * LABEL_FONT * len(text)


def _mid_label(pts: list[tuple[float, float]], text: str) -> tuple[float, float]:
    """The centre of a label set beside the middle of a polyline."""
    k = max(0, (len(pts) - 2) // 2)
    (x1, y1), (x2, y2) = pts[k], pts[min(k + 1, len(pts) - 1)]
    return (x1 + x2) / 2 + 4 + label_width(text) / 2, (y1 + y2) / 2


# --- shared ----------------------------------------------------------------------------------
def _normalise(p: Placed, boxes: Sequence[Box], links: Sequence[Link]) -> Placed:
    """Shift everything so the drawing (boxes, edges, labels) starts at (MARGIN, MARGIN)."""
    size = {b.id: b for b in boxes}
    xs, ys = [], []
    for k, (x, y) in p.nodes.items():
        xs += [x - size[k].width / 2, x + size[k].width / 2]
        ys += [y - size[k].height / 2, y + size[k].height / 2]
    for pts in p.edges:
        xs += [x for x, _ in pts]
        ys += [y for _, y in pts]
    for lp, e in zip(p.labels, links):
        if lp is not None:
            xs += [lp[0] - label_width(e.label) / 2, lp[0] + label_width(e.label) / 2]
            ys += [lp[1] - LABEL_FONT, lp[1] + LABEL_FONT]
    dx, dy = MARGIN - min(xs), MARGIN - min(ys)
    shift = lambda pt: (round(pt[0] + dx, 1), round(pt[1] + dy, 1))  # noqa: E731
    p.nodes = {k: shift(v) for k, v in p.nodes.items()}
    p.edges = [[shift(pt) for pt in pts] for pts in p.edges]
    p.labels = [None if lp is None else shift(lp) for lp in p.labels]
    p.width, p.height = round(max(xs) - min(xs) + 2 * MARGIN, 1), round(max(ys) - min(ys) + 2 * MARGIN, 1)
    return p


__all__ = ["Box", "ENGINES", "Link", "LayoutUnavailable", "Placed", "default_engine", "label_width",
           "layout"]
