"""opgraph's fixed float32 summation order written as plain loops, for the tests only: an
independent model of ``l0ops.ordered`` (it imports nothing from opgraph).

The order (``l0ops/ordered.py``): blocks of 32768 elements; in a block, 64 lanes, lane j adding
elements j, j+64, j+128, ... one at a time; the lanes, then the blocks, folded in halves (with
n = ceil(m/2), value j adds value j+n for j < m-n, until one is left). Every add rounds to
float32.

    >>> import numpy as np
    >>> float(loop_sum([1.0, 2.0, 3.0]))
    6.0
    >>> channel_sums(np.float32([[1, 2, 3], [4, 5, 6]])).tolist()
    [6.0, 15.0]
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

BLOCK, LANES = 32768, 64
F32 = np.float32


def fold(values: Sequence) -> "np.float32 | np.ndarray":
    """The halving tree over ``values`` (float32 scalars, or float32 arrays added elementwise)."""
    acc, m = list(values), len(values)
    while m > 1:
        n = (m + 1) // 2
        for j in range(m - n):
            acc[j] = acc[j] + acc[j + n]
        m = n
    return acc[0]


def channel_sums(rows: np.ndarray) -> np.ndarray:
    """float32 ``[C, R]`` → ``[C]``: each row summed in the order above (all channels at once:
    numpy's float32 adds round each sum as the scalar loop would)."""
    rows = np.asarray(rows, F32)
    C, R = rows.shape
    if R == 0:
        return np.zeros(C, F32)
    blocks = []
    for b in range(0, R, BLOCK):
        blk = rows[:, b:b + BLOCK]
        lanes = [blk[:, j].copy() for j in range(min(LANES, blk.shape[1]))]
        for i in range(LANES, blk.shape[1]):
            lanes[i % LANES] = lanes[i % LANES] + blk[:, i]
        blocks.append(fold(lanes))
    return fold(blocks)


def loop_sum(values: Sequence[float]) -> np.float32:
    """One sequence summed in the order above, each value first rounded to float32."""
    return F32(channel_sums(np.asarray([F32(v) for v in values], F32).reshape(1, -1))[0])
