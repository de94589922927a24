"""The pipelines for program graphs (many op_api calls captured as one graph by
:mod:`opgraph.capture`). Level 0 runs the calls' graphs as recorded, chained; level 1 is what
CANN launches for them; level 2 fuses across the calls: the level-2 passes plus round-trip casts
folded where the bits stay identical, and reductions fused with every piece of elementwise work
that can share their kernel — large values never leave a kernel, and nothing moves across a
collective (AllGather / AllReduce: data dependencies decide, and the passes keep the graph
schedulable).

    >>> [p.name for p in program_pipeline(2)][:5]
    ['prune-identities', 'op-rewrites', 'cast-round-trip', 'fuse-elementwise', 'fuse-reductions']
    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType as D
    >>> g = Graph(); x = g.add_input("x", TensorType((4,), D.FLOAT16))
    >>> up = g.add_node("Cast", [x], to=D.FLOAT).outputs[0]
    >>> g.outputs = [g.add_node("Cast", [up], to=D.FLOAT16).outputs[0]]
    >>> new, stats = cast_round_trip.run(g)
    >>> new.outputs[0].name, stats.counts
    ('x', {'widen-narrow': 1})
"""
from __future__ import annotations

from typing import Optional, Sequence

from opgraph.core.dtypes import DataType as D
from opgraph.core.ir import Graph, Node
from opgraph.core.memory import memory_of, writes_any
from opgraph.core.passmanager import Instrument, Pass, PassStats, RewritePass
from opgraph.core.rules import Rule
from .fuse_reduce import fuse_reductions_program
from .levels import level_passes, run_passes

# (narrow, wide): every value of ``narrow`` is exactly a value of ``wide``, so casting up and
# back down gives the same bits
EXACT_WIDENINGS = {(D.FLOAT16, D.FLOAT), (D.BF16, D.FLOAT), (D.FLOAT16, D.DOUBLE),
                   (D.BF16, D.DOUBLE), (D.FLOAT, D.DOUBLE), (D.INT8, D.INT16), (D.INT8, D.INT32),
                   (D.INT16, D.INT32), (D.INT8, D.INT64), (D.INT16, D.INT64), (D.INT32, D.INT64),
                   (D.INT8, D.FLOAT), (D.INT16, D.FLOAT), (D.INT32, D.DOUBLE)}


def _round_trip(n: Node) -> bool:
    inner = n.inputs[0].producer
    return (inner is not None and inner.op == "Cast" and inner.inputs[0].dtype == n.attrs.to
            and (inner.inputs[0].dtype, inner.attrs.to) in EXACT_WIDENINGS
            and inner.inputs[0].shape == n.outputs[0].shape)


def _drop_round_trip(g: Graph, n: Node) -> bool:
    """The round trip's readers read its source instead — unless a node writes the source's
    memory between the first cast and the last of them (they would read the new contents)."""
    source = n.inputs[0].producer.inputs[0]
    mem, start = memory_of(source), g.nodes.index(n.inputs[0].producer)
    last = max([g.nodes.index(u) for u in n.outputs[0].users]
               + ([len(g.nodes)] if n.outputs[0] in g.outputs else []), default=start)
    if writes_any(g.nodes[start + 1:last], {id(mem)}):
        return False
    g.replace_all_uses_with(n.outputs[0], source)
    return True


cast_round_trip = RewritePass("cast-round-trip", [Rule("widen-narrow", "Cast", _round_trip,
                                                       _drop_round_trip)])


def program_pipeline(level: int, fast_math: bool = False) -> list[Pass]:
    """The passes of ``level`` for a program graph (see the module docstring); ``fast_math``
    adds the opt-in bit-changing rewrites to level 2, as :func:`~opgraph.passes.pipeline` does."""
    return level_passes(level, fast_math, before_fusion=[cast_round_trip],
                        reductions=fuse_reductions_program)


def optimize_program(graph: Graph, level: int, *, fast_math: bool = False,
                     instruments: Sequence[Instrument] = (), verify_each: bool = False,
                     stats: Optional[list[PassStats]] = None) -> Graph:
    """A new program graph optimised at ``level`` (the input graph is never modified);
    ``stats`` (a list) receives what each pass did."""
    return run_passes(graph, program_pipeline(level, fast_math), f"level {level} program pipeline",
                      instruments=instruments, verify_each=verify_each, stats=stats)


__all__ = ["EXACT_WIDENINGS", "cast_round_trip", "optimize_program", "program_pipeline"]
