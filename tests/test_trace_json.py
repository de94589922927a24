"""``opgraph run --trace-json``: Chrome trace events with one complete event per launched node on
every backend with the per-node hook, ascend-sim's per-core rows, and the hook itself (off by
default, same bits when on)."""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

import backends
import opgraph
from backends.numpy_backend import NumpyExecutable
from opgraph.cli import main
from opgraph.core import backend as backend_registry
from opgraph.core.backend import Backend, Executable

OP = "aclnnBatchNormElemtBackward"


def trace(tmp_path, capsys, *argv: str) -> dict:
    path = tmp_path / "t.json"
    assert main(["run", OP, *argv, "--trace-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}: Chrome trace events" in out
    return json.loads(path.read_text())


def launched(level: int, *argv: str) -> list[str]:
    """The ops phase 2 launches at ``level`` for the CLI's inputs (from the text table dump)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["dump", OP, *argv, "--level", str(level), "--format", "table"]) == 0
    rows = [line.split() for line in buf.getvalue().splitlines()[2:-1]]
    return [r[1] for r in rows if "kernel" in r]


@pytest.mark.parametrize("backend", ["numpy", "native"])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_one_complete_event_per_launched_node(tmp_path, capsys, backend, level):
    if backend == "native" and "native" not in backends.available():
        pytest.skip("no C compiler for the native backend")
    argv = ["--shape", "2,3,4", "--backend", backend, "--level", str(level)]
    doc = trace(tmp_path, capsys, *argv)
    events = doc["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["ts"] >= 0 for e in kernels)
    assert [e["name"] for e in kernels] == launched(level, "--shape", "2,3,4")
    (run,) = [e for e in events if e.get("cat") == "run"]
    assert all(e["ts"] + e["dur"] <= run["dur"] + 1 for e in kernels)  # inside phase 2
    starts = [e["ts"] for e in events if e.get("cat") in ("kernel", "free")]
    assert starts == sorted(starts)  # in execution order
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert f"{OP} on {backend}" in names and "kernels" in names


def test_ascend_sim_adds_a_row_per_core(tmp_path, capsys):
    doc = trace(tmp_path, capsys, "--shape", "8,5,50,50", "--dtype", "float16", "--backend",
                "ascend-sim", "--level", "1")
    events = doc["traceEvents"]
    (kernel,) = [e for e in events if e.get("name") == "SyncBatchNormBackwardElemt"]
    cores = [e for e in events if e.get("cat") == "core"]
    sim = backends.get("ascend-sim").last_trace
    assert len(cores) == sim.tiling.block_dim == len(sim.cores) > 1
    assert [e["args"]["elements"] for e in cores] == [c.elements for c in sim.cores]
    assert sum(e["args"]["bytes_out"] for e in cores) == sum(c.bytes_out for c in sim.cores)
    assert len({e["tid"] for e in cores}) == len(cores) and len({e["pid"] for e in cores}) == 1
    for e in cores:  # the cores ran inside the kernel's event
        assert kernel["ts"] <= e["ts"] and e["ts"] + e["dur"] <= kernel["ts"] + kernel["dur"] + 1
    findings = [e for e in events if e.get("cat") == "finding"]
    assert len(findings) == len(sim.findings)


def test_trace_json_needs_a_file(capsys):
    assert main(["run", OP, "--trace-json", "-"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opgraph: error: --trace-json") and err.count("\n") == 1


def test_trace_json_unwritable_names_the_option(capsys, tmp_path):
    assert main(["run", OP, "--trace-json", str(tmp_path / "no" / "t.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("opgraph: error: --trace-json: cannot write")


def test_profile_hook_is_off_by_default_and_keeps_the_bits():
    assert NumpyExecutable.profile is None
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float16)
    c = np.float16([0.5, 1, 2])

    def run(profile):
        out = np.zeros_like(x)
        st, ws, ex = opgraph.aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
            *[opgraph.tensor(a) for a in (x, x, c, c, c, c, c, np.float32([1, 2, 3]))],
            opgraph.tensor(out))
        exe = ex.program.executable(backends.get("numpy"))
        exe.profile = profile
        try:
            assert opgraph.aclnn.aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex) == 0
        finally:
            exe.profile = None
        return out, ex

    seen = []
    with opgraph.opt_level(0):
        plain, _ = run(None)
        timed, ex = run(lambda node, a, b: seen.append((node, a, b)))
    assert np.array_equal(plain.view(np.uint16), timed.view(np.uint16))
    assert [n for n, _, _ in seen] == ex.program.compiled.nodes  # every node, in order
    assert all(a <= b for _, a, b in seen)


class _Wrapped(Executable):
    """An executable without the per-node hook (like the aclnn backend's)."""

    def __init__(self, inner):
        self.inner = inner

    def run(self, bindings, workspace=None):
        return self.inner.run(bindings, workspace)


class _PlainBackend(Backend):
    name = "plain-test"

    def compile(self, graph, memory_plan, platform):
        return _Wrapped(backends.get("numpy").compile(graph, memory_plan, platform))


@pytest.fixture
def plain_backend():
    backends.register("plain-test", _PlainBackend, replace=True)
    yield "plain-test"
    backend_registry._FACTORIES.pop("plain-test", None)  # leave the registry as it was
    backend_registry._INSTANCES.pop("plain-test", None)


def test_backend_without_the_hook_gets_one_event_for_the_run(tmp_path, capsys, plain_backend):
    path = tmp_path / "t.json"
    assert main(["run", OP, "--backend", "plain-test", "--trace-json", str(path)]) == 0
    assert "reports no per-node times: one event for phase 2" in capsys.readouterr().out
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in complete] == ["phase 2"] and complete[0]["args"]["per_node"] is False
