"""The aclnn backend: lowering to a call plan, the C++ emitter and the ctypes runtime, checked
against a CPU stand-in library built from tests/fixtures/aclnn_stub.c."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

import backends
import opgraph
from backends.aclnn import ACLNN_LOWERINGS, CallPlan, LoweringError, lower, lower_executor
from backends.aclnn.emit_cpp import emit_cpp
from backends.aclnn.runtime import AclnnBackend, AclnnRuntime
from opgraph.aclnn import aclnnBatchNormElemtBackward as phase2
from opgraph.aclnn import aclnnBatchNormElemtBackwardGetWorkspaceSize as phase1
from opgraph.cli import main

HERE = os.path.dirname(__file__)
INCLUDE = os.path.join(HERE, "fixtures", "include")
BNEB = "aclnnBatchNormElemtBackward"


def make_case(dtype=np.float32, counter=np.int32, weight=True, shape=(2, 3, 5, 4), out=None, seed=0):
    """Tensors for one call (dict of opgraph.Tensor, weight None when not given)."""
    rng = np.random.default_rng(seed)
    C = shape[1]
    a = {"gradOut": rng.standard_normal(shape).astype(dtype),
         "input": rng.standard_normal(shape).astype(dtype),
         "mean": rng.normal(0, .5, C).astype(dtype), "invstd": rng.uniform(.5, 2, C).astype(dtype),
         "weight": rng.uniform(.5, 1.5, C).astype(dtype) if weight else None,
         "sumDy": rng.standard_normal(C).astype(dtype), "sumDyXmu": rng.standard_normal(C).astype(dtype),
         "counter": rng.integers(1, 9, C).astype(counter),
         "gradInput": np.zeros(shape, out or dtype)}
    return {k: None if v is None else opgraph.tensor(v) for k, v in a.items()}


ARGS = ("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter", "gradInput")


def record(t, level):
    with opgraph.opt_level(level):
        status, ws, ex = phase1(*(t[k] for k in ARGS))
    assert status == 0
    return ws, ex


def calls(level, **kw):
    return [c.api.replace("aclnn", "") for c in lower_executor(record(make_case(**kw), level)[1]).calls]


# --- lowering tables ------------------------------------------------------------------------------
def test_level1_fp32_int32_counter():
    assert calls(1) == ["Cast", "ReduceSum", "Div", "Div"] + ["Expand"] * 5 + [
        "InplaceOne", "BatchNormElemtBackward"]


def test_level1_fp16():
    assert calls(1, dtype=np.float16, counter=np.float32) == [
        "ReduceSum", "Cast", "Cast", "Div", "Div"] + ["Expand"] * 5 + [
        "Cast", "Cast", "InplaceOne", "BatchNormElemtBackward"]


def test_level1_fp16_no_weight_fills_and_casts_back():
    # the NULL weight's FillScalar(C, 1) is a kernel, then broadcast like the other parameters;
    # the last InplaceOne fills the plan's unit counter
    assert calls(1, dtype=np.float16, counter=np.float32, weight=False) == [
        "InplaceOne"] + ["Cast"] * 6 + ["ReduceSum", "Div", "Div"] + ["Expand"] * 5 + [
        "InplaceOne", "BatchNormElemtBackward", "Cast"]


@pytest.mark.parametrize("dtype,weight", [(np.float32, True), (np.float16, True), (np.float16, False)])
def test_level2_is_one_call_on_user_tensors(dtype, weight):
    plan = lower_executor(record(make_case(dtype=dtype, weight=weight), 2)[1])
    assert [c.api for c in plan.calls] == [BNEB]
    args = {a.name: a.tensor for a in plan.calls[0].args}
    assert args == {k: (k if (weight or k != "weight") else None) for k in ARGS}
    assert [u.name for u in plan.users if u.written] == ["gradInput"]


def test_level1_elemt_call_gets_per_channel_params_and_unit_counter():
    plan = lower_executor(record(make_case(), 1)[1])
    call = plan.calls[-1]
    args = {a.name: plan.tensor(a.tensor) for a in call.args}
    for k in ("mean", "invstd", "weight", "sumDy", "sumDyXmu"):
        assert args[k].dims == [3]
    assert args["counter"].dtype == "ACL_FLOAT" and args["counter"].dims == [1]
    assert args["gradInput"].buffer == "user" and args["gradInput"].user == "gradInput"  # redirect


def test_node_without_lowering_falls_back_to_the_whole_op_api_call(monkeypatch):
    monkeypatch.delitem(ACLNN_LOWERINGS.entries, "RealDiv")
    plan = lower_executor(record(make_case(), 1)[1])
    assert [c.api for c in plan.calls] == ["aclnnBatchNormElemtBackward"]


def test_node_without_lowering_outside_an_op_api_is_a_clear_error(monkeypatch):
    monkeypatch.delitem(ACLNN_LOWERINGS.entries, "RealDiv")
    g = record(make_case(), 1)[1].compiled.copy()
    g.call = None  # a hand-built graph: no op_api to run whole
    with pytest.raises(LoweringError, match=r"no aclnn lowering for node %\d+: f32\[3\] = RealDiv"):
        lower(g)


def test_fused_graph_lowers_to_the_recorded_call_not_by_names():
    """Level 2 becomes the op_api's own public API with the recorded arguments; renaming the
    graph or its inputs changes nothing, a graph without a recorded call is refused."""
    _, ex = record(make_case(weight=False), 2)
    g = ex.compiled.copy()
    g.name = "someOtherName"
    call = lower(g).calls[0]
    assert call.api == "aclnnBatchNormElemtBackward"
    assert [a.name for a in call.args][4] == "weight" and call.args[4].tensor is None  # NULL kept
    g.call = None
    with pytest.raises(LoweringError, match="FusedElementwise.*not recorded by an op_api"):
        lower(g)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_plan_json_round_trip(level):
    plan = lower_executor(record(make_case(dtype=np.float16), level)[1])
    again = CallPlan.from_json(plan.to_json())
    assert again == plan and again.to_json() == plan.to_json()


# --- C++ emitter --------------------------------------------------------------------------------
def emitted(level, tmp_path, **kw):
    _, ex = record(make_case(**kw), level)
    src, files = emit_cpp(lower_executor(ex), {k: t.storage for k, t in ex.bindings.items()},
                          embed_limit=50)
    path = tmp_path / f"prog{level}.cpp"
    path.write_text(src)
    for name, blob in files.items():
        (tmp_path / name).write_bytes(blob)
    return path, files, ex


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
@pytest.mark.parametrize("level,dtype,weight", [(1, np.float32, True), (1, np.float16, False),
                                                (2, np.float16, True), (0, np.float32, False)])
def test_emitted_program_compiles(tmp_path, level, dtype, weight):
    path, files, _ = emitted(level, tmp_path, dtype=dtype, weight=weight)
    assert "gradOut.bin" in files and "mean.bin" not in files  # large → .bin, small → embedded
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-I", INCLUDE,
                        str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# --- the ctypes runtime on the stub library ------------------------------------------------------
def run_on(backend, t, level):
    ws, ex = record(t, level)
    with opgraph.use_backend(backend):
        assert phase2(bytearray(ws) if ws else None, ws, ex) == 0
    return t["gradInput"].numpy()


@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("dtype,counter,weight,out", [
    (np.float32, np.int32, True, None), (np.float16, np.float32, True, None),
    (np.float16, np.float16, False, None), (np.float32, np.float16, False, None),
    (np.float16, np.int32, True, np.float32)])
def test_stub_run_is_bit_equal_to_numpy(stub_backend, level, dtype, counter, weight, out):
    kw = dict(dtype=dtype, counter=counter, weight=weight, out=out)
    ref = run_on("numpy", make_case(**kw), level)
    got = run_on("aclnn-stub", make_case(**kw), level)
    bits = np.uint16 if ref.dtype == np.float16 else np.uint32
    assert np.array_equal(got.view(bits), ref.view(bits))
    assert np.abs(ref).max() > 0


def test_stub_call_order_and_workspace(stub_backend):
    run_on("aclnn-stub", make_case(), 1)
    log = stub_backend.stub_calls().decode().split()
    phase2s = [n for n in log if n.startswith("aclnn") and not n.endswith("GetWorkspaceSize")]
    assert phase2s == ["aclnnCast", "aclnnReduceSum", "aclnnDiv", "aclnnDiv"] + ["aclnnExpand"] * 5 + [
        "aclnnInplaceOne", BNEB]
    for name in phase2s:  # two-phase pattern: phase 1 right before its phase 2 (+ workspace)
        i = log.index(name)
        assert log[i - 1] in (name + "GetWorkspaceSize", "aclrtMalloc")
    i = log.index(BNEB + "GetWorkspaceSize")
    assert log[i + 1] == "aclrtMalloc" and log[i + 2] == BNEB  # the op asked for a workspace
    assert log.index("aclrtSynchronizeStream") > log.index(BNEB)
    assert log.count("aclCreateTensor") == log.count("aclDestroyTensor")


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
def test_emitted_program_runs_on_stub(stub_lib, tmp_path):
    path, _, ex = emitted(1, tmp_path, dtype=np.float16, weight=False)
    exe = tmp_path / "prog"
    subprocess.run(["g++", "-std=c++17", "-I", INCLUDE, str(path), stub_lib, "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    vals = [float(line.split(" is: ")[1]) for line in out.splitlines() if line.startswith("result[")]
    with opgraph.opt_level(1):
        _, ws, ex2 = phase1(*(ex.bindings.get(k) for k in ARGS))
    assert phase2(bytearray(ws) if ws else None, ws, ex2) == 0
    assert np.array_equal(np.float16(vals), ex.bindings["gradInput"].numpy().reshape(-1))


# --- availability and CLI ---------------------------------------------------------------------
def test_absent_cann_is_one_clear_line(monkeypatch):
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "OPGRAPH_ACLNN_LIBS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ASCEND_HOME_PATH", "/nonexistent/cann")
    backends.register("aclnn-probe", lambda: AclnnBackend(), replace=True)
    with pytest.raises(backends.BackendUnavailable) as e:
        backends.get("aclnn-probe")
    msg = str(e.value)
    assert "\n" not in msg and "CANN runtime not found: set ASCEND_HOME_PATH or ASCEND_TOOLKIT_HOME" in msg
    assert "/nonexistent/cann/lib64" in msg
    assert not AclnnRuntime(libs=["/nonexistent/x.so"]).availability()[0]


def test_env_library_override(stub_lib, monkeypatch):
    monkeypatch.setenv("OPGRAPH_ACLNN_LIBS", stub_lib)
    assert AclnnBackend().availability() == (True, "")


def test_cli_plan_and_emit_cpp(tmp_path, capsys):
    assert main(["plan", BNEB, "--shape", "2,3,4", "--level", "1", "--format", "json"]) == 0
    plan = CallPlan.from_json(capsys.readouterr().out)
    assert plan.calls[-1].api == BNEB and plan.level == 1
    assert main(["plan", BNEB, "--shape", "2,3,4"]) == 0
    assert "[0] aclnnBatchNormElemtBackward(gradOut, input" in capsys.readouterr().out
    out = tmp_path / "p.cpp"
    assert main(["emit-cpp", BNEB, "--shape", "4,3,40", "--dtype", "f16", "--embed-limit", "100",
                 "-o", str(out)]) == 0
    assert "2 .bin files" in capsys.readouterr().out
    assert (tmp_path / "gradOut.bin").stat().st_size == 4 * 3 * 40 * 2
    assert "aclnnBatchNormElemtBackwardGetWorkspaceSize(" in out.read_text()
