"""The program pipeline's passes (opgraph/passes/program.py, fuse_reduce.py's program mode):
round-trip casts folded only when exact, reductions fused across calls but never through a
collective, large values kept inside kernels; results bit-identical to level 0."""
from __future__ import annotations

import numpy as np
import pytest

import backends
from opgraph.capture.program import traffic
from opgraph.core.dtypes import DataType as D
from opgraph.core.ir import Graph, TensorType
from opgraph.core.tensor import tensor
from opgraph.passes.program import cast_round_trip, optimize_program, program_pipeline


def cast_chain(src: D, mid: D) -> Graph:
    g = Graph("c")
    x = g.add_input("x", TensorType((4,), src))
    up = g.add_node("Cast", [x], to=mid).outputs[0]
    g.outputs = [g.add_node("Cast", [up], to=src).outputs[0]]
    return g


@pytest.mark.parametrize("src, mid", [(D.FLOAT16, D.FLOAT), (D.BF16, D.FLOAT), (D.FLOAT, D.DOUBLE),
                                      (D.INT32, D.INT64)])
def test_exact_round_trips_fold(src, mid):
    new, stats = cast_round_trip.run(cast_chain(src, mid))
    assert stats.counts == {"widen-narrow": 1} and new.outputs[0].name == "x"


@pytest.mark.parametrize("src, mid", [(D.FLOAT, D.FLOAT16), (D.FLOAT, D.BF16), (D.INT64, D.DOUBLE),
                                      (D.INT32, D.FLOAT)])
def test_lossy_round_trips_stay(src, mid):
    new, stats = cast_round_trip.run(cast_chain(src, mid))
    assert not stats.changed and [n.op for n in new.nodes] == ["Cast", "Cast"]
    if (src, mid) == (D.FLOAT, D.FLOAT16):  # and they do change bits: 1 + 2^-12 is not an f16
        g = cast_chain(src, mid)
        out = backends.get("numpy").evaluate(g, {"x": tensor(np.float32([1 + 2 ** -12] * 4))})
        assert out[g.outputs[0].name].tolist() == [1.0] * 4


def across_collective() -> Graph:
    """s = Σx per channel; r = AllReduce(s); z = Σ(x·r): z's reduction reads x like s's, but
    depends on the collective that depends on s — one kernel would be a cycle."""
    g = Graph("p")
    x = g.add_input("x", TensorType((4, 3, 8), D.FLOAT))
    s = g.add_node("ReduceSum", [x], axes=(0, 2), keepdims=True).outputs[0]
    r = g.add_node("AllReduce", [s], group="local", seq=0).outputs[0]
    xr = g.add_node("Mul", [x, r]).outputs[0]
    z = g.add_node("ReduceSum", [xr], axes=(0, 2), keepdims=True).outputs[0]
    sq = g.add_node("Mul", [x, x]).outputs[0]                       # a sibling of s
    q = g.add_node("ReduceSum", [sq], axes=(0, 2), keepdims=True).outputs[0]
    g.outputs = [z, q]
    return g.verify()


def test_reductions_fuse_but_not_through_a_collective():
    g = across_collective()
    new = optimize_program(g, 2)
    ops = [n.op for n in new.nodes]
    assert ops == ["FusedReduce", "AllReduce", "FusedReduce"], ops
    first = new.nodes[0]
    assert len(first.outputs) == 2  # s and its sibling Σx² share one pass
    x = np.random.default_rng(0).standard_normal((4, 3, 8)).astype(np.float32)
    ref = backends.get("numpy").evaluate(g, {"x": tensor(x)})
    got = backends.get("numpy").evaluate(new, {"x": tensor(x)})
    for a, b in zip(g.outputs, new.outputs):
        assert np.array_equal(ref[a.name].view(np.uint32), got[b.name].view(np.uint32))


def test_large_results_stay_inside_kernels():
    """Σx and y = x·2 (a full-size result): the program pipeline leaves y to its own kernel;
    a reduction's full-size feeder (x·x) joins it."""
    g = Graph("p")
    x = g.add_input("x", TensorType((4, 3, 8), D.FLOAT))
    two = g.add_node("Fill", [], shape=(), value=2.0, dtype=D.FLOAT).outputs[0]
    y = g.add_node("Mul", [x, two]).outputs[0]
    sq = g.add_node("Mul", [x, x]).outputs[0]
    s = g.add_node("ReduceSum", [sq], axes=(0, 2), keepdims=True).outputs[0]
    g.outputs = [s, y]
    new = optimize_program(g.verify(), 2)
    reduce = [n for n in new.nodes if n.op == "FusedReduce"]
    assert len(reduce) == 1 and all(v.type.numel == 3 for v in reduce[0].outputs)
    assert any(n.outputs[0].shape == (4, 3, 8) and n.op != "FusedReduce" for n in new.nodes)


def test_pipelines_and_traffic():
    assert program_pipeline(0) == [] and [p.name for p in program_pipeline(1)] == [
        "prune-identities", "viewcopy-redirect"]
    with pytest.raises(ValueError, match="opt level must be one of"):
        program_pipeline(3)
    g = Graph("t")
    x = g.add_input("x", TensorType((8,), D.FLOAT))
    y = g.add_input("y", TensorType((8,), D.FLOAT))
    c = g.add_node("ViewCopy", [x, y])
    assert traffic(c) == 64  # read x, write y: the destination is not read
