"""Pieces the benchmarks share: which backends run here, and the compiled memory floor.

    >>> "numpy" in backends_here()
    True
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from bench_elemt_backward import c_floor_variant
from opgraph.core.backend import BackendUnavailable, get


def backends_here() -> list[str]:
    """numpy, and native when it can run here (a C compiler)."""
    out = ["numpy"]
    try:
        get("native")
        out.append("native")
    except BackendUnavailable:
        pass
    return out


def held_floor(shape: tuple[int, ...], dtype: "np.dtype | str") -> Optional[Callable[[], None]]:
    """bench_elemt_backward's compiled 2-thread ``c = a + b`` over ``shape`` (3 tensor passes)
    on arrays it keeps alive (the kernel holds raw pointers); None without a C compiler."""
    arrays = [np.ones(shape, dtype) for _ in range(3)]  # real pages, not the shared zero page
    fn = c_floor_variant(arrays[:2], arrays[2])
    if fn is None:
        return None

    def floor(keep: list = arrays) -> None:
        fn()
    return floor
