"""Level-1 pruning: what CANN launches. Identity Contiguous/Cast/ReduceSum, UnsqueezeNd chains
as one pure view, constant folding of constant (Fill-rooted) subgraphs, CSE, DCE and the
ViewCopy redirect (the producing kernel writes straight into a contiguous user output).

    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType
    >>> g = Graph(); x = g.add_input("x", TensorType((3,), DataType.FLOAT))
    >>> y = g.add_node("UnsqueezeNd", [x], dims=(0,)).outputs[0]
    >>> g.outputs = [g.add_node("UnsqueezeNd", [y], dims=(2, 3)).outputs[0]]
    >>> new, stats = identities.run(g)
    >>> print(new.nodes[0])
    %2: f32[1,3,1,1] = UnsqueezeNd(%x, dims=[0,2,3])
"""
from __future__ import annotations

import numpy as np

from l0ops.primitives import cast_array
from opgraph.core.ir import Graph, Node, Value
from opgraph.core.memory import (buffer_root_value, memory_of, redirectable, writes_any,
                                 written_memory)
from opgraph.core.passmanager import FunctionPass, RewritePass, sweep_dead
from opgraph.core.rules import Rule
from opgraph.core.types import TensorType


MOVES = ("copy", "view", "movement")  # op kinds that move values without arithmetic


def _forward(g: Graph, n: Node) -> None:
    """Replace the node's output by its first operand (an identity)."""
    g.replace_all_uses_with(n.outputs[0], n.inputs[0])


def _replace(g: Graph, n: Node, op: str, inputs, **attrs) -> None:
    """Insert ``op(inputs, attrs)`` where ``n`` stands and route n's users to it."""
    new = g.add_node(op, inputs, index=g.nodes.index(n), source=n.source, **attrs)
    g.replace_all_uses_with(n.outputs[0], new.outputs[0])


def merged_unsqueeze_dims(rank: int, inner: tuple[int, ...], outer: tuple[int, ...]) -> tuple[int, ...]:
    """Output positions of UnsqueezeNd(UnsqueezeNd(x: rank, inner), outer) as one call."""
    tokens = ["x"] * rank
    for d in sorted(d % (rank + len(inner)) for d in inner):
        tokens.insert(d, "u")
    for d in sorted(d % (len(tokens) + len(outer)) for d in outer):
        tokens.insert(d, "u")
    return tuple(i for i, t in enumerate(tokens) if t == "u")


def _merge_unsqueeze(g: Graph, n: Node) -> None:
    inner = n.inputs[0].producer
    dims = merged_unsqueeze_dims(inner.inputs[0].type.rank, inner.attrs.dims, n.attrs.dims)
    _replace(g, n, "UnsqueezeNd", [inner.inputs[0]], dims=dims)


def _is_fill(v) -> bool:
    return v.producer is not None and v.producer.op == "Fill"


def _fold_constant(g: Graph, n: Node) -> bool:
    """Evaluate a node whose operands are all Fills on one element each; the result is a Fill.
    Same op, same operand values: the folded value has the result's exact bits — unless a
    Fill (ND, its value a float) cannot hold them (a format tag, an int64 beyond 2**53, a
    complex): then nothing is folded."""
    out = n.outputs[0].type
    if TensorType(out.shape, out.dtype) != out:  # a format tag a Fill would drop
        return False
    args = [np.full((), v.producer.attrs.value, dtype=v.dtype.np) for v in n.inputs]
    with np.errstate(all="ignore"):  # (IEEE results, as the node computes them)
        if n.opdef.kind in MOVES:  # a view, copy or broadcast of a constant: the same value
            value = args[0]
        else:
            value = n.opdef.compute(args, n.attrs)[0]
        exact = cast_array(np.asarray(value), out.dtype)
        if np.iscomplexobj(exact):  # a Fill holds a real value
            return False
        held = float(exact)
        back = np.asarray(held).astype(out.dtype.np)
        # (inside errstate: a signalling NaN's cast warns; a NaN folds whatever its payload)
        if back.tobytes() != exact.tobytes() and not (np.isnan(held)
                                                      and np.isnan(exact.astype(float))):
            return False
    _replace(g, n, "Fill", [], shape=out.shape, value=held, dtype=out.dtype)
    return True


def _foldable(n: Node) -> bool:
    if not n.inputs or not all(_is_fill(v) for v in n.inputs) or n.opdef.written(n):
        return False
    return len(n.outputs) == 1 and (n.opdef.kind == "elementwise"
                                    or (n.opdef.kind in MOVES and len(n.inputs) == 1))


# (an identity's output is typed contiguous: forwarding a strided operand in its place would
# hand its readers another layout — views refuse it — so only contiguous operands are forwarded)
IDENTITY_RULES = [
    Rule("identity-contiguous", "Contiguous", lambda n: n.inputs[0].type.is_contiguous, _forward),
    Rule("identity-cast", "Cast",
         lambda n: n.inputs[0].dtype == n.attrs.to and n.inputs[0].type.is_contiguous, _forward),
    Rule("identity-reducesum", "ReduceSum",
         lambda n: not n.attrs.axes and n.inputs[0].type.is_contiguous, _forward),
    Rule("unsqueeze-view-merge", "UnsqueezeNd",
         lambda n: n.inputs[0].producer is not None and n.inputs[0].producer.op == "UnsqueezeNd"
         and len(n.inputs[0].users) == 1, _merge_unsqueeze),
]
CONSTANT_RULES = [Rule("fold-constant", None, _foldable, _fold_constant)]

identities = RewritePass("prune-identities", IDENTITY_RULES, sweep_only_free=True)
constant_fold = RewritePass("constant-fold", CONSTANT_RULES)


def _cse(g: Graph) -> dict[str, int]:
    """Merge nodes with the same op, operands and attributes (effects are never merged)."""
    seen: dict[tuple, Node] = {}
    merged = 0
    writes: dict[int, int] = {}  # id of a written tensor -> writes to it so far, in order
    for n in list(g.nodes):
        if n.opdef.written(n):
            for m in written_memory(n):
                writes[id(m)] = writes.get(id(m), 0) + 1
            continue
        # (-0.0 is not 0.0; a tensor read before and after a write holds two values)
        versions = tuple(writes.get(id(memory_of(v)), 0) for v in n.inputs) if writes else ()
        key = (n.op, tuple(id(v) for v in n.inputs), n.attrs.exact, versions)
        first = seen.get(key)
        if first is None:
            seen[key] = n
            continue
        for old, new in zip(n.outputs, first.outputs):
            g.replace_all_uses_with(old, new)
        merged += 1
    return {"merged": merged, "dead": sweep_dead(g)}


def _dce(g: Graph) -> dict[str, int]:
    return {"removed": sweep_dead(g)}


def _order_safe(g: Graph, copy_at: int, src_root: Value, resident: set[int]) -> bool:
    """Whether redirecting the ViewCopy at ``copy_at`` keeps what every node reads: the source's
    kernel would write the destination when it runs, so no node between them may touch the
    destination — nor a value an earlier redirect placed there (``resident``: their roots' ids)
    — and no later write may clobber it while the source is still read."""
    dst = memory_of(g.nodes[copy_at].inputs[1])
    p = src_root.producer
    start = g.nodes.index(p)
    if any(memory_of(v) is dst or id(buffer_root_value(v)) in resident
           for m in g.nodes[start + 1:copy_at] for v in m.inputs):
        return False
    src = {id(src_root)}
    for m in g.nodes[start + 1:]:  # the source's views, by position
        if m.opdef.is_free(m) and not m.opdef.written(m) and m.inputs and id(m.inputs[0]) in src:
            src.update(id(v) for v in m.outputs)
    last_read = max([k for k, m in enumerate(g.nodes) if any(id(v) in src for v in m.inputs)]
                    + ([len(g.nodes)] if any(id(v) in src for v in g.outputs) else []), default=-1)
    return not writes_any(g.nodes[copy_at + 1:last_read], {id(dst)})


def _redirect(g: Graph) -> dict[str, int]:
    """ViewCopy into a contiguous user tensor from a kernel's fresh output (or a free view of
    it) becomes a redirect: no copy kernel; the memory planner places the kernel's output in the
    user tensor, where its other readers find it too. One redirect per kernel output, and only
    where no node reads or writes the tensor in between (:func:`_order_safe`). A redirect an
    earlier run made is checked again in its turn, and becomes a copy again if what the passes
    since made of the graph breaks it (CSE merged its source with another redirect's, a cast
    round trip dropped its kernel, a read of the tensor now sits in between): idempotent."""
    count = undone = 0
    taken: set[str] = set()
    into: dict[int, set[int]] = {}  # destination memory -> roots of the values redirected there
    for i, n in enumerate(g.nodes):
        if n.op != "ViewCopy":
            continue
        root, dst = buffer_root_value(n.inputs[0]), id(memory_of(n.inputs[1]))
        ok = (redirectable(root, n.inputs[1], taken)
              and _order_safe(g, i, root, into.setdefault(dst, set())))
        if ok:
            into[dst].add(id(root))
            taken.add(root.name)
        if ok == n.attrs.redirect:
            continue
        g.nodes[i] = Node(n.op, n.inputs, n.attrs.model_copy(update={"redirect": ok}), n.source)
        g.nodes[i].outputs = n.outputs
        for v in n.outputs:
            v.producer = g.nodes[i]
        for v in n.inputs:
            v.users = [g.nodes[i] if u is n else u for u in v.users]
        if ok:
            count += 1
        else:
            undone += 1
    return {"redirected": count, "undone": undone} if undone else {"redirected": count}


cse = FunctionPass("cse", _cse)
dce = FunctionPass("dce", _dce)
viewcopy_redirect = FunctionPass("viewcopy-redirect", _redirect)

# Level 1 is what CANN launches: identities and views dropped, the ViewCopy redirect; every
# kernel CANN runs stays (even an unused or duplicate one). Level 2 adds the rest.
LEVEL1 = [identities, viewcopy_redirect]
CLEANUP = [constant_fold, cse, dce, viewcopy_redirect]
