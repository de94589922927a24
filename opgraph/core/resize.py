"""A graph at other sizes: rebuild it with every size it mentions mapped to a new value.

The structure cache (:mod:`opgraph.aclnn.structure`) records an op_api once on *probe* tensors
whose independent dims are distinct primes; every size in the probe graphs (shapes, strides,
shape attributes, summed extents) is then a product of those primes, so it factors into a
monomial of the dims, and the graph for any other sizes of the same structure is the probe graph
with each monomial evaluated at the new dims. A float that is exactly 1/n for such a size (a
mean's scale, maybe folded to float32) maps to 1/n' the same way.

    >>> monomial(11 * 11 * 13, (11, 13))
    (2, 1)
    >>> monomial(7, (11, 13)) is None
    True
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import numpy as np
from pydantic import BaseModel

from .ir import Graph, Value
from .types import TensorType

def monomial(v: int, primes: tuple[int, ...]) -> Optional[tuple[int, ...]]:
    """The exponents of ``v`` over ``primes`` when ``v`` > 1 is a product of them, else None."""
    if v <= 1:
        return None
    exps = []
    for p in primes:
        e = 0
        while v % p == 0:
            v //= p
            e += 1
        exps.append(e)
    return tuple(exps) if v == 1 else None


def graph_numbers(g: Graph) -> Iterator["int | float"]:
    """Every plain int and float in the graph's types and attributes (with repeats)."""
    def walk(obj: Any) -> Iterator["int | float"]:
        t = type(obj)
        if t is int or t is float:
            yield obj
        elif t is dict:
            for v in obj.values():
                yield from walk(v)
        elif t is list or t is tuple:
            for v in obj:
                yield from walk(v)
    for v in g.values():
        yield from walk((v.type.shape, v.type.strides))
    for n in g.nodes:
        yield from walk(n.attrs.model_dump())


Builder = Callable[[Callable[[int], int]], Any]


def reciprocal_of(value: float, is_size: Callable[[int], bool]) -> Optional[tuple[int, bool]]:
    """``(n, rounded)`` when ``value`` is 1/n for a size n — in double, or rounded to float32
    (``rounded``) — as a mean's scale is; else None.

    >>> reciprocal_of(1 / 143, {143}.__contains__), reciprocal_of(0.5, {143}.__contains__)
    ((143, False), None)
    """
    if not 0 < value < 1:
        return None
    n = round(1 / value)
    if not is_size(n):
        return None
    if value == 1 / n:
        return n, False
    return (n, True) if value == float(np.float32(1 / n)) else None


def _builder(obj: Any, is_size: Callable[[int], bool]) -> Optional[Builder]:
    """A function rebuilding ``obj`` with its sizes mapped, or None when it holds no size
    (then ``obj`` itself is reused): the walk is done once, not per call."""
    return _walk(obj, is_size)[0]


def _walk(obj: Any, is_size: Callable[[int], bool]) -> tuple[Optional[Builder], frozenset]:
    """``(builder, sizes)``: :func:`_builder` and the sizes ``obj`` mentions. A model or a tuple
    of them is rebuilt only for new values of its own sizes (:func:`_remembered`), so a body
    whose sizes did not change stays the same object and what is cached per body object (a
    fused body's compiled program) still applies."""
    t = type(obj)
    if t is int:
        return ((lambda f: f(obj)), frozenset((obj,))) if is_size(obj) else (None, frozenset())
    if t is float:
        r = reciprocal_of(obj, is_size)
        if r is None:
            return None, frozenset()
        n, rounded = r
        return ((lambda f: float(np.float32(1 / f(n)))) if rounded else (lambda f: 1 / f(n)),
                frozenset((n,)))
    if t is dict:
        parts = [(k, v, *_walk(v, is_size)) for k, v in obj.items()]
        if all(b is None for _, _, b, _ in parts):
            return None, frozenset()
        return ((lambda f: {k: v if b is None else b(f) for k, v, b, _ in parts}),
                frozenset().union(*(s for _, _, _, s in parts)))
    if t is list or t is tuple:
        walked = [_walk(v, is_size) for v in obj]
        changed = [(i, b) for i, (b, _) in enumerate(walked) if b is not None]
        if not changed:
            return None, frozenset()
        sizes = frozenset().union(*(s for _, s in walked))
        if all(type(v) is int for v in obj):  # a shape: map the sizes in one pass
            flags = [type(v) is int and is_size(v) for v in obj]
            return (lambda f: t([f(v) if s else v for v, s in zip(obj, flags)])), sizes

        def rebuild(f: Callable[[int], int]) -> Any:
            items = list(obj)
            for i, b in changed:
                items[i] = b(f)
            return t(items)
        return _remembered(rebuild, sizes), sizes
    if isinstance(obj, BaseModel):  # attrs: validated once when recorded; only sizes change
        fields = [(k, *_walk(getattr(obj, k), is_size)) for k in type(obj).model_fields]
        fields = [(k, b, s) for k, b, s in fields if b is not None]
        if not fields:
            return None, frozenset()
        sizes = frozenset().union(*(s for _, _, s in fields))
        return (_remembered(lambda f: obj.model_copy(update={k: b(f) for k, b, _ in fields}), sizes),
                sizes)
    return None, frozenset()


def _remembered(build: Builder, sizes: frozenset, keep: int = 8) -> Builder:
    """``build``, giving the object it last built for the same values of ``sizes`` (at most
    ``keep`` kept; attrs are frozen, so graphs may share them)."""
    order, made = tuple(sorted(sizes)), {}

    def remembered(f: Callable[[int], int]) -> Any:
        key = tuple([f(v) for v in order])
        hit = made.get(key)
        if hit is None:
            hit = build(f)
            if len(made) >= keep:
                made.clear()
            made[key] = hit
        return hit
    return remembered


def _type_builder(t: TensorType, is_size: Callable[[int], bool]) -> Optional[Builder]:
    shape, strides = t.shape, t.strides or ()
    flags = [is_size(n) for n in shape], [is_size(n) for n in strides]
    if not any(flags[0]) and not any(flags[1]):
        return None
    sizes = frozenset(n for n, s in zip(shape + strides, flags[0] + flags[1]) if s)

    def build(f: Callable[[int], int]) -> TensorType:  # sizes map ints to ints
        return TensorType.trusted(
            tuple([f(n) if s else n for n, s in zip(shape, flags[0])]), t.dtype, t.format,
            None if t.strides is None else tuple([f(n) if s else n for n, s in zip(strides, flags[1])]))
    return _remembered(build, sizes)


class Resizer:
    """A graph rebuilt at other sizes (``resizer(f)``: every size v becomes f(v); output types
    inferred again, so an inconsistent mapping fails as a type error), the walk over its types
    and attributes done once.
    ``check=False`` maps the output types too instead of inferring them again (for a graph
    whose mapping was already checked once).

    >>> import numpy as np, opgraph, l0ops
    >>> from opgraph.core.executor import Executor
    >>> ex = Executor("demo")
    >>> x = ex.input("x", opgraph.tensor(np.zeros((11, 13), np.float32)))
    >>> ex.output(l0ops.BroadcastTo(ex, x, shape=(2, 11, 13)))
    >>> g = Resizer(ex.graph, {11, 13}.__contains__)({11: 4, 13: 5}.__getitem__)
    >>> g.nodes[0].attrs.shape, g.outputs[0].type.shape
    ((2, 4, 5), (2, 4, 5))
    """

    def __init__(self, g: Graph, is_size: Callable[[int], bool]):
        self.graph = g
        index: dict[TensorType, int] = {}  # each distinct type is mapped once per call
        for v in g.values():
            index.setdefault(v.type, len(index))
        self.types = [(t, _type_builder(t, is_size)) for t in index]
        self.inputs = [(v.name, index[v.type]) for v in g.inputs]
        # per node: op, source, attrs and their builder, operands as positions in the values
        # (inputs, then every node's outputs in order), outputs as (name, type index)
        at = {v.name: i for i, v in enumerate(g.values())}
        self.nodes = [(n.op, n.source, n.attrs, _builder(n.attrs, is_size),
                       [at[v.name] for v in n.inputs], [(v.name, index[v.type]) for v in n.outputs])
                      for n in g.nodes]
        self.results = [at[v.name] for v in g.outputs]

    def __call__(self, f: Callable[[int], int], check: bool = True) -> Graph:
        g = self.graph
        out = type(g)(g.name, g.call)
        types = [t if b is None else b(f) for t, b in self.types]
        if check:
            values = [out.add_input(name, types[k]) for name, k in self.inputs]
        else:
            values = [Value(name, types[k]) for name, k in self.inputs]
            out.inputs = list(values)
        for op, source, attrs, b, operands, outs in self.nodes:
            if b is not None:
                attrs = b(f)
            inputs = [values[i] for i in operands]
            if check:
                node = out.add_node(op, inputs, attrs, out_names=[name for name, _ in outs],
                                    source=source)
            else:  # the mapping was checked once: the output types are mapped, not inferred
                node = out.add_typed_node(op, inputs, attrs, [(name, types[k]) for name, k in outs],
                                          source)
            values += node.outputs
        out.outputs = [values[i] for i in self.results]
        out._next = g._next
        return out


def same_graph(a: Graph, b: Graph) -> bool:
    """Whether two graphs are the same program: inputs (names, types), nodes (ops, attrs, input
    and output names and types) and outputs, in order."""
    def sig(g: Graph) -> tuple:
        return (g.name, g.call, [(v.name, v.type) for v in g.inputs],
                [(n.op, n.attrs, [v.name for v in n.inputs], [(v.name, v.type) for v in n.outputs])
                 for n in g.nodes], [v.name for v in g.outputs])
    return sig(a) == sig(b)


__all__ = ["Resizer", "graph_numbers", "monomial", "reciprocal_of", "same_graph"]
