"""``opgraph capture FILE``: the captured SyncBatchNorm step of examples/capture_syncbn.py in every
format, its figures against the calls one by one, a replay, and one-line errors."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from opgraph.cli import main
from opgraph.core.ir import Graph

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "capture_syncbn.py")


def run(capsys, *argv):
    code = main(["capture", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_shows_the_program_and_its_figures(capsys):
    code, out, _ = run(capsys, EXAMPLE, "--shape", "4,3,5,5")
    assert code == 0
    head, graph = out.split("\n", 1)
    assert "5 op_api calls and 2 collectives captured" in head
    assert re.search(r"level 2: [456] launches \+ 2 collectives, .* \(one by one: [56] \+ 2", head), head
    assert graph.startswith("graph capture(%input: f32[4,3,5,5]")
    assert "AllGather(" in graph and "AllReduce(" in graph and "FusedReduce(%input, %gradOut" in graph


def test_fast_math_compiles_the_program_with_its_rewrites(capsys):
    _, usual, _ = run(capsys, EXAMPLE, "--shape", "4,3,5,5")
    code, fast, _ = run(capsys, EXAMPLE, "--shape", "4,3,5,5", "--fast-math")
    assert code == 0 and "level 2 with fast-math:" in fast.split("\n", 1)[0]
    # the input gradient's kernel takes the channel-affine form: gradOut·A + input·B + D
    assert "fill(0.0)" in fast and "fill(0.0)" not in usual
    code, rows, _ = run(capsys, EXAMPLE, "--shape", "4,3,5,5", "--format", "stats", "--fast-math")
    assert code == 0 and len(rows.splitlines()) == 4


def test_stats_table_levels(capsys):
    code, out, _ = run(capsys, EXAMPLE, "--shape", "4,3,5,5", "--format", "stats")
    rows = [line.split() for line in out.splitlines()[1:]]
    assert code == 0 and [r[0] for r in rows] == ["0", "1", "2"]
    assert all(r[2] == r[5] == "2" for r in rows)          # two collectives either way
    assert int(rows[2][1]) <= int(rows[2][4])               # launches at level 2
    assert int(rows[2][3]) < int(rows[2][6])                # bytes at level 2
    code, out, _ = run(capsys, EXAMPLE, "--shape", "4,3,5,5", "--format", "stats", "--level", "1")
    assert code == 0 and [line.split() for line in out.splitlines()[1:]] == [rows[1]]  # its row only


def test_json_round_trips_and_table_and_run(capsys, tmp_path):
    path = tmp_path / "step.json"
    code, out, _ = run(capsys, EXAMPLE, "--shape", "4,3,5,5", "--format", "json", "-o", str(path))
    assert code == 0 and out.startswith(f"wrote {path}")
    g = Graph.from_json(path.read_text())
    assert [n.op for n in g.nodes if n.op.startswith("All")] == ["AllGather", "AllReduce"]
    assert json.loads(path.read_text())["name"] == "capture"
    code, out, _ = run(capsys, EXAMPLE, "--shape", "4,3,5,5", "--format", "table", "--level", "0",
                       "--run", "numpy")
    assert code == 0 and "AllGather" in out and "collective" in out
    assert "// replayed on numpy:" in out.splitlines()[-1]
    page = tmp_path / "step.html"
    code, out, _ = run(capsys, EXAMPLE, "--shape", "4,3,5,5", "--format", "html", "-o", str(page))
    html = page.read_text()
    assert code == 0 and html.startswith("<!DOCTYPE html>") and "AllReduce" in html


@pytest.mark.parametrize("argv, message", [
    (["nope.py"], "opgraph: error: FILE 'nope.py': no such file"),
    ([__file__.replace("test_capture_cli", "conftest")],
     "defines no function step(shape, dtype)"),
    ([EXAMPLE, "--shape", "0,3"], "--shape 0,3: expected N,C[,...] with every dim >= 1"),
    ([EXAMPLE, "--level", "5"], "argument --level: invalid choice"),
])
def test_errors_are_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out
