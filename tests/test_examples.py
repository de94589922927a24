"""Every script in examples/ runs with the current interpreter and prints the right values."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RESULT = re.compile(r"^result\[(\d+)\] is: (\S+)$", re.M)


def run_example(name: str) -> str:
    p = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True,
                       timeout=300, cwd=EXAMPLES.parent)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.mark.parametrize("name,values", [
    # FLOAT: 0.9 * i; FLOAT16 computes in half; BF16 computes in float, rounds to bf16
    ("batch_norm_elemt_backward.py",
     [0.0, 0.9, 1.8, 2.7, 3.6, 4.5, 5.4, 6.3]),
    ("batch_norm_elemt_backward_half.py",
     [0.0, 0.899902, 1.799805, 2.699219, 3.599609, 4.5, 5.398438, 6.300781]),
    ("batch_norm_elemt_backward_bfloat16.py",
     [0.0, 0.898438, 1.796875, 2.703125, 3.59375, 4.5, 5.40625, 6.3125]),
])
def test_article_examples(name, values):
    out = run_example(name)
    got = [(int(i), float(v)) for i, v in RESULT.findall(out)]
    assert [i for i, _ in got] == list(range(8))
    assert [v for _, v in got] == pytest.approx(values, abs=1e-6)
    assert "workspaceSize = " in out


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
