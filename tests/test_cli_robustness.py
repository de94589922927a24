"""Hostile option values on every ``opgraph`` command end in ONE stderr line
``opgraph: error: ...`` that names the option, with a non-zero exit and never an internal
error; inputs too big for memory are refused before any array is made; a reader that closes
stdout early (``opgraph dump ... | head -2``) ends the command quietly."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import select
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import opgraph.core.opapi as opapi
from opgraph.cli import cases, common, main, ops, run

try:
    import fcntl
except ImportError:  # not on Windows
    fcntl = None

OP = "aclnnBatchNormElemtBackward"
ROOT = Path(__file__).resolve().parents[1]
RECORDING = ("run", "dump", "emit-c", "plan", "emit-cpp")  # the commands that build a case


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """emit-cpp writes .bin files to the current directory: keep them out of the repository."""
    monkeypatch.chdir(tmp_path)


def error_line(capsys, argv: list[str], option: str, status: "int | None" = None) -> str:
    """Run the CLI in-process; assert the one-line error convention (and exit ``status``) and
    return the line."""
    code = main(argv)
    _, err = capsys.readouterr()
    assert code != 0 if status is None else code == status
    assert "internal error" not in err and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("opgraph: error: ")
    assert option in lines[0], lines[0]
    return lines[0]


# --- every command, hostile values --------------------------------------------------------------
HOSTILE = [
    (["run", OP, "--shape", "99999999999999999999999,3"], "--shape"),
    (["run", OP, "--shape", "65536,4,262144"], "--shape"),
    (["dump", OP, "--shape", "99999999999,3"], "--shape"),
    (["tiling", "--shape", "99999999999,99999999999"], "--shape"),
    (["run", OP, "--shape", ",".join(["1"] * 65)], "--shape"),  # more dims than numpy has
    (["tiling", "--shape", "1000000000000"], "--shape"),  # 3.6 TiB of write counters
    (["tiling", "--shape", "0,3"], "--shape"),  # no elements: no kernel, no tiling
    (["tiling", "--shape", "2,3", "--param-dtype", "f16"], "--param-dtype"),  # no f32/f16 kernel
    (["run", OP, "--seed", "-1"], "--seed"),
    (["run", OP, "--seed", "-99999999999999999999"], "--seed"),
    (["emit-cpp", OP, "--embed-limit", "-1"], "--embed-limit"),
    (["demo", "--dtype", "int32"], "--dtype"),  # the article has f32, f16, bf16 examples only
    (["demo", "--dtype", "complex64"], "--dtype"),
    (["demo", "--platform", "Ascend310P", "--no-graph"], "--platform"),  # no kernel there
    (["demo", "--platform", "Ascend910", "--dtype", "bf16", "--no-graph"], "--platform"),
    (["run", "aclnnSyncBatchNormGatherStats", "--shape", "3,2,2"], "--shape"),  # N,C only
    (["dump", "aclnnSyncBatchNormGatherStats", "--shape", "3,2,2,2"], "--shape"),
] + [([cmd, OP, "--shape", shape], "--shape") for cmd in RECORDING for shape in (
    "4611686018427387904,0",  # empty, but numpy cannot describe it
    "99999999999999999999999,0",
    "0,99999999999",  # empty data, 745 GiB of channel vectors
    "2,99999999999",
)]


@pytest.mark.parametrize("argv,option", HOSTILE,
                         ids=lambda v: " ".join(v)[:80] if isinstance(v, list) else v)
def test_hostile_value_is_one_error_line_naming_the_option(capsys, argv, option):
    error_line(capsys, argv, option)


def test_too_big_shape_says_how_much_memory_before_allocating(capsys, monkeypatch):
    def no_arrays(*_):
        raise AssertionError("arrays were made before the memory check")
    monkeypatch.setitem(opapi._REGISTRY, OP, dataclasses.replace(opapi.get_op_api(OP), make_inputs=no_arrays))
    line = error_line(capsys, ["dump", OP, "--shape", "65536,4,262144"], "--shape")
    # 2**36 elements x (gradOut + input + gradInput) x 4 B = 768 GiB (+ 96 B of channel vectors)
    assert "768.0 GiB" in line and "physical memory" in line and "limit" in line


@pytest.mark.parametrize("extra,nbytes", [
    ([], 3 * 96 * 4 + 3 * (5 * 4 + 4)),  # f32 data x3, five f32 channel vectors + f32 counter
    (["--dtype", "f16", "--no-weight", "--counter-dtype", "int32", "--grad-input-dtype", "f32"],
     96 * (2 + 2 + 4) + 3 * (4 * 2 + 4)),
])
def test_memory_limit_counts_exactly_the_input_and_output_bytes(capsys, monkeypatch, extra, nbytes):
    argv = ["dump", OP, "--shape", "2,3,4,4", *extra]
    share = common.MEMORY_SHARE
    monkeypatch.setattr(common, "physical_memory", lambda: nbytes * share)  # limit == nbytes
    assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    p = common.Parser()
    cases.add_op_subparsers(p)
    case = cases.build_case(p.parse_args(argv[1:]))
    assert sum(a.nbytes for a in case.arrays.values() if a is not None) == nbytes  # no more
    monkeypatch.setattr(common, "physical_memory", lambda: nbytes * share - 1)  # one byte short
    line = error_line(capsys, argv, "--shape 2,3,4,4")
    assert f"need {nbytes} B" in line and f"limit of {nbytes - 1} B" in line


def test_run_counts_what_running_and_checking_hold(capsys, monkeypatch):
    """run holds the float64 draws and reference and the graph's temporaries too: ~5x the
    inputs and outputs (a shape just under dump's limit peaked at half of memory)."""
    nbytes, share = 3 * 96 * 4 + 3 * (5 * 4 + 4), common.MEMORY_SHARE
    argv = ["run", OP, "--shape", "2,3,4,4"]
    monkeypatch.setattr(common, "physical_memory", lambda: nbytes * run.PEAK * share)
    assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    monkeypatch.setattr(common, "physical_memory", lambda: nbytes * run.PEAK * share - 1)
    line = error_line(capsys, argv, "--shape 2,3,4,4")
    assert f"inputs and outputs and running and checking them (~{run.PEAK}x their size) need " \
           f"{nbytes * run.PEAK} B" in line


def test_tiling_memory_limit_counts_a_4_byte_counter_per_element(capsys, monkeypatch):
    share = common.MEMORY_SHARE
    monkeypatch.setattr(common, "physical_memory", lambda: 24 * share)  # 6 elements x 4 B
    assert main(["tiling", "--shape", "2,3"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(common, "physical_memory", lambda: 24 * share - 1)
    assert "need 24 B" in error_line(capsys, ["tiling", "--shape", "2,3"], "--shape 2,3")


def test_out_of_memory_anyway_is_one_error_line(capsys, monkeypatch):
    def oom(*_):
        raise MemoryError
    monkeypatch.setitem(opapi._REGISTRY, OP, dataclasses.replace(opapi.get_op_api(OP), make_inputs=oom))
    assert "out of memory" in error_line(capsys, ["dump", OP], "--shape")


# --- paths --------------------------------------------------------------------------------------
@pytest.fixture
def paths(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    return {"directory": str(tmp_path / "dir"), "under a file": str(tmp_path / "file" / "x"),
            "empty": ""}


@pytest.mark.parametrize("target", ["directory", "under a file", "empty"])
@pytest.mark.parametrize("cmd", [["dump", OP], ["emit-c", OP], ["plan", OP], ["emit-cpp", OP]],
                         ids=lambda c: c[0])
def test_unwritable_output_names_the_option(capsys, paths, cmd, target):
    error_line(capsys, [*cmd, "-o", paths[target]], "-o/--output")


@pytest.mark.parametrize("to_file", [True, False], ids=["-o", "stdout"])
def test_unwritable_bin_file_of_emit_cpp_writes_nothing(capsys, tmp_path, to_file):
    (tmp_path / "gradOut.bin").mkdir()  # the program can be written, this input cannot
    argv = ["emit-cpp", OP, "--embed-limit", "0", *(["-o", str(tmp_path / "p.cpp")] * to_file)]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.count("\n") == 1 and "gradOut.bin" in err, err
    assert sorted(os.listdir(tmp_path)) == ["gradOut.bin"]  # no program, no other .bin file


def test_bad_output_of_dump_leaves_the_dump_dir_unwritten(capsys, tmp_path):
    argv = ["dump", OP, "--level", "2", "--dump-dir", str(tmp_path / "d"), "-o", "/nonexistent/x"]
    error_line(capsys, argv, "-o/--output")
    assert os.listdir(tmp_path) == []


def test_netron_missing_writes_neither_page_nor_onnx(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "netron", None)  # import netron raises ImportError
    error_line(capsys, ["view", OP, "--netron", "-o", str(tmp_path / "v.html")], "--netron")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("target", ["file", "under a file", "empty"])
def test_bad_dump_dir_names_the_option(capsys, paths, tmp_path, target):
    directory = str(tmp_path / "file") if target == "file" else paths[target]
    error_line(capsys, ["dump", OP, "--level", "2", "--dump-dir", directory], "--dump-dir")
    assert (tmp_path / "file").read_text() == "x"  # untouched


# --- stdout closed early ------------------------------------------------------------------------
def first_lines_then_close(argv: list[str], n: int = 2) -> tuple[int, bytes, bytes]:
    """``python -m opgraph ARGV | head -n`` through a 4 KiB pipe: read n lines, close, wait."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)  # smaller than the output: the writer must wait
    p = subprocess.Popen([sys.executable, "-m", "opgraph", *argv], stdout=w,
                         stderr=subprocess.PIPE, cwd=ROOT)
    os.close(w)
    got = b""
    try:
        while got.count(b"\n") < n and select.select([r], [], [], 300)[0]:
            chunk = os.read(r, 64)
            if not chunk:
                break
            got += chunk
    finally:
        os.close(r)
    try:
        _, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    return p.returncode, got, err


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs a resizable pipe (Linux)")
def test_closed_stdout_pipe_exits_quietly():
    # 8 KB of buffered prints, flushed through a 4 KiB pipe after the reader has gone
    code, out, err = first_lines_then_close(["demo"])
    assert out.count(b"\n") >= 2  # the reader did get its lines
    assert err == b""  # no traceback, no "Exception ignored", no internal error
    assert code == 141  # 128 + SIGPIPE, like any tool whose reader went away


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["dump", OP], ["dump", OP, "--passes", "--level", "2"]],
                         ids=["dump", "passes"])
def test_full_stdout_is_one_error_line(argv):
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "opgraph", *argv], stdout=full,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    assert p.returncode != 0
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("opgraph: error: "), p.stderr
    assert "No space left on device" in lines[0] and "internal error" not in lines[0]


@pytest.mark.parametrize("argv", [["ops"], ["--version"], ["--help"], ["dump", OP], ["run", OP],
                                  ["tiling", "--shape", "2,3"], ["dump", OP, "-o", "g.txt"]],
                         ids=" ".join)
def test_closed_stdout_is_one_error_line(capsys, monkeypatch, tmp_path, argv):
    monkeypatch.setattr(sys, "stdout", None)  # what Python sets when started with fd 1 closed
    error_line(capsys, argv, "stdout is closed", status=1)
    assert os.listdir(tmp_path) == []  # nothing written to -o either


def test_closed_stdout_of_the_process_is_one_error_line():
    p = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "opgraph", "ops"],
                       stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 1 and p.stderr == "opgraph: error: stdout is closed\n", p.stderr


# --- user code calling sys.exit -----------------------------------------------------------------
EXITS = {"exit0": "import sys\nsys.exit(0)\n", "message": "raise SystemExit('msg')\n",
         "in step": "import sys\n\ndef step(shape, dtype):\n    sys.exit(3)\n"}


@pytest.mark.parametrize("body,argv,option,code", [
    ("exit0", ["--load", "u.py", "ops"], "--load 'u.py': the module called sys.exit(0)", 2),
    ("message", ["--load", "u.py", "ops"], "--load 'u.py': the module called sys.exit('msg')", 2),
    ("exit0", ["capture", "u.py"], "FILE 'u.py': importing it called sys.exit(0)", 1),
    ("message", ["capture", "u.py"], "FILE 'u.py': importing it called sys.exit('msg')", 1),
    ("in step", ["capture", "u.py"], "FILE 'u.py': step() called sys.exit(3)", 1),
    ("in step", ["capture", "u.py", "--format", "stats"],
     "FILE 'u.py': step() called sys.exit(3)", 1),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_user_code_calling_sys_exit_is_one_error_line(capsys, tmp_path, body, argv, option, code):
    (tmp_path / "u.py").write_text(EXITS[body])
    assert main(argv) == code
    out, err = capsys.readouterr()
    assert err == f"opgraph: error: {option}\n" and out == "", err


def test_bad_trace_json_prints_no_report_first(capsys):
    assert main(["run", OP, "--trace-json", "/nonexistent/t.json"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("opgraph: error: --trace-json: cannot write"), err


# --- options that conflict ----------------------------------------------------------------------
STEP = "def step(shape, dtype):\n    pass\n"


@pytest.mark.parametrize("argv,first,second", [
    (["dump", OP, "--stats", "--passes"], "--stats", "--passes"),
    (["dump", OP, "--stats", "--dump-dir", "d"], "--stats", "--dump-dir"),
    (["capture", "s.py", "--format", "stats", "--run", "numpy"], "--format stats", "--run"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_conflicting_options_are_refused_naming_both(capsys, tmp_path, argv, first, second):
    (tmp_path / "s.py").write_text(STEP)
    error_line(capsys, argv, f"{first} and {second} cannot be combined", status=2)
    assert os.listdir(tmp_path) == ["s.py"]


@pytest.mark.parametrize("output", ["s.py", "./s.py", "link.py"])
def test_capture_refuses_to_overwrite_its_file(capsys, tmp_path, output):
    (tmp_path / "s.py").write_text(STEP)
    (tmp_path / "link.py").symlink_to("s.py")
    error_line(capsys, ["capture", "s.py", "-o", output], "which this command reads", status=2)
    assert (tmp_path / "s.py").read_text() == STEP


@pytest.mark.parametrize("cmd", ["dump", "emit-c", "plan", "emit-cpp", "view"])
def test_an_output_over_a_loaded_py_file_is_refused(capsys, tmp_path, cmd):
    """-o naming the op_api module --load imports (by another spelling of its path)."""
    (tmp_path / "ops.py").write_text("# registers nothing\n")
    error_line(capsys, [cmd, OP, "--load", "ops.py", "-o", str(tmp_path / "ops.py")],
               "which this command reads", status=2)
    assert (tmp_path / "ops.py").read_text() == "# registers nothing\n"
    assert os.listdir(tmp_path) == ["ops.py"]


def test_emit_cpp_refuses_a_program_named_like_its_data(capsys, tmp_path):
    argv = ["emit-cpp", OP, "--shape", "64,64", "--embed-limit", "0", "-o", "gradOut.bin"]
    error_line(capsys, argv, "would overwrite its input data gradOut.bin", status=2)
    assert os.listdir(tmp_path) == []


# --- the message names the argument at fault ----------------------------------------------------
GATHER = "aclnnBatchNormGatherStatsWithCounts"


@pytest.mark.parametrize("argv,start", [
    (["dump", GATHER, "--ranks=-1"], "opgraph: error: --ranks: "),
    (["dump", GATHER, "--ranks", "1000000000000"],
     "opgraph: error: --shape 2,3,1,4 --ranks 1000000000000: "),
    (["syncbn", "--shape", "2,2", "--seed", str(2**63)], "opgraph: error: argument --seed: "),
    (["run", OP, "--seed", "99999999999999999999999"], "opgraph: error: argument --seed: "),
    (["capture", "/tmp"], "opgraph: error: FILE '/tmp': is a directory"),
    (["capture", "/dev/null"], "opgraph: error: FILE '/dev/null': is not a regular file"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_message_names_the_argument_at_fault(capsys, argv, start):
    assert error_line(capsys, argv, "", status=2).startswith(start)


def test_emit_c_without_fused_node_says_why(capsys):
    line = error_line(capsys, ["emit-c", "aclnnBatchNormReduce"], "level-2 graph", status=1)
    assert "fusion happens at --level 2" not in line and "FusedReduce" in line
    line = error_line(capsys, ["emit-c", "aclnnBatchNormReduce", "--level", "1"], "level-1 graph")
    assert "fusion happens at --level 2" in line


# --- odd but legal values: NaN results, clean output --------------------------------------------
@pytest.mark.parametrize("argv", [["run", "aclnnBatchNormStats", "--eps=-5"],
                                  ["run", "aclnnSyncBatchNormGatherStats", "--momentum", "1e300"],
                                  ["run", "aclnnSyncBatchNormGatherStats", "--eps=-5"]],
                         ids=" ".join)
def test_odd_scalars_run_without_numpy_warnings(capsys, argv):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would be printed by the console script
        assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == "" and "max abs error" in out


def test_errors_of_huge_values_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run.errors(np.float64([1e308]), np.float64([-1e308])) == (math.inf, math.inf)


@pytest.mark.parametrize("name", sorted(opapi.op_api_specs()))
def test_option_help_shows_its_default_once(capsys, name):
    assert main(["run", name, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert not re.search(r"\(default[^)]*\) \(default", text), text


@pytest.mark.parametrize("op,option,value", [("aclnnBatchNormStats", "eps", -5.0),
                                             ("aclnnSyncBatchNormGatherStats", "momentum", 1e300)])
def test_references_of_odd_scalars_do_not_warn(op, option, value):
    p = common.Parser()
    cases.add_op_subparsers(p)
    case = cases.build_case(p.parse_args([op, f"--{option}={value}"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = case.spec.reference(case.arrays)
    assert any(np.isnan(v).any() or np.isinf(v).any() for v in ref.values())


# --- an ASCII terminal ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["ops"], ["dump", "aclnnBatchNormReduce", "--help"]], ids=" ".join)
def test_ascii_stdout_gets_escapes_not_an_error(argv):
    p = subprocess.run([sys.executable, "-m", "opgraph", *argv], capture_output=True, cwd=ROOT,
                       env={**os.environ, "PYTHONIOENCODING": "ascii"}, timeout=300)
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    assert b"\\u03a3" in p.stdout and max(p.stdout) < 128


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["ops", "--help"]], ids=" ".join)
def test_help_to_a_full_disk_is_one_error_line(argv):
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "opgraph", *argv], stdout=full,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 1 and p.stderr == "opgraph: error: No space left on device\n", p.stderr


@pytest.mark.parametrize("argv,helped", [
    (["dump", OP, "--bogus"], f"opgraph dump {OP}"), (["ops", "--bogus"], "opgraph ops"),
    (["dump", "--bogus", OP], "opgraph dump"), (["--bogus", "ops"], "opgraph"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_unrecognized_arguments_point_to_the_help_that_lists_the_options(capsys, argv, helped):
    line = error_line(capsys, argv, "unrecognized arguments: --bogus", status=2)
    assert line.endswith(f"(see '{helped} --help')")


@pytest.mark.parametrize("where", ["before", "after"])
def test_an_internal_error_is_one_line_or_with_traceback_its_exception(capsys, monkeypatch, where):
    def boom(args):
        raise RuntimeError("boom")
    monkeypatch.setattr(ops, "run", boom)
    assert main(["ops"]) == 1
    assert capsys.readouterr().err == \
        "opgraph: internal error: RuntimeError: boom (rerun with --traceback)\n"
    argv = ["--traceback", "ops"] if where == "before" else ["ops", "--traceback"]
    with pytest.raises(RuntimeError, match="boom"):
        main(argv)


@pytest.mark.parametrize("argv,option", [
    (["dump", OP, "--shape", "２,３"], "--shape"),  # full-width digits: int() takes them
    (["dump", OP, "--shape", "+2,3"], "--shape"),
    (["dump", OP, "--shape", "2_0,3"], "--shape"),  # int() reads 20
    (["run", OP, "--seed", "1_0"], "--seed"),
    (["dump", "aclnnBatchNormGatherStatsWithCounts", "--ranks", "1_0"], "--ranks"),
    (["dump", OP, "--level", "２"], "--level"),  # int() reads 2
    (["run", OP, "--level", "+1"], "--level"),
    (["capture", str(ROOT / "examples" / "capture_syncbn.py"), "--level", "٢"], "--level"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_integers_are_plain_ascii_decimals(capsys, argv, option):
    error_line(capsys, argv, option, status=2)


def test_plain_decimals_with_spaces_and_signs_where_allowed():
    assert common.parse_shape(" 2, 3 ") == (2, 3)
    assert common.integer_option("-4") == -4 and common.parse_int("007") == 7


@pytest.mark.parametrize("argv", [["--loa", "m.py", "ops"], ["--traceb", "ops"], ["ops", "--loa", "m.py"]],
                         ids=lambda a: " ".join(a))
def test_an_abbreviated_load_or_traceback_is_refused_not_ignored(capsys, argv):
    """main takes --load and --traceback from the line itself; argparse read --loa as --load
    and the module was silently not imported (exit 0)."""
    Path("m.py").write_text("# registers nothing\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("opgraph: error: "), err
