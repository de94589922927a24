"""Graph passes. ``optimize(graph, level)``: 0 = as recorded, 1 = what CANN launches
(pruned), 2 = fused. Every default pass keeps results bit-identical; the opt-in
``fast-math-channel-affine`` pass does not, and says so in its name.

    >>> from opgraph.ir import Graph
    >>> optimize(Graph("empty"), 2).nodes
    []
    >>> [p.name for p in pipeline(1)]
    ['prune-identities', 'constant-fold', 'cse', 'dce', 'viewcopy-redirect']
    >>> [p.name for p in pipeline(2)][:4]
    ['prune-identities', 'cast-fold-kernel-variant', 'fuse-elementwise', 'fuse-store']
"""
from __future__ import annotations

from typing import Sequence

from .core import (DumpInstrument, FunctionPass, Instrument, Pass, PassError, PassManager,
                   PassStats, PrintInstrument, Rule, RewritePass, TimingInstrument,
                   VerifyInstrument, sweep_dead)
from .prune import LEVEL1, constant_fold, cse, dce, identities, viewcopy_redirect
from .fuse import LEVEL2, fuse_elementwise, fuse_store, kernel_variants
from .fastmath import fast_math_channel_affine
from .stats import GraphStats, graph_stats

LEVELS = (0, 1, 2)
NAMED: dict[str, Pass] = {p.name: p for p in LEVEL1 + LEVEL2 + [fast_math_channel_affine]}


def pipeline(level: int, fast_math: bool = False) -> list[Pass]:
    """The passes of ``level``; ``fast_math`` adds the bit-changing affine rewrite before fusion.

    Level 2 fuses right after dropping identities and runs the rest of level 1 (constant folding,
    CSE, DCE, the ViewCopy redirect) on what fusion leaves: the same result as level 1 then
    fusion (fusion absorbs constant chains too), on a graph a few nodes large."""
    if level not in LEVELS:
        raise ValueError(f"opt level must be one of {LEVELS}, got {level!r}")
    if level == 0:
        return [fast_math_channel_affine] if fast_math else []
    head, tail = LEVEL1[:1], LEVEL1[1:]
    extra = [fast_math_channel_affine] if fast_math else []
    if level == 1:
        return head + tail + extra
    return head + extra + LEVEL2 + tail


def optimize(graph, level: int, *, fast_math: bool = False,
             instruments: Sequence[Instrument] = (), verify_each: bool = True):
    """A new graph optimised at ``level`` (the input graph is never modified). With
    ``verify_each=False`` (phase 1's hot path) only the final graph is verified."""
    out, _ = PassManager(pipeline(level, fast_math), instruments, verify=verify_each).run(graph)
    if not verify_each:
        try:
            out.verify()
        except Exception as e:
            raise PassError(f"level {level} pipeline produced an invalid graph: {e}") from None
    return out


__all__ = ["optimize", "pipeline", "NAMED", "LEVELS", "Pass", "PassStats", "PassManager",
           "PassError", "Rule", "RewritePass", "FunctionPass", "Instrument", "VerifyInstrument",
           "PrintInstrument", "DumpInstrument", "TimingInstrument", "sweep_dead", "identities",
           "constant_fold", "cse", "dce", "viewcopy_redirect", "kernel_variants",
           "fuse_elementwise", "fuse_store", "fast_math_channel_affine", "graph_stats", "GraphStats"]
