"""A FusedReduce below the native backend's ``min_elements`` runs as one serial C call
(backends/native/small.py): the numpy reference's bits for every small reduction the family
fuses, special values included; a body the renderer does not cover runs on numpy."""
from __future__ import annotations

import numpy as np
import pytest

import opgraph
import reference as R
from backends import native
from backends.native import launch, reduce, reduce_run, small
from backends.native.direct_reduce import DirectReduce
from l0ops.fused_reduce import FusedReduce, FusedReduceAttrs, Instr
from l0ops.primitives import FusedAttrs
from opgraph.aclnn import batch_norm_gather_stats_with_counts as gather
from opgraph.core import backend as backend_registry
from opgraph.core.dtypes import DataType as D
from opgraph.testing import check_backend

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])


@pytest.fixture
def small_calls(monkeypatch):
    """Counts the serial C calls the native backend makes: node by node, or as a program's
    prepared direct run (:class:`direct_reduce.DirectReduce` on its small side)."""
    calls = []
    real, real_direct = small.run_small_reduce_native, DirectReduce.run

    def spy(a, inputs):
        calls.append(a)
        return real(a, inputs)

    def spy_direct(self, bindings, small_below):
        out = real_direct(self, bindings, small_below)
        if out is not None and self.small:
            calls.append(self.attrs)
        return out
    monkeypatch.setattr(native, "run_small_reduce_native", spy)
    monkeypatch.setattr(DirectReduce, "run", spy_direct)
    return calls


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_family_small_reductions_match_numpy_bits(soc, small_calls):
    b = backend_registry.get("native")
    before = b.small
    report = check_backend("native", levels=(2,), platforms=[soc], layouts=("contiguous",))
    assert report.ok, str(report)
    assert len(small_calls) > 20  # the family's small FusedReduce kernels took the C call
    assert b.small - before < len(small_calls) / 4  # few bodies fell back to numpy


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_gather_with_special_values(dtype, small_calls):
    """NaN and Inf statistics, a zero invstd, a zero count: the same bits as numpy."""
    mean = np.array([[np.nan, 1, -0.0, 3], [2, np.inf, 0, -1], [1, 2, 3, 4]], dtype)
    invstd = np.array([[1, 0, 2, np.inf], [1, 1, np.nan, 3], [0.5, 2, 1, 1e-3]], dtype)
    counts = np.array([4, 0, 7], dtype)
    results = []
    for backend in ("numpy", "native"):
        rm, rv = np.zeros(4, dtype), np.ones(4, dtype)
        with opgraph.use_backend(backend), opgraph.opt_level(2), np.errstate(all="ignore"):
            m, s = gather.batch_norm_gather_stats_with_counts(
                np.zeros((2, 4, 3), dtype), mean, invstd, rm, rv, 0.1, 1e-5, counts)
        results.append([m, s, rm, rv])
    for got, ref in zip(*reversed(results)):
        R.assert_bits_equal(got, ref)
    assert small_calls


def test_body_the_renderer_does_not_cover_runs_on_numpy(small_calls):
    body = (Instr(op="fma", args=("in0", "in0", "in0"), dtype=D.FLOAT16),  # f16 fma: not rendered
            Instr(op="sum", args=("t0",), dtype=D.FLOAT16, shape=(1, 3)))
    a = FusedReduceAttrs(body=body, results=("t1",), out_shapes=((3,),))
    x = np.float16([[1, -2, 3], [4, 5, -6]])
    with pytest.raises(native.Unsupported):
        small.run_small_reduce_native(a, [x])
    graph = opgraph.core.ir.Graph()
    xv = graph.add_input("x", opgraph.core.types.TensorType((2, 3), opgraph.DataType.FLOAT16))
    graph.outputs = [graph.add_node(FusedReduce.name, [xv], attrs=a).outputs[0]]
    b = backend_registry.get("native")
    before = b.small
    got = b.run(graph, {"x": opgraph.tensor(x)})
    assert b.small == before + 1
    assert got[graph.outputs[0].name].tolist() == [22.0, 32.0, 42.0]  # Σ x² + x


def test_a_body_the_c_code_does_not_cover_is_planned_once(monkeypatch):
    """An Unsupported outcome is remembered per body and operand layouts (raised anew each call,
    with its reason), for the serial call, the reduction passes and the elementwise launch — a
    body that falls back to numpy is not planned again on every call."""
    counts = {"small": 0, "passes": 0, "launch": 0}

    def counting(module, name, key):
        real = getattr(module, name)
        def wrapper(*args):
            counts[key] += 1
            return real(*args)
        monkeypatch.setattr(module, name, wrapper)
    counting(small, "_plan", "small")
    counting(reduce, "_plan", "passes")
    counting(launch, "new_launch", "launch")
    body = (Instr(op="fma", args=("in0", "in0", "in0"), dtype=D.FLOAT16),  # f16 fma: not rendered
            Instr(op="sum", args=("t0",), dtype=D.FLOAT16, shape=(1, 3)))
    a = FusedReduceAttrs(body=body, results=("t1",), out_shapes=((3,),))
    x = np.float16([[1, -2, 3], [4, 5, -6]])
    per_element = FusedAttrs(shape=(2, 3), body=(Instr(op="max", args=("in0", "in0"), dtype=D.FLOAT),),
                             result="t0", out_dtype=D.FLOAT)  # max per element: not rendered
    y = np.float32([[1, -2, 3], [4, 5, -6]])
    for _ in range(3):
        for call in (lambda: small.run_small_reduce_native(a, [x]),
                     lambda: reduce_run.run_fused_reduce_native(a, [x]),
                     lambda: native.run_fused_native(per_element, [y])):
            with pytest.raises(native.Unsupported, match="fma|max"):
                call()
    assert counts == {"small": 1, "passes": 1, "launch": 1}
