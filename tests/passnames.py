"""How ``--dump-dir`` and ``dump --passes`` name a pipeline's passes, for the tests.

>>> pass_stems(1)
['01-prune-identities', '02-viewcopy-redirect']
"""
from __future__ import annotations

from opgraph import passes


def pass_stems(level: int) -> list[str]:
    """``NN-<pass>`` for every pass of ``level``'s pipeline, numbered from 01 in order."""
    return [f"{i:02d}-{p.name}" for i, p in enumerate(passes.pipeline(level), 1)]


def stem(level: int, name: str) -> str:
    """The ``NN-<name>`` of one pass of ``level``'s pipeline."""
    return next(s for s in pass_stems(level) if s[3:] == name)
