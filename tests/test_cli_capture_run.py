"""``opgraph capture FILE --run BACKEND``: the replay time is a ``//`` line of the text and table
outputs only. JSON, DOT and HTML are read by programs: the line appended to them made the JSON
invalid ('Extra data') and showed as stray text after the HTML page; there it goes to the
summary of -o, or to stderr beside stdout."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from opgraph.cli import main

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "capture_syncbn.py")
ARGS = ["capture", EXAMPLE, "--shape", "2,3,4,4", "--run", "numpy"]
REPLAYED = re.compile(r"replayed on numpy: \d+\.\d\d ms")


def test_json_on_stdout_stays_json(capsys):
    assert main([*ARGS, "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["schema"] == "opgraph.graph" and out.endswith("}\n")
    assert REPLAYED.fullmatch(err.strip().removeprefix("opgraph: ")), err


@pytest.mark.parametrize("fmt,end", [("json", "}\n"), ("dot", "}\n"), ("html", "</html>\n")])
def test_a_file_ends_where_its_format_does(capsys, tmp_path, fmt, end):
    path = tmp_path / f"step.{fmt}"
    assert main([*ARGS, "--format", fmt, "-o", str(path)]) == 0
    out, err = capsys.readouterr()
    assert path.read_text().endswith(end) and "replayed" not in path.read_text()
    assert err == "" and re.fullmatch(rf"wrote {re.escape(str(path))}: \d+ nodes; "
                                      rf"{REPLAYED.pattern}\n", out), out


@pytest.mark.parametrize("fmt", ["text", "table"])
def test_text_and_table_end_with_the_replay_line(capsys, fmt):
    assert main([*ARGS, "--format", fmt]) == 0
    out, err = capsys.readouterr()
    assert REPLAYED.fullmatch(out.splitlines()[-1].removeprefix("// ")) and err == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_stdout_that_cannot_take_the_json_gets_no_replay_note():
    """The note beside JSON on stdout comes once the JSON is written: on a full disk, only the
    error line."""
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "opgraph", *ARGS, "--format", "json"],
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("opgraph: error: ") and "replayed" not in p.stderr
