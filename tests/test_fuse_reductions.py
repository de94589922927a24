"""Level-2 reduction fusion: the reductions of the SyncBatchNorm family and the elementwise work
around them become FusedReduce kernels with the bits of level 0 (graphs built from l0 ops, as
the op_apis record them)."""
from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import backends
import opgraph
from backends.numpy_backend import NumpyBackend
from opgraph import passes
from opgraph.core.dtypes import DataType
from opgraph.core.ir import Graph, TensorType

F32 = DataType.FLOAT


def backward_reduce_graph(shape, dt):
    """Casts, Mul, ReduceSum(product) then ReduceSum(gradOut), SyncBatchNormBackwardReduce and
    four outputs — the shape of aclnnBatchNormReduceBackward's graph."""
    g = Graph("backward_reduce")
    C = shape[1]
    go = g.add_input("gradOut", TensorType(shape, dt))
    x = g.add_input("input", TensorType(shape, dt))
    mean = g.add_input("mean", TensorType((C,), F32))
    inv = g.add_input("invstd", TensorType((C,), F32))
    outs = [g.add_input(n, TensorType((C,), F32)) for n in ("sumDy", "sumDyXmu", "gradWeight", "gradBias")]
    gof = g.add_node("Cast", [go], to=F32).outputs[0]
    xf = g.add_node("Cast", [x], to=F32).outputs[0]
    prod = g.add_node("Mul", [gof, xf]).outputs[0]
    axes = tuple(i for i in range(len(shape)) if i != 1)
    sdx = g.add_node("ReduceSum", [prod], axes=axes).outputs[0]
    sdy = g.add_node("ReduceSum", [gof], axes=axes).outputs[0]
    xmu, gw = g.add_node("SyncBatchNormBackwardReduce", [sdy, sdx, mean, inv]).outputs
    res = []
    for v, o in zip((sdy, xmu, gw, sdy), outs):
        res.append(g.add_node("ViewCopy", [g.add_node("Cast", [v], to=F32).outputs[0], o]).outputs[0])
    g.outputs = res
    return g.verify()


def stats_graph(shape, regbase: bool):
    """BatchNormStats: 950 ReduceVar + Add(eps) + Pow(-0.5); 910B ReduceMean, broadcast,
    ReduceStdWithMean."""
    g = Graph("stats")
    C = shape[1]
    axes = tuple(i for i in range(len(shape)) if i != 1)
    x = g.add_input("input", TensorType(shape, F32))
    mean_o = g.add_input("mean", TensorType((C,), F32))
    inv_o = g.add_input("invstd", TensorType((C,), F32))
    if regbase:
        var, mean = g.add_node("ReduceVar", [x], axes=axes).outputs
        eps = g.add_node("Fill", [], shape=(), value=1e-5, dtype=F32).outputs[0]
        ex = g.add_node("Fill", [], shape=(), value=-0.5, dtype=F32).outputs[0]
        inv = g.add_node("Pow", [g.add_node("Add", [var, eps]).outputs[0], ex]).outputs[0]
        outs = [g.add_node("ViewCopy", [inv, inv_o]).outputs[0], g.add_node("ViewCopy", [mean, mean_o]).outputs[0]]
    else:
        mean = g.add_node("ReduceMean", [x], axes=axes).outputs[0]
        o1 = g.add_node("ViewCopy", [mean, mean_o]).outputs[0]
        u = g.add_node("UnsqueezeNd", [mean], dims=axes).outputs[0]
        mb = g.add_node("BroadcastTo", [u], shape=shape).outputs[0]
        inv = g.add_node("ReduceStdWithMean", [x, mb], axes=axes, eps=1e-5).outputs[0]
        outs = [o1, g.add_node("ViewCopy", [inv, inv_o]).outputs[0]]
    g.outputs = outs
    return g.verify()


def run(g, arrays, level):
    fresh = {k: np.array(v, copy=True) for k, v in arrays.items()}
    graph = passes.optimize(g, level)
    NumpyBackend().run(graph, {k: opgraph.tensor(v) for k, v in fresh.items()})
    return graph, fresh


def bits(a):
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("dt", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (2, 5), (3, 2, 4, 4, 2)])
def test_backward_reduce_fuses_into_one_kernel_with_level0_bits(dt, shape):
    rng = np.random.default_rng(0)
    C = shape[1]
    arrays = {"gradOut": rng.standard_normal(shape).astype(dt), "input": rng.standard_normal(shape).astype(dt),
              "mean": rng.standard_normal(C).astype(np.float32),
              "invstd": rng.uniform(0.5, 2, C).astype(np.float32)}
    arrays.update({n: np.zeros(C, np.float32) for n in ("sumDy", "sumDyXmu", "gradWeight", "gradBias")})
    g = backward_reduce_graph(shape, opgraph.dtype_of(np.dtype(dt)))
    g0, ref = run(g, arrays, 0)
    g2, got = run(g, arrays, 2)
    kernels = [n.op for n in g2.nodes if not n.opdef.is_free(n)]
    assert kernels.count("FusedReduce") == 1 and set(kernels) <= {"FusedReduce", "ViewCopy"}
    assert passes.graph_stats(g2).launches == 1  # sumDy, feeding two outputs, is two results
    for k in ("sumDy", "sumDyXmu", "gradWeight", "gradBias"):
        assert np.array_equal(bits(got[k]), bits(ref[k])), k
    x64 = arrays["input"].astype(np.float64)
    dy = arrays["gradOut"].astype(np.float64)
    axes = tuple(i for i in range(len(shape)) if i != 1)
    assert np.allclose(got["sumDy"], dy.sum(axis=axes), rtol=1e-5, atol=1e-4)
    xmu = x64 - arrays["mean"].astype(np.float64).reshape((1, C) + (1,) * (len(shape) - 2))
    assert np.allclose(got["sumDyXmu"], (dy * xmu).sum(axis=axes), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("regbase", [True, False])
def test_stats_fuse_into_one_kernel_with_level0_bits(regbase):
    shape = (6, 4, 7, 5)
    x = (np.random.default_rng(1).standard_normal(shape) * 3 + 2).astype(np.float32)
    arrays = {"input": x, "mean": np.zeros(4, np.float32), "invstd": np.zeros(4, np.float32)}
    g = stats_graph(shape, regbase)
    _, ref = run(g, arrays, 0)
    g2, got = run(g, arrays, 2)
    assert [n.op for n in g2.nodes if not n.opdef.is_free(n)] == ["FusedReduce"]
    for k in ("mean", "invstd"):
        assert np.array_equal(bits(got[k]), bits(ref[k])), k
    x64 = x.astype(np.float64)
    assert np.allclose(got["invstd"], 1 / np.sqrt(x64.var(axis=(0, 2, 3)) + 1e-5), rtol=1e-5)
    assert np.allclose(got["mean"], x64.mean(axis=(0, 2, 3)), rtol=1e-6, atol=1e-6)


def test_fused_reduce_round_trips_through_json_and_prints_its_body():
    g2 = passes.optimize(stats_graph((2, 3, 4), True), 2)
    assert opgraph.Graph.from_json(g2.to_json()) == g2
    text = str(g2)
    assert "FusedReduce(" in text and "sum(" in text and "return " in text


native = pytest.mark.skipif("native" not in __import__("backends").available(),
                            reason="the native backend needs a C compiler (install gcc)")


@native
@pytest.mark.parametrize("dt", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (70, 3, 1000), (3, 2, 40000)])
def test_native_fused_reduce_bits_equal_numpy(dt, shape):
    rng = np.random.default_rng(5)
    C = shape[1]
    arrays = {"gradOut": rng.standard_normal(shape).astype(dt), "input": rng.standard_normal(shape).astype(dt),
              "mean": rng.standard_normal(C).astype(np.float32), "invstd": rng.uniform(0.5, 2, C).astype(np.float32)}
    arrays.update({n: np.zeros(C, np.float32) for n in ("sumDy", "sumDyXmu", "gradWeight", "gradBias")})
    g2 = passes.optimize(backward_reduce_graph(shape, opgraph.dtype_of(np.dtype(dt))), 2)
    nat = backends.get("native")
    nat.fallbacks.clear()  # counted per backend instance, across tests
    outs = []
    for name in ("numpy", "native"):
        fresh = {k: v.copy() for k, v in arrays.items()}
        backends.get(name).run(g2, {k: opgraph.tensor(v) for k, v in fresh.items()})
        outs.append(fresh)
    assert not nat.fallbacks, nat.fallbacks
    for k in ("sumDy", "sumDyXmu", "gradWeight", "gradBias"):
        assert np.array_equal(bits(outs[0][k]), bits(outs[1][k])), k


@native
@pytest.mark.parametrize("regbase", [True, False])
def test_native_stats_two_passes_bits_equal_numpy(regbase):
    shape = (8, 5, 33, 31)
    x = (np.random.default_rng(6).standard_normal(shape) * 3 + 2).astype(np.float32)
    g2 = passes.optimize(stats_graph(shape, regbase), 2)
    outs = []
    for name in ("numpy", "native"):
        fresh = {"input": x, "mean": np.zeros(5, np.float32), "invstd": np.zeros(5, np.float32)}
        backends.get(name).run(g2, {k: opgraph.tensor(v) for k, v in fresh.items()})
        outs.append(fresh)
    assert not backends.get("native").fallbacks
    for k in ("mean", "invstd"):
        assert np.array_equal(bits(outs[0][k]), bits(outs[1][k])), k


THREADS_SCRIPT = """
import sys, numpy as np, opgraph, backends
sys.path.insert(0, {tests!r})
from test_fuse_reductions import backward_reduce_graph
from opgraph import passes
shape = (16, 4, 9000)
rng = np.random.default_rng(7)
a = {{"gradOut": rng.standard_normal(shape).astype(np.float32), "input": rng.standard_normal(shape).astype(np.float32),
     "mean": rng.standard_normal(4).astype(np.float32), "invstd": np.ones(4, np.float32)}}
a.update({{n: np.zeros(4, np.float32) for n in ("sumDy", "sumDyXmu", "gradWeight", "gradBias")}})
g = passes.optimize(backward_reduce_graph(shape, opgraph.DataType.FLOAT), 2)
backends.get("native").run(g, {{k: opgraph.tensor(v) for k, v in a.items()}})
sys.stdout.write(b"".join(a[k].tobytes() for k in ("sumDy", "sumDyXmu", "gradWeight")).hex())
"""


@native
def test_native_reductions_are_the_same_for_any_thread_count():
    tests = os.path.dirname(__file__)
    outs = []
    for n in ("1", "2", "3"):
        env = {**os.environ, "OMP_NUM_THREADS": n}
        outs.append(subprocess.run([sys.executable, "-c", THREADS_SCRIPT.format(tests=tests)], env=env,
                                   capture_output=True, text=True, timeout=300, check=True).stdout)
    assert outs[0] and outs[0] == outs[1] == outs[2]
