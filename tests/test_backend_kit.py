"""The backend protocol and kit: compile once per backend, the caller's workspace is the arena
the memory plan lays out, ``opgraph.testing.check_backend`` passes for the built-in backends and
fails for a deliberately wrong one."""
from __future__ import annotations

import numpy as np
import pytest

import backends
import opgraph
from backends.native import build
from backends.aclnn import lower_executor
from backends.numpy_backend import NUMPY_LOWERINGS, NumpyBackend, NumpyExecutable
from opgraph import aclnn
from opgraph.testing import check_backend, compare

OP = "aclnnBatchNormElemtBackward"


def phase1(level=0, shape=(2, 3, 4)):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    c = np.float32([0.5, 1.0, 2.0])
    out = np.zeros(shape, np.float32)
    t = opgraph.tensor
    with opgraph.opt_level(level):
        st, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
            t(x), t(x), t(c), t(c), t(c), t(c), t(c), t(np.int32([2, 2, 2])), t(out))
    assert st == 0
    return ws, ex, out


def test_builtin_numpy_backend_passes_the_kit():
    report = check_backend("numpy", levels=(0, 2))
    assert report.ok, str(report)
    assert report.cases >= 2 * 2 * 2 * 2  # platforms x dtypes x levels x layouts, at least


@pytest.mark.skipif("native" not in backends.available(),
                    reason="native backend needs a C compiler (install gcc)")
def test_builtin_native_backend_passes_the_kit():
    native = backends.get("native")
    native.fallbacks.clear()
    loads = sum(build.stats.values())
    report = check_backend("native", levels=(1, 2), platforms=["Ascend910B", "Ascend950"])
    assert report.ok, str(report)
    assert sum(build.stats.values()) > loads and not native.fallbacks  # C kernels really ran


def test_aclnn_backend_on_the_stub_library_passes_the_kit(stub_backend):
    # the stub models the fp32/fp16 kernels of aclnnBatchNormElemtBackward (no bf16)
    report = check_backend("aclnn-stub", op_apis=[OP], platforms=["Ascend910B"],
                           dtypes=["float32", "float16"])
    assert report.ok, str(report)


class StridesSeen(NumpyBackend):
    """The numpy backend, noting the strides (in elements) of every graph input it compiles."""

    name = "strides-seen"

    def __init__(self):
        super().__init__()
        self.strides = set()

    def compile(self, graph, memory_plan, platform):
        self.strides.update(v.type.strides for v in graph.inputs if v.type.strides)
        return super().compile(graph, memory_plan, platform)


def test_the_kit_can_hand_the_backend_channels_last_tensors():
    seen = StridesSeen()
    report = check_backend(seen, op_apis=[OP], platforms=["Ascend910B"], levels=(2,),
                           dtypes=["float32"], layouts=("channels_last",), shapes=[(2, 3, 4, 5)])
    assert report.ok and report.cases >= 1, str(report)
    # [2, 3, 4, 5] with the channel innermost: [N, H, W, C] in memory
    assert (60, 1, 15, 3) in seen.strides and (60, 20, 5, 1) not in seen.strides


def test_the_kit_refuses_a_layout_it_does_not_know():
    with pytest.raises(ValueError, match="unknown layout 'nhwc'.*channels_last"):
        check_backend("numpy", op_apis=[OP], layouts=("contiguous", "nhwc"))


class OffByOneUlp(NumpyBackend):
    """Deliberately wrong: flips the lowest bit of every fused kernel's float32 results."""

    name = "wrong"

    def compile(self, graph, memory_plan, platform):
        def fused(exe, node, args):
            out = node.opdef.compute(args, node.attrs)
            for r in out:
                if r.dtype == np.float32 and r.flags.writeable:
                    r.view(np.uint32)[...] ^= 1
            return out
        table = NUMPY_LOWERINGS.extend({"FusedElementwise": fused})
        return NumpyExecutable(self, graph, memory_plan, platform, table)


def test_a_wrong_backend_fails_the_kit_and_the_report_says_where():
    report = check_backend(OffByOneUlp(), op_apis=[OP], platforms=["Ascend910B"], levels=(1, 2),
                           dtypes=["float32"])
    assert not report.ok
    failed_levels = {f.case.level for f in report.failures}
    assert failed_levels == {2}  # level 1 has no fused node: those cases pass
    assert "gradInput" in str(report) and "differ" in str(report)


def test_compare_treats_nan_positions_not_payloads():
    a = np.float32([np.nan, 1.0])
    b = a.copy()
    b.view(np.uint32)[0] ^= 0x1  # another NaN payload
    assert compare(a, b) is None
    assert "1 of 2" in compare(a, np.float32([np.nan, 2.0]))


class Counting(NumpyBackend):
    name = "counting-compiles"

    def __init__(self):
        self.compiles = 0

    def compile(self, graph, memory_plan, platform):
        self.compiles += 1
        return super().compile(graph, memory_plan, platform)


def test_compile_once_per_program_and_backend():
    b = Counting()
    with opgraph.use_backend(b):  # an instance works as well as a name
        for _ in range(3):
            ws, ex, _ = phase1(level=1)
            assert aclnn.aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex) == 0
    assert b.compiles == 1


def test_phase2_uses_the_callers_workspace_as_the_arena():
    ws, ex, out = phase1(level=0)
    assert ws > 0 and ex.memory_plan.size == ws
    workspace = bytearray(b"\xa5" * ws)
    assert aclnn.aclnnBatchNormElemtBackward(workspace, ws, ex) == 0
    assert workspace != bytearray(b"\xa5" * ws)  # intermediates were placed there
    ws2, ex2, out2 = phase1(level=0)
    assert aclnn.aclnnBatchNormElemtBackward(bytearray(ws2), ws2, ex2) == 0
    assert np.array_equal(out.view(np.uint32), out2.view(np.uint32))


def test_numpy_executable_refuses_a_short_arena():
    ws, ex, _ = phase1(level=0)
    exe = NumpyBackend().compile(ex.compiled, ex.memory_plan, ex.platform)
    with pytest.raises(ValueError, match="memory plan needs"):
        exe.run(ex.bindings, bytearray(ws - 1))


@pytest.mark.parametrize("level", [0, 1, 2])
def test_aclnn_plan_arena_is_exactly_what_phase1_reported(level):
    ws, ex, _ = phase1(level=level)
    assert lower_executor(ex).workspace_size == ws


def test_register_rejects_a_factory_that_is_not_callable():
    with pytest.raises(TypeError, match="factory"):
        backends.register("not-callable", 42)
    assert "not-callable" not in backends.names()


def test_aclnn_plans_of_the_family_pass_the_kit_on_the_stub(stub_backend):
    """Every op_api with a public aclnn API, through the aclnn backend's call plan and ctypes
    runtime on the stub (which delegates the family's whole-op calls to opgraph's own
    implementation): arguments, NULLs, scalars, views and write-back must be right."""
    names = [n for n, s in opgraph.aclnn.op_api_specs().items()
             if s.aclnn_api and s.make_inputs and n != OP]
    assert names
    report = check_backend("aclnn-stub", op_apis=names, levels=(2,), platforms=["Ascend910B", "Ascend950"])
    assert report.ok, str(report)
    log = stub_backend.stub_calls().decode()
    for name in names[:1]:  # the log keeps the first 64 KiB of calls
        assert f"{name}GetWorkspaceSize" in log and f"\n{name}\n" in log


def test_a_phase2_failure_shared_with_the_reference_is_reported(monkeypatch):
    """Both backends failing phase 2 the same way on the generator's (valid) inputs is a bug in
    both, not agreement: the report names it (as a large 2-D/3-D BatchNormElemt once did)."""
    real = NumpyExecutable.run

    def broken(self, bindings, workspace=None):
        if any(n.op == "FusedElementwise" for n in self.graph.nodes):
            raise ValueError("cannot reshape array")
        return real(self, bindings, workspace)
    monkeypatch.setattr(NumpyExecutable, "run", broken)
    report = check_backend("numpy", op_apis=[OP], platforms=["Ascend910B"], levels=(1, 2),
                           dtypes=["float32"], layouts=("contiguous",))
    assert not report.ok and {f.case.level for f in report.failures} == {2}
    assert "phase 2 failed" in str(report) and "cannot reshape array" in str(report)
    assert "numpy reference too" in str(report)
