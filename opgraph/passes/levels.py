"""The one shape of every level's pipeline, for single op_api graphs
(:func:`opgraph.passes.pipeline`) and captured programs
(:func:`opgraph.passes.program.program_pipeline`), and the one way to run one: level 0 is the
graph as recorded; level 1 what CANN launches (identities and pure views dropped, the final copy
redirected); level 2 drops identities, (opt-in) rewrites for fast math, the op rewrites, any
extra exact rewrites, elementwise fusion, reduction fusion, the fused store, then the cleanup
(constant folding, CSE, DCE, copies redirected).

    >>> [p.name for p in level_passes(1)]
    ['prune-identities', 'viewcopy-redirect']
    >>> [p.name for p in level_passes(2)][-4:]
    ['constant-fold', 'cse', 'dce', 'viewcopy-redirect']
"""
from __future__ import annotations

from typing import Optional, Sequence

from opgraph.core.config import check_level
from opgraph.core.ir import Graph
from opgraph.core.passmanager import Instrument, Pass, PassError, PassManager, PassStats
from .fastmath import fast_math_pass
from .fuse import fuse_elementwise, fuse_store, op_rewrites
from .fuse_reduce import fuse_reductions
from .prune import CLEANUP, LEVEL1, identities


def level_passes(level: int, fast_math: bool = False, *, before_fusion: Sequence[Pass] = (),
                 reductions: Pass = fuse_reductions) -> list[Pass]:
    """The passes of ``level``: ``fast_math`` adds the opt-in bit-changing rewrites to level 2,
    ``before_fusion`` exact rewrites that run right before fusion there, and ``reductions`` is
    level 2's reduction fusion. A level outside 0-2 is a ValueError."""
    check_level(level)
    if level == 0:
        return []
    if level == 1:
        return list(LEVEL1)
    fm = [fast_math_pass()] if fast_math else []
    return [identities, *fm, op_rewrites(), *before_fusion, fuse_elementwise, reductions,
            fuse_store, *CLEANUP]


def run_passes(graph: Graph, pipeline: Sequence[Pass], what: str, *,
               instruments: Sequence[Instrument] = (), verify_each: bool = True,
               stats: Optional[list[PassStats]] = None) -> Graph:
    """A new graph: ``graph`` through ``pipeline`` (the input graph is never modified). With
    ``verify_each`` the graph is verified after each pass, else only the result is, and an
    invalid result is a PassError naming ``what`` ran; ``stats`` (a list) receives what each
    pass did."""
    out, done = PassManager(pipeline, instruments, verify=verify_each).run(graph)
    if stats is not None:
        stats.extend(done)
    if not verify_each:
        try:
            out.verify()
        except Exception as e:
            raise PassError(f"{what} produced an invalid graph: {e}") from None
    return out


__all__ = ["level_passes", "run_passes"]
