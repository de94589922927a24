"""torch stays optional: without it, ``import opgraph.torch`` says what to install, and the core
package and the CLI still work (runs with or without torch installed)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from opgraph.cli import main


@pytest.fixture
def no_torch(monkeypatch):
    """Make ``import torch`` fail as if torch were not installed, for this test only."""
    loaded = [m for m in sys.modules if m == "torch" or m.startswith(("torch.", "opgraph.torch"))]
    for name in loaded:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)
    opgraph = importlib.import_module("opgraph")
    if hasattr(opgraph, "torch"):
        monkeypatch.delattr(opgraph, "torch")


def test_importing_opgraph_torch_without_torch_says_what_to_install(no_torch):
    with pytest.raises(ImportError, match=r"pip install 'opgraph\[torch\]'.*torch==2\.13\.0"):
        importlib.import_module("opgraph.torch")


def test_syncbn_command_without_torch_is_one_clear_line(no_torch, capsys):
    assert main(["syncbn", "--ranks", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("opgraph: error:")
    assert "pip install 'opgraph[torch]'" in err[0]


def test_pyproject_declares_the_torch_extra():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    assert extras["torch"] == ["torch"]
    assert not any("torch" in d for d in meta["project"]["dependencies"])


@pytest.mark.parametrize("argv,message", [
    (["--ranks", "1"], "--ranks: expected 2..64"),
    (["--ranks", "x"], "--ranks: expected an integer"),
    (["--shape", "4"], "--shape 4: expected N,C"),
    (["--shape", "0,3,2"], "--shape 0,3,2: expected N,C"),
    (["--shape", "2,0"], "--shape 2,0: expected N,C"),
    (["--dtype", "float64"], "--dtype: invalid choice"),
    (["--backend", "no-such-backend"], "--backend"),
    (["--timeout", "0"], "--timeout"),
], ids=["one-rank", "not-int", "rank-1", "empty-batch", "no-channels", "dtype", "backend",
        "timeout"])
def test_syncbn_bad_arguments_are_one_line(argv, message, capsys):
    """Checked before torch is needed: the same with or without it."""
    assert main(["syncbn", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("opgraph: error:") and message in err[0]
