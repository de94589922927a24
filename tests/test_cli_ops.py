"""Every CLI command takes any registered op_api: built-in, from ``--load`` (a module or a .py
file) or from the ``opgraph.op_apis`` entry points; ``opgraph ops`` lists them with fidelity."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import opgraph.core.opapi as opapi
from opgraph.cli import main

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "compose_your_own_op.py")


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ops_lists_op_apis_and_l0_fidelity(capsys):
    code, out, _ = run_cli(capsys, "ops", "-v")
    assert code == 0
    assert "aclnnBatchNormElemtBackward" in out and "Ascend950 f32/f16/bf16" in out
    line = next(l for l in out.splitlines() if l.strip().startswith("SyncBatchNormBackwardElemt"))
    assert "DAV_3510: bit-faithful: 950 kernel source" in line and "(fusable)" in line


@pytest.mark.parametrize("cmd", [["dump", "--level", "2"], ["run"], ["emit-c"], ["dump", "--stats"]])
def test_a_loaded_py_file_op_api_works_in_every_command(capsys, cmd):
    code, out, err = run_cli(capsys, cmd[0], "aclnnChannelScale", *cmd[1:], "--load", EXAMPLE,
                             "--shape", "2,3,4")
    assert code == 0, err
    if cmd[0] == "run":  # float32 x·scale rounded once, ·2 exact
        assert float(out.split("max rel error: ")[1].split()[0]) < 2 ** -23


@pytest.mark.parametrize("level", ["1", "2"])
def test_user_op_without_aclnn_lowering_is_one_line_from_plan(capsys, level):
    code, _, err = run_cli(capsys, "plan", "aclnnChannelScale", "--load", EXAMPLE, "--level", level)
    assert code == 1 and err.count("\n") == 1
    assert "no aclnn lowering for node" in err and "no public aclnn API" not in err.split(":")[0]


def test_load_errors_are_one_line(capsys):
    code, _, err = run_cli(capsys, "ops", "--load", "no_such_module_xyz")
    assert code == 2 and err.startswith("opgraph: error: --load 'no_such_module_xyz'")
    code, _, err = run_cli(capsys, "ops", "--load")
    assert code == 2 and "--load" in err


def test_one_file_loaded_by_two_paths_is_one_module(capsys):
    """``--load a.py --load ./a.py``: the same file, not a second op_api of the same name (it
    was 'already registered': the paths were compared as typed)."""
    same = os.path.join(os.path.dirname(EXAMPLE), ".", os.path.basename(EXAMPLE))
    code, out, err = run_cli(capsys, "ops", "--load", EXAMPLE, "--load", same)
    assert code == 0, err
    assert "aclnnChannelScale" in out


def test_load_finds_a_module_in_the_current_directory_by_name(tmp_path):
    # the console script, as a user runs it: unlike `python -m`, it has no cwd on sys.path
    script = os.path.join(os.path.dirname(sys.executable), "opgraph")
    if not os.path.exists(script):
        pytest.skip(f"no opgraph console script next to {sys.executable} (pip install -e .)")
    with open(EXAMPLE) as f:
        (tmp_path / "my_scale_ops.py").write_text(f.read())
    p = subprocess.run([script, "ops", "--load", "my_scale_ops"], cwd=tmp_path, timeout=120,
                       capture_output=True, text=True)
    assert p.returncode == 0 and "aclnnChannelScale" in p.stdout, p.stderr


def test_entry_point_op_api_is_registered(tmp_path, monkeypatch, capsys):
    (tmp_path / "opg_fake_ops.py").write_text(textwrap.dedent('''
        import numpy as np
        from l0ops.basic import Cast, Contiguous, ViewCopy
        from opgraph.aclnn import op_api
        from opgraph.core.opapi import Param

        def make_inputs(cfg, rng):
            return {"x": rng.standard_normal(cfg.shape).astype(np.float32),
                    "out": np.zeros(cfg.shape, np.float16)}

        @op_api("aclnnFakeCast", params=(Param("x", "tensor", "input"),
                                         Param("out", "tensor", "output")),
                make_inputs=make_inputs, reference=lambda a: {"out": a["x"].astype(np.float64)},
                aclnn_api=None, summary="a cast from an entry point")
        def aclnnFakeCastGetWorkspaceSize(ex, x, out):
            y = Cast(ex, Contiguous(ex, ex.input("x", x)), to=out.dtype)
            ex.output(ViewCopy(ex, y, ex.input("out", out)))
    '''))
    dist = tmp_path / "opg_fake_ops-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: opg-fake-ops\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[opgraph.op_apis]\nfake = opg_fake_ops\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(opapi, "_ENTRY_POINTS_LOADED", False)
    monkeypatch.setattr(opapi, "_REGISTRY", dict(opapi._REGISTRY))
    code, out, err = run_cli(capsys, "run", "aclnnFakeCast", "--shape", "4,5")
    assert code == 0, err
    assert "output:        out f16[4,5]" in out and "aclnnFakeCast" in opapi.op_apis()
    sys.modules.pop("opg_fake_ops", None)


UNFUSABLE = textwrap.dedent('''
    import numpy as np
    from l0ops import define_op
    from l0ops.basic import Contiguous, ViewCopy
    from opgraph.aclnn import op_api
    from opgraph.core.opapi import Param

    Twice = define_op("TestTwiceNoExpand", infer=lambda ts, a: [ts[0].with_()],
                      compute=lambda xs, a: [xs[0] + xs[0]], replace=True)

    @op_api("aclnnTestTwice", params=(Param("x", "tensor", "input"), Param("out", "tensor", "output")),
            make_inputs=lambda cfg, rng: {"x": np.ones(cfg.shape, np.float32),
                                          "out": np.zeros(cfg.shape, np.float32)},
            aclnn_api=None, replace=True)  # (each parametrised run writes its own file)
    def aclnnTestTwiceGetWorkspaceSize(ex, x, out):
        ex.output(ViewCopy(ex, Twice(ex, Contiguous(ex, ex.input("x", x))), ex.input("out", out)))
''')


@pytest.mark.parametrize("flag", ["--stats", "--passes"])
def test_level2_that_fused_nothing_says_so(capsys, tmp_path, flag):
    mod = tmp_path / "unfusable_ops.py"
    mod.write_text(UNFUSABLE)
    code, out, err = run_cli(capsys, "dump", "aclnnTestTwice", "--load", str(mod), flag,
                             "--level", "2", "--shape", "2,3")
    assert code == 0, err
    assert "level 2 fused nothing" in out and "TestTwiceNoExpand" in out
    code, out, _ = run_cli(capsys, "dump", "aclnnChannelScale", "--load", EXAMPLE, flag,
                           "--level", "2", "--shape", "2,3")
    assert code == 0 and "fused nothing" not in out


def test_dtype_option_defaults_are_shown_by_name(capsys):
    code, out, _ = run_cli(capsys, "dump", "aclnnBatchNormElemtBackward", "--help")
    text = " ".join(out.split())
    assert code == 0
    assert "dtype of counter: float32, float16, int32 (default: float32)" in text
