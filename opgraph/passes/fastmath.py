"""Opt-in, NOT bit-exact: ``fast-math`` applies the bit-changing rewrites l0 ops contribute
(``OpDef.fast_math``), e.g. SyncBatchNormBackwardElemt's per-channel affine form (its error
bound is stated with the rule). It never runs unless asked for (``fast_math=True``).

    >>> fast_math_pass().bit_exact, [r.name for r in fast_math_pass().rules]
    (False, ['channel-affine'])
"""
from __future__ import annotations

from typing import Iterable

from opgraph.core.opdef import all_ops
from opgraph.core.passmanager import PassStats, RewritePass


def fast_math_pass() -> RewritePass:
    """The opt-in pass of every registered op's fast-math rules."""
    p = RewritePass("fast-math", [r for op in all_ops().values() for r in op.fast_math])
    p.bit_exact = False
    return p


def fast_math_applied(stats: Iterable[PassStats]) -> bool:
    """Whether the fast-math pass rewrote something, by a pipeline's pass stats."""
    return any(s.name == "fast-math" and s.changed for s in stats)
