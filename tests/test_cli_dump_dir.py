"""``opgraph dump --dump-dir DIR``: DIR holds exactly this run's dumps afterwards. An earlier
run's dumps there are replaced and the ones this run does not write removed (a level-1 run after
a level-2 one left 04-fuse-reductions.txt ... beside its own, to be read as current); a directory
holding anything else is refused before anything is written."""
from __future__ import annotations

import json
import os

import pytest

from opgraph.cli import main
from opgraph.passes import pipeline

OP = "aclnnBatchNormElemtBackward"


def dump_names(level: int) -> list[str]:
    """The files a --dump-dir run at ``level`` writes."""
    stems = ["00-input"] + [f"{i + 1:02d}-{p.name}" for i, p in enumerate(pipeline(level))]
    return sorted(f"{s}.{ext}" for s in stems for ext in ("txt", "json", "dot"))


def dump(capsys, d, level: int, *extra: str) -> tuple[int, str, str]:
    code = main(["dump", OP, "--level", str(level), "--dump-dir", str(d), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_second_run_leaves_only_its_own_dumps(capsys, tmp_path):
    d = tmp_path / "dd"
    assert dump(capsys, d, 2)[0] == 0
    assert sorted(os.listdir(d)) == dump_names(2)
    code, out, _ = dump(capsys, d, 1, "--shape", "4,5")
    assert code == 0 and sorted(os.listdir(d)) == dump_names(1)  # no level-2 file left over
    stale = len(dump_names(2)) - len(set(dump_names(2)) & set(dump_names(1)))
    assert out == (f"wrote {len(dump_names(1))} files to {d} (NN-<pass>.txt/.json/.dot; "
                   f"removed {stale} an earlier run wrote)\n")
    assert "%gradOut: f32[4,5]" in (d / "00-input.txt").read_text()  # replaced


def test_the_json_report_counts_what_it_removed(capsys, tmp_path):
    assert dump(capsys, tmp_path, 2)[0] == 0
    code, out, _ = dump(capsys, tmp_path, 1, "--format", "json")
    doc = json.loads(out)["dump_dir"]
    assert code == 0 and doc == {"path": str(tmp_path), "files": len(dump_names(1)),
                                 "removed": len(set(dump_names(2)) - set(dump_names(1)))}


@pytest.mark.parametrize("other", ["notes.md", "01-my-notes.txt", "00-input.png", "sub"])
def test_a_directory_holding_other_files_is_refused_untouched(capsys, tmp_path, other):
    assert dump(capsys, tmp_path, 2)[0] == 0
    if other == "sub":
        (tmp_path / other).mkdir()
    else:
        (tmp_path / other).write_text("mine")
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    code, out, err = dump(capsys, tmp_path, 1)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"opgraph: error: --dump-dir '{tmp_path}': holds '{other}'"), err
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


def test_the_report_written_into_the_directory_is_kept(capsys, tmp_path):
    report = tmp_path / "report.txt"
    for level in (2, 1):
        assert dump(capsys, tmp_path, level, "--passes", "-o", str(report))[0] == 0
    assert sorted(os.listdir(tmp_path)) == sorted(dump_names(1) + ["report.txt"])
    assert "// 01-prune-identities" in report.read_text()


def test_a_refused_run_removes_nothing(capsys, tmp_path):
    assert dump(capsys, tmp_path, 2)[0] == 0
    code, _, err = dump(capsys, tmp_path, 1, "-o", str(tmp_path / "missing" / "report.txt"))
    assert code != 0 and "-o/--output" in err
    assert sorted(os.listdir(tmp_path)) == dump_names(2)


def test_level_0_dumps_the_graph_as_recorded(capsys, tmp_path):
    """Level 0 (dump's default) runs no pass: its dump is 00-input, what ``opgraph dump OP``
    prints (it wrote no file, yet said so, and would have left an earlier run's dumps)."""
    assert dump(capsys, tmp_path, 2)[0] == 0
    code, out, _ = dump(capsys, tmp_path, 0)
    assert code == 0 and sorted(os.listdir(tmp_path)) == dump_names(0)
    assert main(["dump", OP]) == 0
    assert (tmp_path / "00-input.txt").read_text() == capsys.readouterr().out  # newline too
