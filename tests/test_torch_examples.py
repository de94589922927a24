"""The main job shows it: ``opgraph syncbn`` and examples/ddp_syncbn_cpu.py (spawning its ranks,
and under torchrun) run across processes and report small differences from one process."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")

from opgraph.cli import main  # noqa: E402
from opgraph.torch import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp_syncbn_cpu.py"
ROW = re.compile(r"^  (\w+)\s+(\S+)\s+(\S+)$", re.M)
STEP = re.compile(r"^step +(\d+)/(\d+) \[([#.]+)\] loss (\S+)", re.M)
LARGEST = re.compile(r"largest difference from the single-process reference: loss (\S+), "
                     r"parameters and running stats (\S+)")


def syncbn(capsys, *argv):
    assert main(["syncbn", *argv]) == 0
    out = capsys.readouterr().out
    rows = {name: (float(a), float(r)) for name, a, r in ROW.findall(out)}
    assert list(rows) == ["output", "running_mean", "running_var", "grad_input", "grad_weight",
                          "grad_bias"], out
    return out, rows


def test_cli_fp32_uneven_batch(capsys):
    out, rows = syncbn(capsys, "--ranks", "2", "--shape", "5,4,3,3")
    assert "batch 3+2 of [5,4,3,3] float32" in out
    assert all(rel <= 1e-5 for _, rel in rows.values()), out


def test_cli_fp16_with_an_empty_rank(capsys):
    out, rows = syncbn(capsys, "--ranks", "3", "--shape", "2,4,3,3", "--dtype", "float16")
    assert "batch 1+1+0" in out
    # against float32 batch norm on the rounded inputs: fp16 rounding of the results
    assert all(rel <= 1e-2 for _, rel in rows.values()), out


def test_cli_bf16_runs_on_the_soc_whose_stats_take_it(capsys):
    out, rows = syncbn(capsys, "--ranks", "2", "--shape", "4,3,2,2", "--dtype", "bfloat16")
    assert "bfloat16, opgraph backend numpy on Ascend950" in out
    # against float32 batch norm on the rounded inputs: bf16 rounding of the results
    assert all(rel <= 2e-2 for _, rel in rows.values()), out


def test_cli_bf16_on_a_soc_that_refuses_it_says_so_in_one_line(capsys):
    assert main(["syncbn", "--ranks", "2", "--shape", "4,3,2,2", "--dtype", "bfloat16",
                 "--platform", "Ascend910B"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "input dtype torch.bfloat16 is not supported on Ascend910B" in err
    assert "exist only on Ascend950" in err, err


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def check_training_output(out, steps):
    rows = STEP.findall(out)
    assert [(int(s), int(n)) for s, n, _, _ in rows] == [(i + 1, steps) for i in range(steps)]
    assert all(len(bar) == 24 and bar.count("#") == 24 * int(s) // steps
               for s, _, bar, _ in rows)
    loss, params = map(float, LARGEST.search(out).groups())
    assert loss <= 1e-4 and params <= 1e-4, out


def test_example_spawning_its_ranks():
    out = run([sys.executable, str(EXAMPLE), "--ranks", "2", "--steps", "4", "--batch", "10"])
    check_training_output(out, 4)
    assert "2 ranks, 4 steps of 10 images" in out


def test_example_under_torchrun():
    out = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE),
               "--steps", "3", "--batch", "7"], env={"OMP_NUM_THREADS": "1"})
    check_training_output(out, 3)
    assert "2 ranks, 3 steps of 7 images" in out


CAPTURE_EXAMPLE = ROOT / "examples" / "capture_syncbn_torch.py"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_captured_step_example_replays_new_batches_bit_equal(dtype):
    out = run([sys.executable, str(CAPTURE_EXAMPLE), "--ranks", "2", "--shape", "5,3,4,4",
               "--steps", "4", "--dtype", dtype])
    assert "2 ranks, batch 5x3x4x4 " + dtype in out
    assert "4 launches + 2 collectives" in out
    assert re.search(r"4 steps on new batches: eager \S+ ms/step, captured replay \S+ ms/step", out)
    assert "every step bit-equal to the eager layer on every rank" in out


@pytest.mark.parametrize("argv, says", [(["--ranks", "1"], "at least 2"),
                                        (["--shape", "8,x"], "comma-separated integers"),
                                        (["--shape", "1,4,3"], "N >= --ranks")])
def test_captured_step_example_refuses_bad_arguments_in_one_line(argv, says):
    p = subprocess.run([sys.executable, str(CAPTURE_EXAMPLE), *argv], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and says in p.stderr and p.stdout == ""


def test_ddp_example_refuses_an_unknown_backend_in_one_line():
    """--backend nope was found by every rank: one traceback each, after spawning them."""
    p = subprocess.run([sys.executable, str(EXAMPLE), "--backend", "nope"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "--backend: unknown backend 'nope'" in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
