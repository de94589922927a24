"""Graph passes. ``optimize(graph, level)``: 0 = as recorded, 1 = what CANN launches
(pruned), 2 = fused. Every default pass keeps results bit-identical; the opt-in ``fast-math``
pass does not, and says so in its name.

    >>> from opgraph.core.ir import Graph
    >>> optimize(Graph("empty"), 2).nodes
    []
    >>> [p.name for p in pipeline(1)]
    ['prune-identities', 'viewcopy-redirect']
    >>> [p.name for p in pipeline(2)][:4]
    ['prune-identities', 'op-rewrites', 'fuse-elementwise', 'fuse-reductions']

The pass infrastructure (Pass, RewritePass, PassManager, instruments) is in
:mod:`opgraph.core.passmanager`; this package holds the passes and the level pipelines.
"""
from __future__ import annotations

from typing import Optional, Sequence

from opgraph.core.config import OPT_LEVELS
from opgraph.core.ir import Graph
from opgraph.core.passmanager import (DumpInstrument, FunctionPass, Instrument, Pass, PassError,
                                      PassManager, PassStats, PrintInstrument, RewritePass,
                                      TimingInstrument, VerifyInstrument, sweep_dead)
from opgraph.core.rules import Rule
from .prune import constant_fold, cse, dce, identities, viewcopy_redirect
from .fuse import fuse_elementwise, fuse_store, op_rewrites
from .fuse_reduce import fuse_reductions
from .fastmath import fast_math_applied, fast_math_pass
from .levels import level_passes, run_passes
from .stats import GraphStats, graph_stats

LEVELS = OPT_LEVELS


def pipeline(level: int, fast_math: bool = False) -> list[Pass]:
    """The passes of ``level``; ``fast_math`` adds the opt-in bit-changing rewrites to level 2
    (levels 0 and 1 stay as recorded and what CANN launches).

    Level 1 is what CANN launches: identities and pure views dropped, the final ViewCopy
    redirected into a contiguous output; every kernel CANN runs stays. Level 2 fuses right after
    dropping identities, then folds constants, merges duplicates (CSE), drops dead nodes (DCE)
    and redirects copies on what fusion leaves."""
    return level_passes(level, fast_math)


def optimize(graph: Graph, level: int, *, fast_math: bool = False,
             instruments: Sequence[Instrument] = (), verify_each: bool = True,
             stats: Optional[list[PassStats]] = None) -> Graph:
    """A new graph optimised at ``level`` (the input graph is never modified). With
    ``verify_each=False`` (phase 1's hot path) only the final graph is verified; ``stats``
    (a list) receives what each pass did."""
    return run_passes(graph, pipeline(level, fast_math=fast_math), f"level {level} pipeline",
                      instruments=instruments, verify_each=verify_each, stats=stats)


__all__ = ["optimize", "pipeline", "LEVELS", "Pass", "PassStats", "PassManager", "PassError",
           "Rule", "RewritePass", "FunctionPass", "Instrument", "VerifyInstrument",
           "PrintInstrument", "DumpInstrument", "TimingInstrument", "sweep_dead", "identities",
           "constant_fold", "cse", "dce", "viewcopy_redirect", "op_rewrites", "fuse_elementwise",
           "fuse_store", "fuse_reductions", "fast_math_pass", "fast_math_applied", "graph_stats",
           "GraphStats"]
