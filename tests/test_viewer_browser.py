"""The viewer in a real browser (Debian's headless chromium, driven over the DevTools pipe): the
page loads from file:// without network, its script draws one SVG group per graph node on
every tab, tabs switch on a real click, hover/click show a node's details with its recording
line, fused kernels open to their body, no console error, and a screenshot is not blank."""
from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from opgraph.cli import main
from opgraph.core import layout as layout_mod
from test_viewer_driver import Browser, find_chromium, png_pixels  # tests/ is on sys.path

OP = "aclnnBatchNormElemtBackward"
CASE = ["--shape", "2,3,1,4", "--dtype", "float16"]
CHROMIUM = find_chromium()
needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="the default layout needs graphviz: apt-get install graphviz")

NODES = "#tab-{} svg g.node"
COUNT = "document.querySelectorAll({!r}).length"
KEYS = "[...document.querySelectorAll({!r})].map(g => g.dataset.key)"


def dumped_keys(capsys, level: int) -> list[str]:
    """The level's node keys as `opgraph dump --format json` lists them (not from the page)."""
    assert main(["dump", OP, *CASE, "--level", str(level), "--format", "json"]) == 0
    return [n["outputs"][0]["name"] for n in json.loads(capsys.readouterr().out)["nodes"]]


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("view") / "graph.html"
    assert main(["view", OP, *CASE, "--run", "numpy", "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("browser tests need Debian's chromium: apt-get install chromium graphviz")
    b = Browser(CHROMIUM, 1400, 900, timeout=30)  # every wait bounded: 30 s
    yield b
    b.close()


@needs_dot
def test_every_level_tab_draws_its_nodes_after_a_real_click(page, browser, capsys):
    browser.open(page.as_uri() + "#tab=level0")
    assert browser.eval("document.body.dataset.ready") == "1"
    assert browser.eval("document.querySelector('#tab-level0 svg').dataset.engine") == "dot"
    for level in (0, 1, 2):
        if level:
            browser.mouse(f"nav button[data-tab=level{level}]", click=True)
        assert browser.eval("document.body.dataset.tab") == f"level{level}"
        assert browser.eval("location.hash") == f"#tab=level{level}"
        assert browser.eval(KEYS.format(NODES.format(f"level{level}"))) == dumped_keys(capsys, level)
        visible = browser.eval("[...document.querySelectorAll('section.tabpanel')]"
                               ".filter(s => !s.hidden).map(s => s.id)")
        assert visible == [f"tab-level{level}"]
    assert browser.eval(COUNT.format("#tab-level0 svg g.gin")) == 9
    assert browser.problems() == [] and browser.eval("document.getElementById('errors').hidden")
    requests = browser.requests()  # the page itself and nothing else: no network
    assert requests and all(u.startswith(page.as_uri()) for u in requests)


def test_hash_opens_a_pass_tab_with_its_diff(page, browser):
    browser.open(page.as_uri() + "#tab=pass01")
    assert browser.eval("document.body.dataset.tab") == "pass01"
    before, after = browser.eval("[...document.querySelectorAll('#tab-pass01 svg')]"
                                 ".map(s => s.querySelectorAll('g.node').length)")
    assert (before, after) == (42, 19)
    removed = browser.eval(KEYS.format("#tab-pass01 g.node.removed"))
    added = browser.eval(KEYS.format("#tab-pass01 g.node.added"))
    assert "0" in removed and "8" in removed and set(added) == {"42", "43", "44", "45", "46"}
    assert "identity-cast on %8" in browser.eval("document.querySelector('#tab-pass01 .notes').textContent")
    assert browser.problems() == []


def test_hover_and_click_show_details_with_the_recording_line(page, browser):
    browser.open(page.as_uri() + "#tab=level1")
    browser.mouse("#tab-level1 g.node[data-key='17']", click=False)
    text = browser.eval("document.getElementById('details').innerText")
    assert text.startswith("%17 = Cast") and "to = f32" in text and "%sumDy: f16[3]" in text
    assert "recorded at\topgraph/aclnn/batch_norm_elemt_backward.py:" in text
    assert "kernel launch" in text and "µs" in text  # --run numpy: the node's time
    browser.mouse("#tab-level1 g.node[data-key='41']", click=True)
    browser.mouse("#tab-level1 g.node[data-key='17']", click=False)  # pinned: hover changes nothing
    text = browser.eval("document.getElementById('details').innerText")
    assert text.startswith("%41 = ViewCopy") and "redirected copy" in text and "%gradInput" in text
    assert browser.eval(KEYS.format("#tab-level1 g.sel")) == ["41"]


def test_fused_kernel_opens_to_its_body(page, browser):
    browser.open(page.as_uri() + "#tab=level2")
    box = "#tab-level2 g.bodybox"
    assert browser.eval(f"document.querySelector({box!r}).getAttribute('visibility')") == "hidden"
    browser.mouse("#tab-level2 g.node.fused .toggle", click=True)
    assert browser.eval(f"document.querySelector({box!r}).getAttribute('visibility')") == "visible"
    lines = browser.eval(f"[...document.querySelectorAll('{box} text')].map(t => t.textContent)")
    assert lines[0] == "in0 = %counter: f32[3]" and lines[-1].startswith("store t")
    result = lines[-1].split()[-1]
    bold = browser.eval(f"[...document.querySelectorAll('{box} text.result')].map(t => t.textContent)")
    assert bold[0].startswith(result + ": f16 = mul(")  # the result register is the visible one
    assert browser.problems() == []


def test_screenshot_is_not_blank(page, browser):
    browser.open(page.as_uri() + "#tab=level1")
    px = png_pixels(browser.screenshot(scale=0.5))  # half size: the decoder is pure Python
    width, height, pixels = px[0], px[1], px[2:]
    assert width == 700 and len(pixels) == width * height
    grey = [0.299 * r + 0.587 * g + 0.114 * b for r, g, b in pixels[::3]]
    assert statistics.pstdev(grey) > 10 and len(set(pixels)) > 100
    assert pixels[3 * width + 3] == (255, 255, 255)  # the page background
    assert sum(p == (219, 232, 255) for p in pixels) > 500  # kernel boxes (--kernel: #dbe8ff)


@pytest.mark.parametrize("hash_", ["constructor", "__proto__", "toString", "%E0", "nosuchtab"])
def test_an_unknown_or_malformed_hash_opens_the_default_tab(page, browser, hash_):
    """Names Object.prototype has, and an escape decodeURIComponent refuses, are unknown tabs:
    the default one is drawn, without a script error (they threw)."""
    browser.open(page.as_uri() + "#tab=" + hash_)
    assert browser.eval("document.body.dataset.ready") == "1"
    default = browser.eval("document.body.dataset.tab")
    assert default.startswith("level") and browser.eval(COUNT.format(NODES.format(default))) > 0
    assert browser.problems() == []


def test_page_reports_script_errors_and_the_harness_sees_them(page, browser):
    """The checks above could fail: an error thrown in the page shows in #errors and in the
    console events the tests read."""
    browser.open(page.as_uri())
    browser.eval("setTimeout(function () { throw new Error('boom-42'); }, 0); 1")
    browser.send("Runtime.evaluate", {"expression": "new Promise(r => setTimeout(r, 100))",
                                      "awaitPromise": True})
    assert any("boom-42" in p for p in browser.problems())
    assert "boom-42" in browser.eval("document.getElementById('errors').textContent")


def test_fallback_layout_renders_in_the_browser(tmp_path, monkeypatch, browser, capsys):
    pytest.importorskip("grandalf", reason="pip install grandalf (opgraph[viz])")
    real = shutil.which
    monkeypatch.setattr(layout_mod.shutil, "which",
                        lambda name, *a, **k: None if name == "dot" else real(name, *a, **k))
    out = tmp_path / "g.html"
    assert main(["view", OP, *CASE, "-o", str(out)]) == 0
    assert "layout: grandalf" in capsys.readouterr().out
    browser.open(out.as_uri() + "#tab=level1")
    assert browser.eval("document.querySelector('#tab-level1 svg').dataset.engine") == "grandalf"
    assert browser.eval(KEYS.format(NODES.format("level1"))) == dumped_keys(capsys, 1)
    assert browser.problems() == []
