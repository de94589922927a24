"""The viewer page's inline stylesheet, script and legend (:mod:`opgraph.core.html` fills in the
data). Nothing here refers to anything outside the page: the SVG namespace is taken from an
inline ``<svg>`` element, so not even a namespace URL appears.

    >>> "://" in CSS + JS + LEGEND
    False
"""
from __future__ import annotations

CSS = """
:root { --kernel:#dbe8ff; --kernel-line:#3b6fc4; --free:#f3f3f3; --free-line:#8a8a8a;
  --write:#c0392b; --fused:#ffe9c7; --fused-line:#c07800; --input:#eaf6ea; --input-line:#4a9a4a;
  --added:#c8f2c4; --removed:#ffd3d3; --rewritten:#ffe0a8; --heat:#e4572e; }
* { box-sizing: border-box; }
body { font: 13px/1.4 system-ui, sans-serif; margin: 0 372px 0 0; color: #222; background: #fff; }
header { padding: 10px 16px 0; }
h1 { font-size: 17px; margin: 0; font-family: ui-monospace, monospace; }
.sub { margin: 2px 0 8px; color: #555; }
nav#tabs { display: flex; flex-wrap: wrap; gap: 4px; border-bottom: 1px solid #bbb; }
nav#tabs button { font: inherit; border: 1px solid #bbb; border-bottom: none; background: #f2f2f2;
  padding: 4px 10px; cursor: pointer; border-radius: 5px 5px 0 0; }
nav#tabs button[aria-selected=true] { background: #fff; font-weight: 600; position: relative; top: 1px; }
#legend { display: flex; flex-wrap: wrap; gap: 4px 14px; padding: 6px 16px; font-size: 12px; color: #333; }
#legend span { display: inline-flex; align-items: center; gap: 5px; }
#legend svg { width: 28px; height: 16px; }
main { padding: 4px 16px 24px; }
.notes { margin: 6px 0; padding: 6px 10px; background: #f7f7f2; border-left: 3px solid #c9c39a;
  font: 12px/1.45 ui-monospace, monospace; white-space: pre-wrap; }
.panels { display: flex; gap: 18px; align-items: flex-start; }
.panel { border: 1px solid #ddd; border-radius: 6px; overflow: auto; max-height: 88vh; }
.panel h2 { font-size: 13px; margin: 0; padding: 4px 8px; background: #f6f6f6; border-bottom: 1px solid #ddd; }
svg text { font: 11px ui-monospace, "DejaVu Sans Mono", monospace; fill: #1d1d1d; }
svg text.head { font-weight: 600; }
.node rect.box { fill: var(--kernel); stroke: var(--kernel-line); stroke-width: 1.3; }
.node.free rect.box { fill: var(--free); stroke: var(--free-line); stroke-dasharray: 5 3; }
.node.fused rect.box { fill: var(--fused); stroke: var(--fused-line); stroke-width: 2.2; }
.node.writes rect.box { stroke: var(--write); stroke-width: 2.4; }
.node.added rect.box { fill: var(--added); }
.node.removed rect.box { fill: var(--removed); }
.node.removed text { text-decoration: line-through; }
.node.rewritten rect.box { fill: var(--rewritten); }
.node.rewired rect.box { stroke: #e08a00; stroke-width: 2.4; stroke-dasharray: 2 2; }
.gin rect.box { fill: var(--input); stroke: var(--input-line); }
.gin.written rect.box { fill: #fdecea; stroke: var(--write); stroke-width: 2.2; }
.gout rect.box { fill: #fff; stroke: #555; }
.node, .gin, .gout { cursor: pointer; }
.sel rect.box { stroke: #000 !important; stroke-width: 3 !important; }
rect.heat { fill: var(--heat); }
.toggle { font-weight: 700; fill: var(--fused-line) !important; cursor: pointer; }
path.edge { fill: none; stroke: #808080; stroke-width: 1.2; }
path.edge.write { stroke: var(--write); stroke-dasharray: 5 3; }
path.arrowhead { fill: #808080; }
text.elabel { font-size: 9px; fill: #555; }
text.elabel.write { fill: var(--write); }
g.bodybox rect { fill: #fffdf6; stroke: var(--fused-line); stroke-width: 1.5; }
g.bodybox text.result { font-weight: 700; fill: #8a4b00; }
aside#details { position: fixed; right: 0; top: 0; bottom: 0; width: 360px; overflow: auto;
  border-left: 1px solid #ccc; background: #fbfbfb; padding: 10px 14px; font-size: 12px; }
aside h2 { font-size: 15px; margin: 0 0 6px; font-family: ui-monospace, monospace; }
aside table { border-collapse: collapse; width: 100%; }
aside td { vertical-align: top; padding: 2px 4px; border-top: 1px solid #eee;
  font-family: ui-monospace, monospace; word-break: break-word; }
aside td:first-child { color: #666; font-family: system-ui, sans-serif; white-space: nowrap; }
aside pre { background: #fff; border: 1px solid #ddd; padding: 6px; font-size: 11px; overflow: auto; }
.hint { color: #666; }
#errors { color: #b00; background: #fee; padding: 8px; margin: 8px 16px; }
"""

_SWATCH = '<svg viewBox="0 0 28 16"><rect x="1" y="1" width="26" height="14" rx="{rx}" style="{style}"/></svg>'


def _swatch(label: str, style: str, rx: int = 2) -> str:
    return f"<span>{_SWATCH.format(rx=rx, style=style)}{label}</span>"


LEGEND = "".join([
    _swatch("kernel launch", "fill:var(--kernel);stroke:var(--kernel-line)"),
    _swatch("free: view, identity, redirected copy",
            "fill:var(--free);stroke:var(--free-line);stroke-dasharray:5 3"),
    _swatch("fused kernel (▸ opens its body)", "fill:var(--fused);stroke:var(--fused-line);stroke-width:2.2"),
    _swatch("writes user memory", "fill:#fff;stroke:var(--write);stroke-width:2.4"),
    _swatch("graph input", "fill:var(--input);stroke:var(--input-line)", 7),
    _swatch("user tensor the graph writes", "fill:#fdecea;stroke:var(--write);stroke-width:2.2", 7),
    _swatch("added", "fill:var(--added);stroke:var(--kernel-line)"),
    _swatch("removed", "fill:var(--removed);stroke:var(--kernel-line)"),
    _swatch("rewritten", "fill:var(--rewritten);stroke:var(--kernel-line)"),
    _swatch("rewired operands", "fill:#fff;stroke:#e08a00;stroke-width:2.4;stroke-dasharray:2 2"),
    _swatch("share of the run time", "fill:var(--heat);stroke:none"),
])

JS = r"""
(function () {
  "use strict";
  var errors = document.getElementById("errors");
  function report(msg) {
    errors.hidden = false;
    errors.textContent += msg + "\n";
    document.body.setAttribute("data-errors", "1");
  }
  window.addEventListener("error", function (e) { report("error: " + e.message); });
  window.addEventListener("unhandledrejection", function (e) { report("rejection: " + e.reason); });

  var NS = document.getElementById("svgns").namespaceURI;
  var data = JSON.parse(document.getElementById("graph-data").textContent);
  var nav = document.getElementById("tabs"), main = document.getElementById("tabpanels");
  var details = document.getElementById("details");
  var sections = Object.create(null), buttons = Object.create(null), pinned = null;  // (no
  // inherited keys: #tab=constructor is an unknown tab, not Object's constructor)

  function el(tag, attrs, parent) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) { e.setAttribute(k, attrs[k]); }
    if (parent) { parent.appendChild(e); }
    return e;
  }
  function html(tag, text, parent, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) { e.textContent = text; }
    if (cls) { e.className = cls; }
    if (parent) { parent.appendChild(e); }
    return e;
  }

  function pathOf(edge, curved) {
    var p = edge.pts, d = "M" + p[0][0] + " " + p[0][1];
    if (curved && p.length >= 4 && (p.length - 1) % 3 === 0) {
      for (var i = 1; i + 2 < p.length; i += 3) {
        d += " C" + p[i][0] + " " + p[i][1] + " " + p[i + 1][0] + " " + p[i + 1][1] + " " +
             p[i + 2][0] + " " + p[i + 2][1];
      }
    } else {
      for (var j = 1; j < p.length; j++) { d += " L" + p[j][0] + " " + p[j][1]; }
    }
    return d;
  }

  function arrowhead(edge, svg, cls) {
    var p = edge.pts, n = p.length, tip = p[n - 1], k = n - 2;
    while (k > 0 && p[k][0] === tip[0] && p[k][1] === tip[1]) { k--; }
    var dx = tip[0] - p[k][0], dy = tip[1] - p[k][1], len = Math.sqrt(dx * dx + dy * dy) || 1;
    dx /= len; dy /= len;
    var bx = tip[0] - 7 * dx, by = tip[1] - 7 * dy;
    el("path", {"class": "arrowhead " + cls, d: "M" + tip[0] + " " + tip[1] + " L" + (bx - 3.5 * dy) +
      " " + (by + 3.5 * dx) + " L" + (bx + 3.5 * dy) + " " + (by - 3.5 * dx) + " Z"}, svg);
  }

  function showDetails(node, force) {
    if (pinned && !force) { return; }
    var info = node.info;
    details.textContent = "";
    html("h2", node.lines[0], details);
    var table = html("table", null, details);
    function row(name, value) {
      if (value === undefined || value === null || value === "" ||
          (Array.isArray(value) && value.length === 0)) { return; }
      var tr = html("tr", null, table);
      html("td", name, tr);
      html("td", Array.isArray(value) ? value.join("\n") : value, tr).style.whiteSpace = "pre-wrap";
    }
    row("op", info.op);
    row("cost", info.cost);
    row("time", info.time);
    row("attributes", (info.attrs || []).map(function (a) { return a[0] + " = " + a[1]; }));
    row("inputs", (info.inputs || []).map(function (a) { return a[0] + ": " + a[1] + "  ← " + a[2]; }));
    row("outputs", (info.outputs || []).map(function (a) { return a[0] + ": " + a[1]; }));
    row("writes", info.writes);
    row("recorded at", info.source);
    row("this pass", info.mark);
    row("was", info.was);
    if (node.body && node.body.length) {
      html("p", "body (fused kernel):", details);
      html("pre", node.body.join("\n"), details);
    }
  }

  function bodyBox(node) {
    var g = el("g", {"class": "bodybox", visibility: "hidden"});
    var width = 0;
    node.body.forEach(function (s) { width = Math.max(width, s.length); });
    var w = width * 6.6 + 16, h = node.body.length * 14 + 10;
    var x = node.x - node.w / 2, y = node.y + node.h / 2 + 4;
    el("rect", {x: x, y: y, width: w, height: h, rx: 4}, g);
    var result = node.body[node.body.length - 1].split(" ").pop();
    node.body.forEach(function (s, i) {
      var t = el("text", {x: x + 8, y: y + 16 + i * 14}, g);
      if (s.indexOf(result + ":") === 0 || i === node.body.length - 1) { t.setAttribute("class", "result"); }
      t.textContent = s;
    });
    g.dataset.extentX = x + w + 12;
    g.dataset.extentY = y + h + 12;
    return g;
  }

  function drawNode(node, svg, overlays) {
    var kind = node.kind === "op" ? "node" : (node.kind === "input" ? "gin" : "gout");
    var g = el("g", {"class": [kind].concat(node.cls).join(" "), "data-key": node.key}, svg);
    var x = node.x - node.w / 2, y = node.y - node.h / 2;
    el("rect", {"class": "box", x: x, y: y, width: node.w, height: node.h,
                rx: node.kind === "op" ? 3 : 11}, g);
    node.lines.forEach(function (s, i) {
      var t = el("text", {x: x + 8, y: y + 15 + 15 * i, "class": i === 0 ? "head" : ""}, g);
      t.textContent = s;
    });
    if (node.heat !== null && node.heat !== undefined) {
      el("rect", {"class": "heat", x: x + 1, y: y + node.h - 4, height: 3,
                  width: Math.max(1, (node.w - 2) * node.heat)}, g);
    }
    g.addEventListener("mouseenter", function () { showDetails(node, false); });
    g.addEventListener("click", function () {
      var prev = document.querySelector(".sel");
      if (prev) { prev.classList.remove("sel"); }
      g.classList.add("sel");
      pinned = node;
      showDetails(node, true);
    });
    if (node.body && node.body.length) {
      var box = bodyBox(node);
      overlays.push(box);
      var tog = el("text", {"class": "toggle", x: x + node.w - 16, y: y + 15}, g);
      tog.textContent = "▸";
      tog.addEventListener("click", function (ev) {
        ev.stopPropagation();
        var open = box.getAttribute("visibility") === "hidden";
        box.setAttribute("visibility", open ? "visible" : "hidden");
        tog.textContent = open ? "▾" : "▸";
        if (open) {
          svg.setAttribute("width", Math.max(+svg.getAttribute("width"), +box.dataset.extentX));
          svg.setAttribute("height", Math.max(+svg.getAttribute("height"), +box.dataset.extentY));
        }
        showDetails(node, true);
      });
    }
  }

  function drawPanel(panel, parent) {
    var div = html("div", null, parent, "panel");
    if (panel.caption) { html("h2", panel.caption, div); }
    var svg = el("svg", {width: panel.width, height: panel.height, "data-count": panel.count,
                         "data-engine": panel.engine}, div);
    panel.edges.forEach(function (e) {
      el("path", {"class": "edge " + e.cls, d: pathOf(e, panel.curved)}, svg);
      arrowhead(e, svg, e.cls);
      if (e.label && e.lp) {
        var t = el("text", {"class": "elabel " + e.cls, x: e.lp[0], y: e.lp[1] + 3,
                            "text-anchor": "middle"}, svg);
        t.textContent = e.label;
      }
    });
    var overlays = [];
    panel.nodes.forEach(function (n) { drawNode(n, svg, overlays); });
    overlays.forEach(function (o) { svg.appendChild(o); });
  }

  function show(key) {
    if (!sections[key]) { key = data.selected; }
    for (var k in sections) {
      sections[k].hidden = k !== key;
      buttons[k].setAttribute("aria-selected", k === key ? "true" : "false");
    }
    var sec = sections[key];
    if (!sec.dataset.drawn) {
      var tab = data.tabs.filter(function (t) { return t.key === key; })[0];
      if (tab.notes.length) { html("div", tab.notes.join("\n"), sec, "notes"); }
      var row = html("div", null, sec, "panels");
      tab.panels.forEach(function (p) { drawPanel(p, row); });
      sec.dataset.drawn = "1";
    }
    document.body.setAttribute("data-tab", key);
  }

  function hashTab() {
    var m = /(?:^#|&)tab=([^&]+)/.exec(location.hash);
    try {
      return m ? decodeURIComponent(m[1]) : null;
    } catch (e) {  // a malformed escape (#tab=%E0): the default tab
      return null;
    }
  }

  data.tabs.forEach(function (t) {
    var b = html("button", t.title, nav);
    b.setAttribute("role", "tab");
    b.dataset.tab = t.key;
    b.addEventListener("click", function () {
      history.replaceState(null, "", "#tab=" + encodeURIComponent(t.key));
      show(t.key);
    });
    buttons[t.key] = b;
    var sec = html("section", null, main, "tabpanel");
    sec.id = "tab-" + t.key;
    sec.hidden = true;
    sections[t.key] = sec;
  });
  window.addEventListener("hashchange", function () { show(hashTab() || data.selected); });
  show(hashTab() || data.selected);
  document.body.setAttribute("data-ready", "1");
})();
"""

__all__ = ["CSS", "JS", "LEGEND"]
