"""Which path a native program takes (direct launches, direct reduction, node by node) for
graphs at the edge of each direct path's conditions, found unpinned by a mutation audit of
backends/native: every program runs, with the numpy backend's bits."""
from __future__ import annotations

import numpy as np
import pytest

import opgraph
from backends import native
from l0ops.fused_reduce import FusedReduceAttrs, Instr
from l0ops.primitives import FusedAttrs
from opgraph.core.backend import get
from opgraph.core.ir import Graph, TensorType
from opgraph.core.memory import plan_memory
from opgraph.core.platform import get_platform
from test_mutants_native import F, _reduce_program, _run_program, same_bits

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])


def _run_graph(backend: str, g: Graph, arrays: dict, runs: int = 3):
    """Per run, the graph outputs (copies) and the bound arrays (new copies of ``arrays``)."""
    plan = plan_memory(g)
    exe = get(backend).compile(g, plan, get_platform())
    seen = []
    for _ in range(runs):
        bound = {n: np.array(a) for n, a in arrays.items()}
        out = exe.run({n: opgraph.tensor(a) for n, a in bound.items()}, bytearray(plan.size))
        seen.append(([np.array(out[v.name]) for v in g.outputs], bound))
    return seen, exe


def _same_runs(g: Graph, arrays: dict):
    """Run ``g`` on native and numpy; assert every output and bound array has the same bits;
    the native executable."""
    got, exe = _run_graph("native", g, arrays)
    want, _ = _run_graph("numpy", g, arrays)
    for (go, gb), (wo, wb) in zip(got, want):
        assert all(same_bits(a, b) for a, b in zip(go, wo))
        assert all(same_bits(gb[n], wb[n]) for n in arrays)
    return exe


def test_reduce_with_a_result_left_in_the_workspace_runs_node_by_node():
    """A FusedReduce of two results of which only one is copied into a caller's tensor (the
    other lies in the workspace) is not a direct reduction: node by node, the same bits."""
    body = (Instr(op="mul", args=("in0", "in0"), dtype=F),
            Instr(op="sum", args=("t0",), dtype=F, shape=(1, 3, 1)),
            Instr(op="sqrt", args=("t1",), dtype=F))
    a = FusedReduceAttrs(body=body, results=("t2", "t1"), out_shapes=((3,), (3,)))
    x = np.float32(np.arange(24).reshape(2, 3, 4) / 3)
    g, plan = _reduce_program(a, x.shape, 1)
    got, exe = _run_program("native", g, plan, x, runs=3)
    want, _ = _run_program("numpy", g, plan, x)
    assert exe.reduce is None and exe.direct_reduce is None
    assert same_bits(got[0], want[0]) and got[0].tolist() == np.sqrt((x.astype(np.float64) ** 2).sum((0, 2))).astype(np.float32).tolist()


def _mul(shape=(6, 40)):
    return FusedAttrs(shape=shape, body=(Instr(op="mul", args=("in0", "in1"), dtype=F),),
                      result="t0", out_dtype=F)


def _inputs():
    x = np.float32(np.arange(240).reshape(6, 40) / 7 - 11)
    return {"x": x, "w": np.float32(np.arange(40).reshape(1, 40) / 5 - 3)}


def test_kernel_chain_through_the_workspace_runs_node_by_node():
    """Two kernels, the first's result in the workspace (no caller's tensor) read by the second,
    which writes into the caller's output: not direct launches (they take bound tensors only),
    node by node with the reference's bits."""
    g = Graph("chain")
    x, w = g.add_input("x", TensorType((6, 40), F)), g.add_input("w", TensorType((1, 40), F))
    o = g.add_input("o", TensorType((6, 40), F))
    k1 = g.add_node("FusedElementwise", [x, w], _mul())
    add = FusedAttrs(shape=(6, 40), body=(Instr(op="add", args=("in0", "in1"), dtype=F),),
                     result="t0", out_dtype=F)
    k2 = g.add_node("FusedElementwise", [k1.outputs[0], x], add)
    g.outputs = [g.add_node("ViewCopy", [k2.outputs[0], o], redirect=True).outputs[0]]
    exe = _same_runs(g, {**_inputs(), "o": np.zeros((6, 40), np.float32)})
    assert exe.direct is None and exe.launches is None


def _gather_graph(copied: int, extra_output: bool = False):
    """The 950's SyncBatchNormGatherStatsFused on bound tensors, ``copied`` of its four results
    copied (redirected) into bound tensors ``o0``...; with ``extra_output`` the graph gives its
    ``mean`` input back too. The graph and its arrays."""
    from l0ops.syncbn import SyncBatchNormGatherStatsFused as G
    W, C = 3, 7
    g = Graph("gather")
    shapes = {"mean": (W, C), "invstd": (W, C), "counts": (W,), "rm": (1, C), "rv": (1, C)}
    ins = [g.add_input(n, TensorType(s, F)) for n, s in shapes.items()]
    outs = [g.add_input(f"o{k}", TensorType((1, C), F)) for k in range(copied)]
    node = g.add_node("SyncBatchNormGatherStatsFused", ins, G.make_attrs(momentum=0.1, eps=1e-5, cores=64))
    g.outputs = [g.add_node("ViewCopy", [r, o], redirect=True).outputs[0]
                 for r, o in zip(node.outputs, outs)] + (ins[:1] if extra_output else [])
    rng = np.random.default_rng(2)
    arrays = {"mean": rng.standard_normal((W, C)).astype(np.float32),
              "invstd": (rng.random((W, C)) + 0.25).astype(np.float32), "counts": np.float32([4, 9, 2]),
              "rm": rng.standard_normal((1, C)).astype(np.float32),
              "rv": (rng.random((1, C)) + 0.5).astype(np.float32),
              **{f"o{k}": np.zeros((1, C), np.float32) for k in range(copied)}}
    return g, arrays


@pytest.mark.parametrize("copied, extra_output, direct", [(4, False, True), (3, False, False),
                                                          (4, True, False)])
def test_gather_runs_direct_only_when_its_results_are_exactly_the_outputs(copied, extra_output, direct):
    """The gather runs as its direct C call when all four results are placed in bound tensors
    and are the graph's outputs; a result left in the workspace, or another graph output (an
    input given back), and it runs node by node. The same bits either way."""
    exe = _same_runs(*_gather_graph(copied, extra_output))
    assert (exe.gather is not None) == direct
