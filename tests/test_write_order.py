"""Graphs that read a user tensor and write it (a ViewCopy into it) keep, at every level, what
each node reads at level 0, where the nodes run in order: the passes may not move a write past a
read of the same tensor, nor a read past a write (from a fuzz of the passes). The expected values
are worked out by hand from the graph, in order."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import opgraph
from backends import get as get_backend, native
from opgraph import passes
from opgraph.core.dtypes import DataType
from opgraph.core.ir import Graph, GraphError, TensorType
from opgraph.core.memory import plan_memory
from opgraph.passes.program import optimize_program

F4 = TensorType((4,), DataType.FLOAT)
X = np.float32([1, 2, 3, 4])
OUT = np.float32([10, 20, 30, 40])
BACKENDS = ["numpy"] + (["native"] if native.available() else [])


def graph(*names: str) -> tuple[Graph, list]:
    g = Graph("order")
    return g, [g.add_input(n, F4) for n in names]


def op(g: Graph, name: str, *args):
    return g.add_node(name, list(args)).outputs[0]


def run(g: Graph, level: int, backend: str, arrays: dict) -> tuple[list, dict]:
    """The optimised graph's outputs, in order, and the inputs as written, on fresh copies."""
    fresh = {k: v.copy() for k, v in arrays.items()}
    opt = passes.optimize(g, level)
    got = get_backend(backend).run(opt, {k: opgraph.tensor(v) for k, v in fresh.items()})
    return [got[v.name].tolist() for v in opt.outputs], fresh


def read_then_written():
    """%1 = out + x reads out before the copy writes x*x into it: [11, 22, 33, 44]; the redirect
    would have Mul write out first."""
    g, (x, out) = graph("x", "out")
    sq = op(g, "Mul", x, x)
    before = op(g, "Add", out, x)
    g.add_node("ViewCopy", [sq, out])
    g.outputs = [before]
    return g, dict(x=X, out=OUT), [OUT + X], dict(out=X * X)


def written_again():
    """out2 takes x*x after out was overwritten with x: the redirect would have placed x*x in
    out, where the second copy replaces it."""
    g, (x, out, out2) = graph("x", "out", "out2")
    sq = op(g, "Mul", x, x)
    g.add_node("ViewCopy", [sq, out])
    g.add_node("ViewCopy", [x, out])
    g.outputs = [g.add_node("ViewCopy", [sq, out2]).outputs[0]]
    return g, dict(x=X, out=OUT, out2=OUT), [X * X], dict(out=X, out2=X * X)


def fused_across_a_write():
    """(out + x) is read before out is overwritten with x, then multiplied by x: fusion put the
    whole expression after the copy."""
    g, (x, out) = graph("x", "out")
    before = op(g, "Add", out, x)
    g.add_node("ViewCopy", [x, out])
    g.outputs = [op(g, "Mul", before, x)]
    return g, dict(x=X, out=OUT), [(OUT + X) * X], dict(out=X)


def merged_across_a_write():
    """The same expression of out before and after out is overwritten: two values, which CSE
    merged."""
    g, (x, out) = graph("x", "out")
    first = op(g, "Add", out, x)
    g.add_node("ViewCopy", [x, out])
    g.outputs = [first, op(g, "Add", out, x)]
    return g, dict(x=X, out=OUT), [OUT + X, X + X], dict(out=X)


def stored_across_a_write():
    """(out + x) * x is read before out is overwritten, then copied into out2: the fused kernel
    taking the copy over ran where the copy was, after the write."""
    g, (x, out, out2) = graph("x", "out", "out2")
    product = op(g, "Mul", op(g, "Add", out, x), x)
    g.add_node("ViewCopy", [x, out])
    g.outputs = [g.add_node("ViewCopy", [product, out2]).outputs[0]]
    return g, dict(x=X, out=OUT, out2=OUT), [(OUT + X) * X], dict(out=X, out2=(OUT + X) * X)


def reduced_across_a_write():
    """Σ(out·x) over out as it was before being overwritten with x: reduction fusion took the
    product into a kernel that ran where the sum was, after the write."""
    g, (x, out) = graph("x", "out")
    product = op(g, "Mul", out, x)
    g.add_node("ViewCopy", [x, out])
    g.outputs = [g.add_node("ReduceSum", [product], axes=(0,)).outputs[0]]
    return g, dict(x=X, out=OUT), [np.float32((OUT * X).sum())], dict(out=X)


def read_of_a_reduced_value_moved_across_a_write():
    """x·x + out reads out before it is overwritten, and x·x is also summed after the write:
    the sum's kernel took x·x, so the re-sort moved the Add after the kernel, past the write."""
    g, (x, out) = graph("x", "out")
    sq = op(g, "Mul", x, x)
    before = op(g, "Add", sq, out)
    g.add_node("ViewCopy", [x, out])
    g.outputs = [g.add_node("ReduceSum", [sq], axes=(0,)).outputs[0], before]
    return g, dict(x=X, out=OUT), [np.float32((X * X).sum()), X * X + OUT], dict(out=X)


def two_redirects_into_one_tensor():
    """w = x·x (redirected: Mul writes w), then x − (x·x) reads it, then w = c − x: redirecting
    the second copy too had Sub(c, x) write w before x·x was read there."""
    g, (x, w, c) = graph("x", "w", "c")
    sq = op(g, "Mul", x, x)
    g.add_node("ViewCopy", [sq, w])
    diff = op(g, "Sub", c, x)
    later = op(g, "Sub", x, sq)
    g.add_node("ViewCopy", [diff, w])
    g.outputs = [later]
    return g, dict(x=X, w=OUT, c=OUT), [X - X * X], dict(w=OUT - X)


def view_of_a_written_tensor():
    """The output is a view of w, and w is then overwritten with its mean: reduction fusion made
    the view a result of the mean's kernel, a copy of w as it was before the write."""
    g = Graph("order")
    w = g.add_input("w", F4)
    view = g.add_node("UnsqueezeNd", [w], dims=(1,)).outputs[0]
    mean = g.add_node("ReduceMean", [w], axes=(0,), keepdims=True).outputs[0]
    g.add_node("ViewCopy", [g.add_node("BroadcastTo", [mean], shape=(4,)).outputs[0], w])
    g.outputs = [view]
    new = np.full(4, X.mean(), np.float32)
    return g, dict(w=X), [new.reshape(4, 1)], dict(w=new)


def view_read_after_the_write():
    """Σ over a view of w taken before w = x, and view·view after it: the view, a result of the
    sum's kernel, kept w's old contents for the product."""
    g = Graph("order")
    x, w = g.add_input("x", F4), g.add_input("w", TensorType((2, 2), DataType.FLOAT))
    view = g.add_node("Reshape", [w], shape=(4,)).outputs[0]
    total = g.add_node("ReduceSum", [view], axes=(0,)).outputs[0]
    g.add_node("ViewCopy", [g.add_node("Reshape", [x], shape=(2, 2)).outputs[0], w])
    g.outputs = [total, op(g, "Mul", view, view)]
    return g, dict(x=X, w=OUT.reshape(2, 2)), [np.float32(OUT.sum()), X * X], dict(w=X.reshape(2, 2))


def view_read_before_a_write():
    """Reshape(w) − c runs after w = w·c and before w = mean(w): with the view out of the
    mean's kernel (it would be a result) the re-sort no longer tied the Sub to its place and
    ran it before the first write."""
    g = Graph("order")
    w, c = g.add_input("w", TensorType((1, 4), DataType.FLOAT)), g.add_input("c", TensorType((), DataType.FLOAT))
    view = g.add_node("Reshape", [w], shape=(4,)).outputs[0]
    mean = g.add_node("ReduceMean", [w], axes=(0,)).outputs[0]
    g.add_node("ViewCopy", [op(g, "Mul", w, c), w])
    before = op(g, "Sub", view, c)
    g.add_node("ViewCopy", [g.add_node("Reshape", [mean], shape=(1, 4)).outputs[0], w])
    g.outputs = [before]
    return g, dict(w=X.reshape(1, 4), c=np.float32(2)), [X * 2 - 2], dict(w=X.reshape(1, 4))


CASES = [read_then_written, written_again, fused_across_a_write, merged_across_a_write,
         view_read_before_a_write,
         view_of_a_written_tensor, view_read_after_the_write,
         two_redirects_into_one_tensor,
         stored_across_a_write, reduced_across_a_write, read_of_a_reduced_value_moved_across_a_write]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_reads_and_writes_of_a_user_tensor_keep_their_order(case, level, backend):
    g, arrays, outputs, written = case()
    got, fresh = run(g, level, backend, arrays)
    assert got == [o.tolist() for o in outputs]
    assert {k: fresh[k].tolist() for k in written} == {k: v.tolist() for k, v in written.items()}


def test_a_cast_round_trip_is_not_folded_across_a_write():
    """Cast(Cast(w, f32), bf16) read after w = c and copied back into w: the program pipeline's
    cast-round-trip folding made its readers read w itself, after the write."""
    bf = TensorType((4,), DataType.BF16)
    g = Graph("order")
    w, c = g.add_input("w", bf), g.add_input("c", bf)
    wide = g.add_node("Cast", [w], to=DataType.FLOAT).outputs[0]
    g.add_node("ViewCopy", [c, w])
    back = g.add_node("Cast", [wide], to=DataType.BF16).outputs[0]
    g.add_node("ViewCopy", [back, w])
    g.outputs = [op(g, "Mul", back, back)]
    start = X.astype(ml_dtypes.bfloat16)
    for backend in BACKENDS:
        arrays = {"w": start.copy(), "c": np.full(4, 7, ml_dtypes.bfloat16)}
        opt = optimize_program(g, 2)
        got = get_backend(backend).run(opt, {k: opgraph.tensor(v) for k, v in arrays.items()})
        assert np.asarray(got[opt.outputs[0].name]).astype(np.float32).tolist() == (X * X).tolist()
        assert arrays["w"].astype(np.float32).tolist() == X.tolist()


def _one_value_into_two_outputs() -> Graph:
    g, (x, w, v) = graph("x", "w", "v")
    y = op(g, "Mul", x, x)
    g.add_node("ViewCopy", [y, w])
    g.add_node("ViewCopy", [y, v])
    return g


def _two_equal_values_into_two_outputs() -> Graph:
    g, (x, w, v) = graph("x", "w", "v")
    y1, y2 = op(g, "Mul", x, x), op(g, "Mul", x, x)
    g.add_node("ViewCopy", [y1, w])
    g.add_node("ViewCopy", [y2, v])
    return g


def _round_trip_into_output() -> Graph:
    g = Graph("order")
    x, w = (g.add_input(n, TensorType((4,), DataType.FLOAT16)) for n in "xw")
    up = g.add_node("Cast", [x], to=DataType.FLOAT).outputs[0]
    g.add_node("ViewCopy", [g.add_node("Cast", [up], to=DataType.FLOAT16).outputs[0], w])
    return g


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("build, first, then", [
    (_one_value_into_two_outputs, passes.optimize, lambda g: passes.optimize(g, 1)),
    (_two_equal_values_into_two_outputs, passes.optimize, lambda g: passes.optimize(g, 2)),
    (_round_trip_into_output, optimize_program, lambda g: optimize_program(g, 2))],
    ids=["level1_twice", "cse_of_redirected", "program_round_trip"])
def test_optimising_a_redirected_graph_again_keeps_every_write(build, first, then, backend):
    """A graph optimised at level 1 (its copies redirected) and optimised again lost writes:
    the second redirect pass redirected the value's other copy too (one value placed in two
    tensors: the plan kept one, w was never written); CSE merged the two redirected values; the
    program pipeline's cast round trip left a redirect from a graph input (no kernel writes
    it). The redirect pass checks earlier redirects again and makes broken ones copies."""
    g = build()
    again = then(first(g, 1))
    assert str(then(again)) == str(again)  # idempotent
    x = np.arange(1, 5).astype(g.inputs[0].dtype.np)
    arrays = {v.name: x if v.name == "x" else np.full(4, 7, v.dtype.np) for v in g.inputs}
    want = x if build is _round_trip_into_output else x * x  # exact: small integers
    fresh = {k: a.copy() for k, a in arrays.items()}
    get_backend(backend).run(again, {k: opgraph.tensor(a) for k, a in fresh.items()})
    for name in arrays:
        assert np.array_equal(fresh[name], x if name == "x" else want), (name, fresh[name])


def test_memory_plan_refuses_a_redirect_no_kernel_makes():
    """A graph (hand-built or loaded) whose copies are marked redirected where no kernel can
    write the destination — one value redirected into two tensors, a graph input redirected —
    was planned with the copy silently dropped: the tensor was never written."""
    g, (x, w, v) = graph("x", "w", "v")
    y = op(g, "Mul", x, x)
    g.add_node("ViewCopy", [y, w], redirect=True)
    g.add_node("ViewCopy", [y, v], redirect=True)
    with pytest.raises(GraphError, match="no kernel would write %v"):
        plan_memory(g)
    g, (x, w) = graph("x", "w")
    g.add_node("ViewCopy", [x, w], redirect=True)
    with pytest.raises(GraphError, match="no kernel would write %w"):
        get_backend("numpy").run(g, {"x": opgraph.tensor(X.copy()), "w": opgraph.tensor(OUT.copy())})
