"""When a command fails part-way, what the user sees and what is left on disk: a failed write
leaves every output as it was (the files of one command are written all or none, through
temporaries renamed into place), user code that ends oddly (``sys.exit`` in an op_api's
callbacks, ``GeneratorExit``, a closed stdout) and a failing C compiler give one line."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from opgraph.cli import common, main
from opgraph.core import html
from opgraph.core.layout import LayoutUnavailable

OP = "aclnnBatchNormElemtBackward"
ROOT = Path(__file__).resolve().parents[1]


def opgraph_process(args: list[str], cwd: Path, max_file_bytes: "int | None" = None,
                    **env: str) -> subprocess.CompletedProcess:
    """``opgraph ARGS`` in a process of its own with ``env`` added to the environment; with
    ``max_file_bytes`` it may not write a file past that size (a full disk, as far as the
    writes go; Python ignores SIGXFSZ, so a write fails with EFBIG)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    return subprocess.run([sys.executable, "-m", "opgraph", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, preexec_fn=limit if max_file_bytes else None,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def one_error_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("opgraph: error: "), proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def test_a_failed_write_leaves_the_old_file(tmp_path):
    old = tmp_path / "g.json"
    old.write_text("ORIGINAL\n")
    proc = opgraph_process(["dump", OP, "--format", "json", "-o", "g.json"], tmp_path, 2048)
    one_error_line(proc, "-o/--output", "g.json", "File too large")
    assert old.read_text() == "ORIGINAL\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.json"]  # no temporary left


def test_a_write_replaces_the_file_and_keeps_its_mode(tmp_path):
    old = tmp_path / "g.txt"
    old.write_text("ORIGINAL\n")
    old.chmod(0o640)
    assert main(["dump", OP, "-o", str(old)]) == 0
    assert "ViewCopy" in old.read_text() and (old.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.txt"]


def test_emit_cpp_writes_its_bin_files_and_program_all_or_none(tmp_path):
    proc = opgraph_process(["emit-cpp", OP, "--embed-limit", "0", "-o", "p.cpp"], tmp_path, 4096)
    one_error_line(proc, "p.cpp", "File too large")
    assert list(tmp_path.iterdir()) == []
    proc = opgraph_process(["emit-cpp", OP, "--embed-limit", "0", "-o", "p.cpp"], tmp_path, 1 << 30)
    assert proc.returncode == 0, proc.stderr
    assert "p.cpp" in {p.name for p in tmp_path.iterdir()} and len(list(tmp_path.glob("*.bin"))) > 1


def test_emit_cpp_refuses_a_fifo_or_device_as_the_program_beside_its_bin_files(capsys, tmp_path):
    fifo = tmp_path / "fifo"  # (as /dev/full would be: its .bin files would land in /dev)
    os.mkfifo(fifo)
    assert main(["emit-cpp", OP, "--embed-limit", "0", "-o", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opgraph: error: -o/--output '{fifo}' is not a regular file")
    assert [p.name for p in tmp_path.iterdir()] == ["fifo"]


def test_dump_dir_files_and_the_report_are_written_all_or_none(tmp_path):
    proc = opgraph_process(["dump", OP, "--level", "2", "--dump-dir", "dd/x", "--passes",
                            "-o", "report.txt"], tmp_path, 2048)
    one_error_line(proc, "--dump-dir", "File too large")
    assert list(tmp_path.iterdir()) == []  # not even the directories made for the files
    assert main(["dump", OP, "--level", "2", "--dump-dir", str(tmp_path / "dd"), "--passes",
                 "-o", str(tmp_path / "report.txt")]) == 0
    assert (tmp_path / "report.txt").read_text().count("\n") > 3
    assert (tmp_path / "dd" / "00-input.json").exists()


def test_an_output_path_ending_in_a_slash_names_a_directory(capsys, tmp_path):
    assert main(["dump", OP, "-o", str(tmp_path / "missing") + "/"]) != 0
    err = capsys.readouterr().err
    assert "names a directory" in err and len(err.splitlines()) == 1


USER_OP = '''
import sys
import numpy as np
from opgraph.aclnn import op_api
from opgraph.core.opapi import Param

def make_inputs(cfg, rng):
    {make_inputs}
    return {{"x": np.ones(cfg.shape, np.float32)}}

@op_api("aclnnUserOdd", params=(Param("x", "tensor", "input"),), make_inputs=make_inputs)
def aclnnUserOddGetWorkspaceSize(ex, x):
    pass
'''


@pytest.mark.parametrize("body, words", [
    ("sys.exit(0)", ["user code called sys.exit(0)"]),
    ("sys.exit('bye')", ["user code called sys.exit('bye')"]),
    ("raise GeneratorExit('g')", ["in user code at", "userop.py:8: GeneratorExit: g"]),
    ("raise RuntimeError('bad cfg')", ["error: in user code at", "userop.py:8: RuntimeError: bad cfg"])])
def test_user_code_that_ends_oddly_gives_one_line(tmp_path, body, words):
    """(In a process of its own: the op_api it registers must not reach other tests.)"""
    mod = tmp_path / "userop.py"
    mod.write_text(USER_OP.format(make_inputs=body))
    proc = opgraph_process(["run", "aclnnUserOdd", "--load", str(mod), "--shape", "2,3"], tmp_path)
    assert proc.returncode == 1 and "internal error" not in proc.stderr
    one_error_line(proc, *words)


def test_a_failure_in_a_loaded_package_names_its_line_and_an_opgraph_bug_stays_internal(tmp_path):
    """A package --load'ed by name: its submodules are user code too. A failure that no user
    frame is part of is still labelled internal."""
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import ops\n")
    (pkg / "ops.py").write_text(USER_OP.format(make_inputs="raise RuntimeError('in the package')"))
    proc = opgraph_process(["run", "aclnnUserOdd", "--load", "userpkg", "--shape", "2,3"], tmp_path)
    one_error_line(proc, "in user code at", "ops.py:8: RuntimeError: in the package")
    (pkg / "ops.py").write_text(USER_OP.format(make_inputs="pass"))
    crash = tmp_path / "sitecustomize.py"  # an opgraph function failing, outside user code
    crash.write_text("import opgraph.cli.run as r\n"
                     "def boom(*a, **k):\n    raise RuntimeError('opgraph bug')\n"
                     "r.build_case = boom\n")
    proc = opgraph_process(["run", "aclnnUserOdd", "--load", "userpkg", "--shape", "2,3"], tmp_path,
                           PYTHONPATH=f"{tmp_path}:{ROOT}")
    assert proc.stderr.startswith("opgraph: internal error: RuntimeError: opgraph bug"), proc.stderr


@pytest.mark.parametrize("source, words", [
    ("def step(shape, dtype):\n    raise GeneratorExit('g')\n", ["step() failed: GeneratorExit: g"]),
    ("class Odd(BaseException):\n    pass\nraise Odd('at import')\n", ["importing it failed: Odd: at import"]),
    ("import sys\ndef step(shape, dtype):\n    sys.stdout.close()\n", ["stdout was closed"])])
def test_a_capture_file_that_ends_oddly_gives_one_line(tmp_path, source, words):
    path = tmp_path / "step.py"
    path.write_text(source)
    proc = opgraph_process(["capture", str(path), "--shape", "2,3"], tmp_path)
    one_error_line(proc, *words)


def test_a_failing_c_compiler_is_one_line(tmp_path):
    cc = tmp_path / "fakecc"
    cc.write_text("#!/bin/sh\nfor i in 1 2 3 4 5; do echo \"k.c:$i: error: bad\" >&2; done\nexit 1\n")
    cc.chmod(0o755)
    proc = opgraph_process(["run", "aclnnBatchNormStats", "--backend", "native", "--shape", "2,13"],
                           tmp_path, CC=str(cc), OPGRAPH_CACHE_DIR=str(tmp_path / "cache"))
    line = one_error_line(proc, "C compiler failed", "k.c:1: error: bad")
    assert line.endswith("(3 more lines)"), line


def test_syncbn_refuses_one_value_per_channel(capsys):
    pytest.importorskip("torch", reason="pip install torch (opgraph[torch])")
    assert main(["syncbn", "--shape", "1,3,1,1", "--ranks", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opgraph: error: --shape 1,3,1,1: training batch norm needs more than one")


@pytest.mark.parametrize("value", ["abc", "nan", "-1"])
def test_a_bad_spin_time_names_its_variable(tmp_path, value):
    proc = opgraph_process(["run", OP, "--backend", "native"], tmp_path, OPGRAPH_SPIN_US=value,
                           OPGRAPH_RUNTIME="team")
    assert proc.returncode != 0
    assert f"OPGRAPH_SPIN_US must be a number of microseconds >= 0, got {value!r}" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr


def test_a_capture_file_is_read_as_python_source_whatever_its_suffix(tmp_path):
    """A .so is not dlopen()ed as an extension module (nor a .pyc run as bytecode)."""
    so = tmp_path / "step.so"
    so.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(64))
    proc = opgraph_process(["capture", str(so), "--shape", "2,3"], tmp_path)
    line = one_error_line(proc, "importing it failed")
    assert "ELF" not in line and ("SyntaxError" in line or "ValueError" in line), line
    pyc = tmp_path / "step.pyc"
    pyc.write_text("def step(shape, dtype):\n    raise RuntimeError('source ran')\n")
    proc = opgraph_process(["capture", str(pyc), "--shape", "2,3"], tmp_path)
    one_error_line(proc, "step() failed: RuntimeError: source ran")


def test_emit_cpp_counts_the_embedded_text_against_the_memory_limit(capsys, monkeypatch, tmp_path):
    """Inputs embedded as C++ literals take ~110 B an element while the text is built, far
    more than the arrays: a large --embed-limit is refused before the text is made."""
    monkeypatch.chdir(tmp_path)  # (the .bin files of the first call go here)
    shape = (2, 3, 64, 64)  # gradOut and input: 24576 elements each
    monkeypatch.setattr(common, "physical_memory", lambda: (1 << 20) * common.MEMORY_SHARE)  # 1 MiB
    argv = ["emit-cpp", OP, "--shape", ",".join(map(str, shape)), "--embed-limit"]
    assert main([*argv, "0"]) == 0  # the arrays alone fit; .bin files, no embedding
    capsys.readouterr()
    assert main([*argv, "100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opgraph: error: --shape 2,3,64,64 --embed-limit 100000: the inputs "
                          "embedded as C++ text"), err


def test_load_refuses_a_file_that_is_not_python(capsys, tmp_path, monkeypatch):
    """``--load graph.json`` names a file: it is not taken as module ``graph`` (which would run
    a graph.py beside it) and submodule ``json``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "graph.py").write_text("raise RuntimeError('graph.py ran')\n")
    (tmp_path / "graph.json").write_text("{}")
    assert main(["--load", "graph.json", "ops"]) == 2
    err = capsys.readouterr().err
    assert err == ("opgraph: error: --load 'graph.json': a file that is not a .py file; --load "
                   "takes a module name or a .py file\n"), err


@pytest.mark.parametrize("cmd", [["dump", OP], ["emit-c", OP], ["plan", OP], ["emit-cpp", OP],
                                 ["view", OP], ["capture", "step.py", "--shape", "2,3"]],
                         ids=lambda c: c[0])
def test_an_output_in_a_missing_directory_is_refused_by_every_command(capsys, tmp_path,
                                                                    monkeypatch, cmd):
    """No command makes -o's directory (emit-c, plan and capture used to, even /nonexistent);
    capture refuses before its step runs."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "step.py").write_text("open('ran', 'w').close()\ndef step(shape, dtype):\n    pass\n")
    code = main([*cmd, "-o", str(tmp_path / "missing" / "out.txt")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("opgraph: error: -o/--output: ") and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["step.py"]


def test_an_output_another_output_writes_is_refused_and_nothing_written(capsys, tmp_path):
    """-o naming one of --dump-dir's files: one of them would silently replace the other."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "00-input.txt").write_text("keep")
    code = main(["dump", OP, "--level", "2", "--dump-dir", str(d), "-o", str(d / "00-input.txt")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--dump-dir writes the same file" in err, err
    assert os.listdir(d) == ["00-input.txt"] and (d / "00-input.txt").read_text() == "keep"


@pytest.mark.parametrize("argv", [
    ["view", OP, "-o", "page.html"],
    ["capture", str(ROOT / "examples" / "capture_syncbn.py"), "--shape", "2,3", "--format", "html",
     "-o", "page.html"]], ids=lambda a: a[0])
def test_no_layout_engine_is_one_error_line(capsys, tmp_path, monkeypatch, argv):
    """Neither graphviz's dot nor grandalf: the environment's, one line (capture --format html
    said 'internal error')."""
    def unavailable(*args, **kwargs):
        raise LayoutUnavailable("laying out a graph needs graphviz's dot on PATH or grandalf")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(html, "layout", unavailable)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1 and err == "opgraph: error: laying out a graph needs graphviz's dot on PATH " \
                                "or grandalf\n", err
    assert os.listdir(tmp_path) == []


def test_an_output_naming_stdout_is_written_as_stdout(tmp_path):
    """-o /dev/stdout: no 'wrote /dev/stdout' line appended to the JSON in a pipe, and
    emit-cpp's .bin files go to the current directory as for stdout (with stdout redirected to
    a file they went to /dev, beside /dev/stdout); --trace-json may not mix into the summary."""
    proc = opgraph_process(["dump", OP, "--format", "json", "-o", "/dev/stdout"], tmp_path)
    assert proc.returncode == 0 and json.loads(proc.stdout)["name"] == OP, proc.stdout[-200:]
    with open(tmp_path / "prog.cpp", "w") as out:
        proc = subprocess.run([sys.executable, "-m", "opgraph", "emit-cpp", OP, "--embed-limit", "0",
                               "-o", "/dev/stdout"], cwd=tmp_path, stdout=out, stderr=subprocess.PIPE,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "gradOut.bin").is_file() and "wrote" not in (tmp_path / "prog.cpp").read_text()
    proc = opgraph_process(["run", OP, "--trace-json", "/dev/stdout"], tmp_path)
    one_error_line(proc, "--trace-json: expected a file name")


def test_netron_with_the_page_on_stdout_keeps_its_notes_out_of_the_page(tmp_path):
    """view --netron -o -: the page alone on stdout ('wrote ... ONNX' and 'Netron is serving'
    on stderr), the ONNX file in the current directory."""
    (tmp_path / "netron.py").write_text("def start(path):\n    pass\ndef wait():\n    pass\n")
    proc = opgraph_process(["view", OP, "--netron", "-o", "-"], tmp_path,
                           PYTHONPATH=f"{tmp_path}:{ROOT}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("</html>\n") and "Netron is serving" in proc.stderr
    assert (tmp_path / f"{OP}.level2.onnx").is_file()
