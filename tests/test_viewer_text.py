"""Text that answers "what did each pass do": ``--passes`` shows only passes that changed
something, as a diff of the text dump with the rules fired and the nodes hit, numbered like
``--dump-dir``; ``--format table``; ``--stats --format json``."""
from __future__ import annotations

import difflib
import json
import re

import pytest

from opgraph.cli import main
from passnames import pass_stems, stem

OP = "aclnnBatchNormElemtBackward"
CASE = ["--shape", "2,3,1,4", "--dtype", "float16"]


def cli(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_passes_show_only_changes_as_diffs_numbered_like_dump_dir(capsys, tmp_path):
    out = cli(capsys, "dump", OP, *CASE, "--level", "2", "--passes", "--dump-dir", str(tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".txt")
    stems = [f[:-4] for f in files]
    assert stems == ["00-input", *pass_stems(2)]
    headers = re.findall(r"^// (\d\d-[a-z-]+): ", out, re.M)
    unchanged = re.search(r"^// unchanged: (.*)$", out, re.M).group(1).split(", ")
    assert sorted(headers + unchanged) == stems[1:]  # every pass, named as its --dump-dir file
    assert headers == [stem(2, "prune-identities"), stem(2, "fuse-elementwise"), stem(2, "fuse-store")]
    # each shown pass is exactly the unified diff of the files --dump-dir wrote
    blocks = re.split(r"^// (?=\d\d-)", out, flags=re.M)[1:]
    for block, name in zip(blocks, headers):
        prev = stems[stems.index(name) - 1]
        want = difflib.unified_diff((tmp_path / f"{prev}.txt").read_text().splitlines(),
                                    (tmp_path / f"{name}.txt").read_text().splitlines(),
                                    f"{prev}.txt", f"{name}.txt", lineterm="")
        body = [line for line in block.splitlines()[1:]
                if not line.startswith(("//", "wrote "))]
        assert body == list(want)
    assert out.count("graph aclnnBatchNormElemtBackward(") <= 3  # diff context, not whole reprints
    assert out.splitlines()[-1] == f"wrote {3 * len(stems)} files to {tmp_path} (NN-<pass>.txt/.json/.dot)"


def test_passes_name_the_rules_that_fired_and_the_nodes_hit(capsys):
    out = cli(capsys, "dump", OP, *CASE, "--level", "2", "--passes")
    first = out.split("\n// " + stem(2, "fuse-elementwise"))[0]
    assert re.search(r"^// 01-prune-identities: identity-contiguous=8, identity-cast=\d+", first, re.M)
    assert "//   identity-contiguous on %0 %1 %2 %3 %4 %5 %6 %7\n" in first
    cast_hits = re.search(r"//   identity-cast on (.*)", first).group(1).split()
    assert "%8" in cast_hits and "%17" not in cast_hits  # f16->f16 dropped, f16->f32 kept
    assert re.search(r"^//   removed \d+: %0 %1 ", first, re.M)
    assert "//   store-into-output on %41" in out


def test_passes_json_lists_every_pass(capsys):
    doc = json.loads(cli(capsys, "dump", OP, *CASE, "--level", "1", "--passes", "--format", "json"))
    names = [p["stem"] for p in doc["passes"]]
    assert names == pass_stems(1) == ["01-prune-identities", "02-viewcopy-redirect"]
    redirect = doc["passes"][-1]
    assert redirect["changed"] and redirect["rewritten"] == ["41"]
    assert "+  %41: f16[2,3,1,4] = ViewCopy(%39, %gradInput, redirect=True)" in redirect["diff"]
    assert all(p["diff"] == [] for p in doc["passes"] if not p["changed"])


def test_level0_has_no_passes(capsys):
    assert "// no passes at this level" in cli(capsys, "dump", OP, "--passes")


def test_table_has_one_row_per_node(capsys):
    out = cli(capsys, "dump", OP, *CASE, "--level", "1", "--format", "table")
    lines = out.splitlines()
    assert lines[0].split() == ["name", "op", "inputs", "type", "cost", "bytes", "writes"]
    rows = {line.split()[0]: line.split() for line in lines[2:-2]}
    assert len(rows) == 9 + 19  # inputs + nodes at level 1
    assert rows["%gradInput"][1:] == ["(input)", "f16[2,3,1,4]"]
    assert rows["%16"] == ["%16", "ReduceSum", "%counter", "f32[]", "kernel", str(12 + 4)]
    assert rows["%42"][-2:] == ["free", "0"]  # UnsqueezeNd is a view
    assert rows["%39"][1] == "SyncBatchNormBackwardElemt" and rows["%39"][-1] == str(7 * 48 + 48)
    assert rows["%41"][-3:] == ["free", "0", "%gradInput"]  # redirected, writes the output
    launched = [r for r in rows.values() if "kernel" in r]
    total = sum(int(r[r.index("kernel") + 1]) for r in launched)
    assert lines[-1] == (f"19 nodes, {len(launched)} kernel launches, {total} bytes moved, "
                         "workspace 3072 B")


def test_stats_honours_format_json(capsys):
    text = cli(capsys, "dump", OP, "--shape", "4,8,5,5", "--stats").splitlines()
    doc = json.loads(cli(capsys, "dump", OP, "--shape", "4,8,5,5", "--stats", "--format", "json"))
    assert [list(map(int, line.split())) for line in text[1:]] == [
        [r["level"], r["nodes"], r["launches"], r["bytes_moved"], r["workspace"]] for r in doc["levels"]]
    assert doc["note"] is None and doc["levels"][2]["launches"] == 1


@pytest.mark.parametrize("flag", ["--stats", "--passes"])
def test_report_refuses_formats_it_cannot_print(capsys, flag):
    assert main(["dump", OP, flag, "--format", "dot"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opgraph: error: --format dot:") and flag in err
