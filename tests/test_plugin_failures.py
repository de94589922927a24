"""Broken plugins — installed entry points, registered backends, user op_apis — are named in one
clear line and do not break what does not use them: a failing op_api entry point is skipped with
a warning, code of an installed op_api is user code, a backend that does not load or probe is
BackendUnavailable, a compile() that returns no Executable is named, check_backend neither
blames the backend for the reference's own failure nor counts a case twice, and the fusion note
knows fused reductions. Each CLI case runs in a process of its own (its registrations stay
there)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import backends
import opgraph
import opgraph.core.backend as registry
from opgraph.aclnn import op_api
from opgraph.core.backend import Backend, BackendUnavailable
from opgraph.core.opapi import Param, op_api_specs

ROOT = Path(__file__).resolve().parents[1]

PLUGIN_OP = '''
import numpy as np
from opgraph.aclnn import op_api
from opgraph.core.opapi import Param

def make_inputs(cfg, rng):
    raise RuntimeError("bad plugin inputs")

@op_api("aclnnPluggedIn", params=(Param("x", "tensor", "input"),), make_inputs=make_inputs)
def aclnnPluggedInGetWorkspaceSize(ex, x):
    pass
'''


def installed(tmp_path: Path, group: str, entries: dict[str, str], modules: dict[str, str]) -> str:
    """A distribution on a new path entry with ``entries`` in entry-point ``group`` and the
    ``modules`` they name; returns that path entry."""
    site = tmp_path / "site"
    dist = site / "opg_test_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: opg-test-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source))
    return str(site)


def opgraph_with(site: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opgraph", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": f"{site}:{ROOT}"})


def test_a_broken_op_api_entry_point_is_skipped_with_one_warning(tmp_path):
    site = installed(tmp_path, "opgraph.op_apis", {"broken_ops": "opg_broken_ops"},
                     {"opg_broken_ops": "raise RuntimeError('broken plugin at import')\n"})
    for args in (["--version"], ["ops"]):
        proc = opgraph_with(site, *args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ("opgraph: warning: the op_api entry point 'broken_ops' "
                               "(opg_broken_ops) failed to import, skipped: RuntimeError: broken "
                               "plugin at import\n")
    assert "aclnnBatchNormStats" in proc.stdout


def test_code_of_an_installed_op_api_is_user_code(tmp_path):
    site = installed(tmp_path, "opgraph.op_apis", {"plug": "opg_plugged_ops"},
                     {"opg_plugged_ops": PLUGIN_OP})
    proc = opgraph_with(site, "run", "aclnnPluggedIn", "--shape", "2,3", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("opgraph: error: in user code at ") and \
        "opg_plugged_ops.py:7: RuntimeError: bad plugin inputs" in proc.stderr, proc.stderr


class Probing(Backend):
    name = "probing"

    def availability(self):
        raise OSError("probe failed")


class NoExecutable(Backend):
    name = "no-executable"

    def compile(self, graph, memory_plan, platform):
        return None


@pytest.fixture
def fresh_registry(monkeypatch):
    """The backend registry as if nothing had been looked up yet (restored afterwards)."""
    monkeypatch.setattr(registry, "_DISCOVERED", False)
    monkeypatch.setattr(registry, "_FACTORIES", {})
    monkeypatch.setattr(registry, "_INSTANCES", {})


def test_a_backend_that_does_not_load_or_probe_is_unavailable_and_named(tmp_path, monkeypatch,
                                                                         fresh_registry):
    site = installed(tmp_path, "opgraph.backends", {"plug-missing": "opg_missing_module:Nope"}, {})
    monkeypatch.syspath_prepend(site)
    with pytest.raises(BackendUnavailable, match="backend 'plug-missing' failed to load: "
                                                 "ModuleNotFoundError: No module named 'opg_missing"):
        backends.get("plug-missing")
    backends.register("probing", Probing)
    with pytest.raises(BackendUnavailable, match=r"backend 'probing' is unavailable: its "
                                                 r"availability\(\) raised OSError: probe failed"):
        opgraph.use_backend("probing").__enter__()
    status = backends.status()
    assert status["plug-missing"].startswith("backend 'plug-missing' failed to load")
    assert "probe failed" in status["probing"] and status["numpy"] == "ok"


def test_replacing_a_built_in_backend_needs_replace_before_any_lookup(fresh_registry):
    with pytest.raises(ValueError, match="backend 'native' is already registered"):
        backends.register("native", Probing)


def test_a_compile_that_returns_no_executable_is_named():
    x = np.ones((2, 3, 4), np.float32)
    with opgraph.use_backend(NoExecutable()), pytest.raises(
            opgraph.AclnnError, match=r"361001.*backend 'no-executable' failed: TypeError: backend "
                                      r"'no-executable': compile\(\) returned NoneType, not an"):
        opgraph.ops.batch_norm_stats(x, 1e-5)


KIT = '''
import numpy as np
from backends.numpy_backend import NumpyBackend
from l0ops import define_op
from l0ops.basic import ViewCopy
from opgraph.aclnn import op_api
from opgraph.core.backend import Backend, Executable, register
from opgraph.core.opapi import Param
from opgraph.testing import check_backend

def explode(args, attrs):
    raise ZeroDivisionError("the op's own bug")

Boom = define_op("Boom", num_inputs=1, infer=lambda types, a: [types[0]], compute=explode)

def make_inputs(cfg, rng):
    return {"x": np.ones(cfg.shape, np.float32), "out": np.zeros(cfg.shape, np.float32)}

@op_api("aclnnBoom", params=(Param("x", "tensor", "input"), Param("out", "tensor", "output")),
        make_inputs=make_inputs, platforms=("Ascend910B",))
def aclnnBoomGetWorkspaceSize(ex, x, out):
    ex.output(ViewCopy(ex, Boom(ex, ex.input("x", x)), ex.input("out", out)))

class Idle(Executable):
    def run(self, bindings, workspace=None):
        return {}

class Noop(Backend):
    name = "noop"
    def compile(self, graph, memory_plan, platform):
        return Idle()

class Twin(NumpyBackend):  # numpy under another name: fails as numpy does
    name = "twin"

register("noop", Noop)
register("twin", Twin)
both = check_backend("twin", op_apis=["aclnnBoom"], levels=(0,), layouts=("contiguous",))
print(str(both).splitlines()[1])
idle = check_backend("noop", op_apis=["aclnnBatchNormStats"], levels=(0,),
                     layouts=("contiguous",), platforms=("Ascend910B",), dtypes=("float32",))
print(str(idle).splitlines()[0], len(idle.failures))
'''


def test_check_backend_names_a_failure_of_both_and_counts_cases_not_outputs(tmp_path):
    (tmp_path / "kit.py").write_text(KIT)
    proc = subprocess.run([sys.executable, "kit.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    both, idle = proc.stdout.splitlines()
    assert "ZeroDivisionError" in both and "(on the numpy reference too: the inputs are valid)" in both
    # two shapes, each failing in both outputs (mean and invstd): 2 cases, 4 failures
    assert idle == "backend 'noop': 2 cases, 2 failed 4", idle


USER_OPS = '''
import numpy as np
import l0ops
from l0ops import define_op
from l0ops.basic import Contiguous, ViewCopy
from opgraph.aclnn import op_api
from opgraph.core.backend import Backend, register
from opgraph.core.opapi import Param

Twice = define_op("MyTwice", num_inputs=1, infer=lambda types, a: [types[0]],
                  compute=lambda args, a: [args[0] * 2])

def make_inputs(cfg, rng):
    return {"x": rng.standard_normal(cfg.shape).astype(np.float32),
            "out": np.zeros(cfg.shape[1], np.float32)}

@op_api("aclnnSumTwice", params=(Param("x", "tensor", "input"), Param("out", "tensor", "output")),
        make_inputs=make_inputs)
def aclnnSumTwiceGetWorkspaceSize(ex, x, out):  # a fusable reduction, then an op with no expansion
    v = Contiguous(ex, ex.input("x", x))
    s = l0ops.ReduceSum(ex, l0ops.Add(ex, v, v), axes=tuple(i for i in range(x.ndim) if i != 1))
    ex.output(ViewCopy(ex, Twice(ex, s), ex.input("out", out)))

class Exploding(Backend):
    name = "exploding"
    def compile(self, graph, memory_plan, platform):
        raise RuntimeError("plugin compiler exploded")

register("exploding", Exploding)
'''


def test_the_fusion_note_knows_fused_reductions(tmp_path):
    (tmp_path / "userops.py").write_text(USER_OPS)
    proc = opgraph_with("", "dump", "aclnnSumTwice", "--load", "userops.py", "--stats", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    launches = [int(row.split()[2]) for row in proc.stdout.splitlines()[1:4]]
    assert launches[2] < launches[1] and "fused nothing" not in proc.stdout + proc.stderr


def test_capture_run_on_a_failing_backend_is_one_line(tmp_path):
    (tmp_path / "userops.py").write_text(USER_OPS)
    proc = opgraph_with("", "capture", str(ROOT / "examples" / "capture_syncbn.py"), "--shape",
                        "2,3,4", "--run", "exploding", "--load", "userops.py", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr == ("opgraph: error: --run: backend 'exploding' failed: RuntimeError: "
                           "plugin compiler exploded\n"), proc.stderr


def test_an_op_api_spec_with_an_unknown_platform_or_a_bad_rank_is_refused_when_registered():
    for spec, words in [(dict(platforms=("Ascend999",)), "platforms ['Ascend999']: unknown 'Ascend999'"),
                        (dict(platforms=()), "platforms []: none"),
                        (dict(rank=(3, 2)), "rank (3, 2) is not (min, max)")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            @op_api("aclnnNeverRegistered", params=(Param("x", "tensor", "input"),), **spec)
            def compose(ex, x):
                pass
    assert "aclnnNeverRegistered" not in op_api_specs()


RANKED_OP = '''
import numpy as np
from opgraph.aclnn import op_api
from opgraph.core.opapi import Param

def make_inputs(cfg, rng):
    return {"x": np.ones(cfg.shape, np.float32)}

@op_api("aclnnOnly950", params=(Param("x", "tensor", "input"),), make_inputs=make_inputs,
        platforms=("Ascend950",), rank=(2, 3), default_shape=(2, 3))
def aclnnOnly950GetWorkspaceSize(ex, x):
    pass
'''


def test_the_cli_keeps_an_op_apis_rank_and_defaults_to_a_platform_it_lists(tmp_path):
    (tmp_path / "ranked.py").write_text(RANKED_OP)
    run = ["run", "aclnnOnly950", "--load", "ranked.py"]
    proc = opgraph_with("", *run, "--shape", "2,3,4,5", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == (
        "opgraph: error: --shape: aclnnOnly950 needs rank <= 3 (N, C, ...), got [2, 3, 4, 5]\n")
    proc = opgraph_with("", *run, "--help", cwd=tmp_path)
    assert "(default: Ascend950)" in " ".join(proc.stdout.split())
    proc = opgraph_with("", *run, "--shape", "2,3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


SHADOW = '''
import numpy as np
import opgraph
from opgraph.aclnn import op_api
from opgraph.aclnn.batch_norm_stats import aclnnBatchNormStatsGetWorkspaceSize as builtin
from opgraph.core.status import AclnnError, Status

x = opgraph.tensor(np.ones((2, 3, 4), np.float32))
out = [opgraph.tensor(np.zeros(3, np.float32)) for _ in range(2)]
assert builtin(x, 1e-5, *out)[0] == 0  # compiled and cached
try:
    @op_api("aclnnBatchNormStats", params=builtin.spec.params)
    def shadow(ex, input, eps, mean, invstd):
        raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID, "the replacement ran")
except ValueError as e:
    print(e)

@op_api("aclnnBatchNormStats", params=builtin.spec.params, replace=True)
def replacement(ex, input, eps, mean, invstd):
    raise AclnnError(Status.ACLNN_ERR_PARAM_INVALID, "the replacement ran")

print(replacement(x, 1e-5, *out)[0], opgraph.aclnn.aclGetRecentErrMsg())
'''


def test_an_op_api_name_from_another_file_needs_replace_and_replacing_empties_the_caches(tmp_path):
    (tmp_path / "shadow.py").write_text(SHADOW)
    proc = subprocess.run([sys.executable, "shadow.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    refused, replaced = proc.stdout.splitlines()
    assert refused.startswith("op_api 'aclnnBatchNormStats' is already registered (from ")
    assert refused.endswith("batch_norm_stats.py); pass replace=True to op_api() to replace it")
    assert replaced.startswith("161002") and "the replacement ran" in replaced  # not the cached program


INSTALLED_KIT = '''
import warnings
from opgraph.core.opapi import op_api_specs
from opgraph.testing import check_backend
assert "aclnnInstalledCast" not in op_api_specs()  # nothing imported the plugin yet
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    report = check_backend("numpy", levels=(0,), layouts=("contiguous",),
                           op_apis=None, platforms=("Ascend910B",), dtypes=("float32",))
print("aclnnInstalledCast" in op_api_specs(), [str(w.message) for w in seen])
'''

INSTALLED_OP = '''
import numpy as np
from l0ops.basic import Cast, ViewCopy
from opgraph.aclnn import op_api
from opgraph.core.dtypes import DataType
from opgraph.core.opapi import Param

@op_api("aclnnInstalledCast", params=(Param("x", "tensor", "input"), Param("out", "tensor", "output")),
        make_inputs=lambda cfg, rng: {"x": np.ones(cfg.shape, np.float32),
                                      "out": np.zeros(cfg.shape, np.float16)})
def aclnnInstalledCastGetWorkspaceSize(ex, x, out):
    ex.output(ViewCopy(ex, Cast(ex, ex.input("x", x), to=DataType.FLOAT16), ex.input("out", out)))
'''


def test_check_backend_takes_installed_op_apis_and_warns_of_broken_ones(tmp_path):
    site = installed(tmp_path, "opgraph.op_apis", {"good": "opg_installed_cast", "bad": "opg_gone"},
                     {"opg_installed_cast": INSTALLED_OP})
    (tmp_path / "kit.py").write_text(INSTALLED_KIT)
    proc = subprocess.run([sys.executable, "kit.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": f"{site}:{ROOT}"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("True [\"the op_api entry point 'bad' (opg_gone) failed to import, "
                                   "skipped: ModuleNotFoundError: No module named 'opg_gone'\"]")
