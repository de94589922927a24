"""Every script in examples/ runs with the current interpreter and prints the right values (the
torch ones: tests/test_torch_examples.py; syncbn_step_one_process.py: tests/test_syncbn_chain.py),
and so does every Python block of the README."""
from __future__ import annotations

import doctest
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RESULT = re.compile(r"^result\[(\d+)\] is: (\S+)$", re.M)


def run_example(name: str, *args: str) -> str:
    p = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                       timeout=300, cwd=EXAMPLES.parent)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.mark.parametrize("args,values", [
    # FLOAT: 0.9 * i; FLOAT16 computes in half; BF16 computes in float, rounds to bf16
    ((), [0.0, 0.9, 1.8, 2.7, 3.6, 4.5, 5.4, 6.3]),
    (("--dtype", "float16"), [0.0, 0.899902, 1.799805, 2.699219, 3.599609, 4.5, 5.398438, 6.300781]),
    (("--dtype", "bfloat16"), [0.0, 0.898438, 1.796875, 2.703125, 3.59375, 4.5, 5.40625, 6.3125]),
], ids=["float", "float16", "bfloat16"])
def test_article_examples(args, values):
    out = run_example("batch_norm_elemt_backward.py", *args)
    got = [(int(i), float(v)) for i, v in RESULT.findall(out)]
    assert [i for i, _ in got] == list(range(8))
    assert [v for _, v in got] == pytest.approx(values, abs=1e-6)
    assert "workspaceSize = " in out


def test_article_example_refuses_an_unknown_dtype():
    p = subprocess.run([sys.executable, str(EXAMPLES / "batch_norm_elemt_backward.py"), "--dtype", "int8"],
                       capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent)
    assert p.returncode == 2 and "invalid choice: 'int8'" in p.stderr and "result[" not in p.stdout


def test_compose_your_own_op():
    out = run_example("compose_your_own_op.py")
    assert "scale=NULL -> 161001" in out
    assert "graph aclnnChannelScale(" in out and "ExampleScaledMul(" in out
    assert "matches numpy" in out


def test_compose_your_own_op_twice_in_one_process():
    code = ("import runpy\n"
            "for _ in range(2):\n"
            "    assert runpy.run_path('examples/compose_your_own_op.py')['main']() == 0\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=EXAMPLES.parent)
    assert p.returncode == 0, p.stderr


def test_capture_syncbn_as_a_script_and_its_docstring():
    out = subprocess.run([sys.executable, str(EXAMPLES / "capture_syncbn.py"), "--shape", "2,3,4,4"],
                         capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent)
    assert out.returncode == 0, out.stderr
    levels = re.findall(r"^level (\d): one by one \d+ launches \+ 2 collectives", out.stdout, re.M)
    assert levels == ["0", "1", "2"] and "graph capture(" in out.stdout
    spec = importlib.util.spec_from_file_location("capture_syncbn_doc", EXAMPLES / "capture_syncbn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


README = EXAMPLES.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
# "Add an op_api"'s block is a sketch (spec fields ``...``): examples/compose_your_own_op.py,
# run above, is the complete op_api
SKETCHES = [code for code in SNIPPETS if "make_inputs=..." in code]
RUNNABLE = [code for code in SNIPPETS if code not in SKETCHES]


def test_one_readme_block_is_a_sketch():
    assert len(SKETCHES) == 1 and len(RUNNABLE) >= 5


@pytest.mark.parametrize("k", range(len(RUNNABLE)))
def test_readme_python_snippets_run(k, tmp_path):
    """Every Python block of the README but the sketch runs as shown, in a directory of its
    own with the examples beside it."""
    code = RUNNABLE[k]
    env = dict(os.environ, PYTHONPATH=str(EXAMPLES.parent))
    if "dist.init_process_group" in code:  # one rank, as torchrun would start it
        pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")
        env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        code += "\nopgraph.torch.leave_group()\n"
    (tmp_path / "examples").symlink_to(EXAMPLES)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    for line in code.splitlines():  # "print(...)   # float16 [0.  0.9 1.8]": what it prints
        shown = re.fullmatch(r"print\(.*\)\s+# ([\w.]* ?\[[-\w. ]*\])", line.strip())
        if shown:
            assert shown.group(1) in p.stdout, (line, p.stdout[:2000])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("shape", ["x", "2", "0,3", "2,,3"])
def test_capture_syncbn_refuses_a_bad_shape_in_one_line(shape):
    p = subprocess.run([sys.executable, str(EXAMPLES / "capture_syncbn.py"), "--shape", shape],
                       capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent)
    assert p.returncode == 2 and p.stdout == "", p.stderr  # (was a ValueError traceback)
    assert p.stderr.splitlines()[-1].startswith("capture_syncbn.py: error: argument --shape")
    assert "Traceback" not in p.stderr
