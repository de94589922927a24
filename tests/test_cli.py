"""The ``opgraph`` command line, run in-process through ``opgraph.cli.main`` (plus one real
subprocess smoke test of the console entry)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

import opgraph
from opgraph.cli import COMMANDS, build_parser, main

OP = "aclnnBatchNormElemtBackward"
EXPECTED = [0.9 * i for i in range(8)]  # the article's example: 0.9 * x
RESULT = re.compile(r"^result\[(\d+)\] is: (\S+)$", re.M)


def results(text: str) -> list[list[float]]:
    """The result[i] blocks of a demo run, one list per variant."""
    blocks: list[list[float]] = []
    for m in RESULT.finditer(text):
        if m.group(1) == "0":
            blocks.append([])
        blocks[-1].append(float(m.group(2)))
    return blocks


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- demo -------------------------------------------------------------------------------------
def test_demo_prints_article_flow_and_values(capsys):
    code, out, err = run_cli(capsys, "demo")
    assert code == 0, err
    assert err == ""
    assert out.count("ret = 0 (ACLNN_SUCCESS)") == 6  # two phases x three variants
    assert "workspaceSize = " in out
    assert "graph aclnnBatchNormElemtBackward(%gradOut: f32[1,2,4]" in out
    assert "SyncBatchNormBackwardElemt(" in out
    f32, f16, bf16 = results(out)
    assert np.allclose(f32, EXPECTED, rtol=0, atol=1e-6)
    assert np.allclose(f16, EXPECTED, rtol=2e-3, atol=1e-6)
    assert np.allclose(bf16, EXPECTED, rtol=8e-3, atol=1e-6)
    # the exact bits of the low-precision variants, printed with %f
    assert f16[1] == 0.899902 and bf16[1] == 0.898438


def test_demo_single_variant_without_graph(capsys):
    code, out, _ = run_cli(capsys, "demo", "--dtype", "float16", "--no-graph",
                           "--platform", "Ascend950")
    assert code == 0
    assert "FLOAT16 on Ascend950" in out and "graph " not in out
    assert len(results(out)) == 1


def test_demo_fails_when_a_status_fails(capsys):
    code, out, _ = run_cli(capsys, "demo", "--platform", "Ascend910", "--dtype", "bf16")
    assert code == 1
    assert "161002" in out and "CHECK_RET failed" in out


# --- dump -------------------------------------------------------------------------------------
def test_dump_text(capsys):
    code, out, _ = run_cli(capsys, "dump", OP, "--shape", "2,3,1,4", "--dtype", "float16",
                           "--format", "text")
    assert code == 0
    assert out.startswith("graph aclnnBatchNormElemtBackward(%gradOut: f16[2,3,1,4]")
    assert "BroadcastTo(" in out and "ViewCopy(" in out and out.rstrip().endswith("}")


def test_dump_options_change_the_graph(capsys):
    code, out, _ = run_cli(capsys, "dump", OP, "--no-weight", "--counter-dtype", "int32",
                           "--grad-input-dtype", "bf16", "--platform", "Ascend950")
    assert code == 0
    assert "Fill(" in out and "%counter: s32[3]" in out and "%gradInput: bf16[2,3,1,4]" in out
    assert "arch=3510" in out


def test_dump_json_round_trips(capsys):
    code, out, _ = run_cli(capsys, "dump", OP, "--shape", "4,2,3", "--format", "json")
    assert code == 0
    assert json.loads(out)["name"] == OP
    g = opgraph.Graph.from_json(out)
    assert json.loads(g.to_json()) == json.loads(out)  # lossless round trip
    assert len(g.nodes) > 10 and g.verify() is g


def test_dump_dot_to_file(capsys, tmp_path):
    path = tmp_path / "g.dot"
    code, out, _ = run_cli(capsys, "dump", OP, "--format", "dot", "-o", str(path))
    assert code == 0
    assert str(path) in out
    text = path.read_text()
    assert text.startswith("digraph") and "SyncBatchNormBackwardElemt" in text


@pytest.mark.parametrize("level", [1, 2])
def test_dump_optimised_levels(capsys, level):
    code, out, err = run_cli(capsys, "dump", OP, "--level", str(level), "--format", "json")
    assert code == 0, err
    assert opgraph.Graph.from_json(out).name == OP


# --- run --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,bound", [("float32", 1e-6), ("float16", 1e-2), ("bfloat16", 2e-2)])
def test_run_error_is_small(capsys, dtype, bound):
    code, out, err = run_cli(capsys, "run", OP, "--shape", "4,5,3,2", "--dtype", dtype,
                             "--seed", "7")
    assert code == 0, err
    assert "phase 1:       0 (ACLNN_SUCCESS)" in out and "phase 2:       0 (ACLNN_SUCCESS)" in out
    assert "output:        gradInput" in out
    rel = float(re.search(r"max rel error: (\S+)", out).group(1))
    assert rel < bound


@pytest.mark.parametrize("extra", [
    ["--platform", "Ascend950", "--dtype", "bf16", "--grad-input-dtype", "float32"],
    ["--no-weight", "--counter-dtype", "int32", "--level", "0"],
    ["--dtype", "float16", "--counter-dtype", "float16", "--level", "1"],
    ["--shape", "0,3"],
])
def test_run_variants(capsys, extra):
    code, out, err = run_cli(capsys, "run", OP, *extra)
    assert code == 0, err
    assert float(re.search(r"max rel error: (\S+)", out).group(1)) < 1e-2


def test_counts_of_one_are_singular(capsys):
    """A fused op_api is one kernel: ``run`` and the table said '1 kernel launches'."""
    code, out, _ = run_cli(capsys, "run", "aclnnBatchNormElemt", "--level", "2")
    assert code == 0 and re.search(r"graph: .* after level 2, 1 kernel launch$", out, re.M)
    code, out, _ = run_cli(capsys, "dump", "aclnnBatchNormElemt", "--level", "2", "--format", "table")
    assert code == 0 and out.splitlines()[-1].startswith("1 node, 1 kernel launch, ")
    code, out, _ = run_cli(capsys, "dump", "aclnnBatchNormElemt", "--format", "table")
    assert re.match(r"\d+ nodes, \d+ kernel launches, ", out.splitlines()[-1])


def test_run_grad_input_dtype_is_honoured(capsys):
    code, out, _ = run_cli(capsys, "run", OP, "--dtype", "bf16", "--grad-input-dtype", "float32")
    assert code == 0 and "output:        gradInput f32[2,3,1,4]" in out


# --- bad arguments: one line on stderr, non-zero, no traceback -------------------------------
@pytest.mark.parametrize("argv", [
    ["dump", "aclnnNope"],
    ["dump", OP, "--shape", "2,x"],
    ["dump", OP, "--shape", ""],
    ["run", OP, "--dtype", "float99"],
    ["run", OP, "--platform", "Ascend999"],
    ["run", OP, "--shape", "4"],
    ["run", OP, "--level", "7"],
    ["run", OP, "--backend", "nope"],
    ["run", OP, "--shape", "2,0"],
    ["run", OP, "--dtype", "int32"],
    ["dump", OP, "--shape", "1,1,1,1,1,1,1,1,1"],
    ["run", OP, "--platform", "Ascend310P"],
    ["dump", OP, "-o", "/nonexistent-dir/g.txt"],
    ["frobnicate"],
    [],
])
def test_bad_arguments(capsys, argv):
    code, _, err = run_cli(capsys, *argv)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("opgraph: error: ")
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [[]] + [[m.__name__.rsplit(".", 1)[-1].replace("_", "-")]
                                         for m in COMMANDS])
def test_help_everywhere(capsys, argv):
    """Every command's --help, and for the commands that take an OP, OP's own."""
    code, out, err = run_cli(capsys, *argv, "--help")
    assert code == 0 and out.startswith("usage: opgraph") and err == "", err
    if "OP ..." in out:
        code, out, err = run_cli(capsys, *argv, OP, "--help")
        assert code == 0 and out.startswith(f"usage: opgraph {argv[0]} {OP}") and "--shape" in out


def test_commands_are_modules_with_add_parser():
    assert all(callable(m.add_parser) for m in COMMANDS)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) >= {"demo", "dump", "run"}


# --- the installed entry points ----------------------------------------------------------------
def test_python_dash_m_demo_subprocess():
    p = subprocess.run([sys.executable, "-m", "opgraph", "demo", "--no-graph"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert np.allclose(results(p.stdout)[0], EXPECTED, rtol=0, atol=1e-6)


def test_bad_argument_subprocess_has_no_traceback():
    p = subprocess.run([sys.executable, "-m", "opgraph", "dump", OP, "--shape", "2,x"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
