"""Floating-point sums in one fixed, documented order — deterministic for any chunking or thread
count, the same in numpy and in the native C kernels.

For a reduction over ``axes``, the reduced elements of each output are taken in row-major
order of the reduced dims (index ``r`` in ``[0, R)``), then

1. **blocks**: ``r`` is cut into blocks of ``BLOCK`` = 32768 consecutive elements (the last one
   shorter); each block is summed on its own, as below;
2. **lanes**: inside a block, lane ``j`` (``LANES`` = 64 lanes) adds the elements ``j, j+64,
   j+128, ...`` one after another, starting from the first of them;
3. **tree**: the lanes that got elements (``m = min(64, block length)``) are folded in halves:
   with ``n = ceil(m / 2)``, lane ``j`` adds lane ``j + n`` for every ``j < m - n``; then
   ``m = n``, until one value is left;
4. the block sums are folded with the same tree.

Every addition rounds to the accumulation dtype (float32 for float data), so to first order
``|S − exact| ≤ (min(R, 32768)/64 + 6 + ⌈log2(R/32768)⌉)·eps·Σ|x|`` — for R = 10⁵ about
520·eps·Σ|x| against the sequential bound (R − 1)·eps·Σ|x|; the tests check it against float64.

    >>> import numpy as np
    >>> x = np.float32([1e8, 1.0, -1e8, 1.0])
    >>> float(ordered_sum(x, (0,)))       # lanes 0..3 each hold one value: (1e8 + -1e8) + (1 + 1)
    2.0
    >>> float(np.float32(1e8) + np.float32(1.0) + np.float32(-1e8) + np.float32(1.0))  # sequential
    1.0
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import numpy as np

from .workers import PARALLEL_ELEMS, run_split

LANES = 64
BLOCK = 32768  # a multiple of LANES


def tree_fold(a: np.ndarray) -> np.ndarray:
    """Fold the last axis in halves (step 3 above) down to length 1; returns ``a[..., 0]``.

    >>> tree_fold(np.float32([[1, 2, 3, 4, 5]])).tolist()   # ((1+4)+3) + (2+5)
    [15.0]
    """
    m = a.shape[-1]
    if m == 0:
        return np.zeros(a.shape[:-1], a.dtype)
    a = a.copy()
    while m > 1:
        n = (m + 1) // 2
        a[..., : m - n] += a[..., n:m]
        m = n
    return a[..., 0]


def _lane_sums(x: np.ndarray) -> np.ndarray:
    """``x``: (..., B) with 0 < B ≤ BLOCK → (..., min(B, LANES)) lane accumulators (step 2)."""
    B = x.shape[-1]
    rows = B // LANES
    if rows == 0:
        return x.copy()
    full = x[..., : rows * LANES].reshape(x.shape[:-1] + (rows, LANES))
    # numpy reduces a non-innermost axis row after row into the output (no pairwise tree there):
    # lane j gets (((-0.0 + x[j]) + x[j+64]) + ...), and -0.0 + v == v for every v
    acc = np.add.reduce(full, axis=-2, initial=-0.0)
    tail = B - rows * LANES
    if tail:
        acc[..., :tail] += x[..., rows * LANES:]
    return acc


def ordered_sum_last(x: np.ndarray) -> np.ndarray:
    """The ordered sum of ``x`` over its last axis (already in the accumulation dtype)."""
    R = x.shape[-1]
    if R == 0:
        return np.zeros(x.shape[:-1], x.dtype)
    full, tail = divmod(R, BLOCK)
    partial = np.empty(x.shape[:-1] + (full + (tail > 0),), x.dtype)
    if full:  # the whole blocks side by side: one lane sum and one tree for all of them
        blocks = x[..., :full * BLOCK].reshape(x.shape[:-1] + (full, BLOCK))
        partial[..., :full] = tree_fold(_lane_sums(blocks))
    if tail:
        partial[..., full] = tree_fold(_lane_sums(x[..., full * BLOCK:]))
    return tree_fold(partial)


def _fold_steps(m: int) -> tuple[tuple[int, int], ...]:
    """The (m, n) pairs of step 3 for ``m`` lanes: lane j adds lane j + n for j < m − n."""
    steps = []
    while m > 1:
        n = (m + 1) // 2
        steps.append((m, n))
        m = n
    return tuple(steps)


@functools.lru_cache(maxsize=512)
def sum_plan(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool,
             dtype: np.dtype) -> Callable[[np.ndarray], np.ndarray]:
    """:func:`ordered_sum` for one ``shape``/``axes``/``dtype``, with the layout work decided
    once (cached): phase 2 of a cached call only runs the additions.

    >>> sum_plan((2, 3), (0,), False, np.dtype(np.float32))(np.ones((2, 3), np.float32)).tolist()
    [2.0, 2.0, 2.0]
    """
    ndim = len(shape)
    axes = tuple(sorted(a % ndim for a in axes)) if ndim else ()
    kept = [d for d in range(ndim) if d not in axes]
    perm = tuple(kept + list(axes))
    R = math.prod(shape[d] for d in axes)
    rows = tuple(shape[d] for d in kept) + (R,)
    final = tuple(1 if d in axes else n for d, n in enumerate(shape)) if keepdims else rows[:-1]
    if R == 0 or R > LANES:  # the general path: lanes and blocks
        def general(x: np.ndarray) -> np.ndarray:
            moved = np.transpose(x, perm)
            if len(rows) < 2 or rows[0] < 2 or math.prod(rows) < PARALLEL_ELEMS:
                return ordered_sum_last(np.ascontiguousarray(moved, dtype=dtype).reshape(rows)
                                        ).reshape(final)
            out = np.empty(rows[:-1], dtype)

            def some_rows(part: range) -> None:  # rows of the first kept dim: sums of their own
                k, m = part[0], part[-1] + 1
                out[k:m] = ordered_sum_last(np.ascontiguousarray(
                    moved[k:m], dtype=dtype).reshape((m - k,) + rows[1:]))
            run_split(some_rows, range(rows[0]))  # on worker threads (numpy drops the GIL)
            return out.reshape(final)
        return general
    steps = _fold_steps(R)  # one lane per element: only the tree, on a fresh copy

    identity = perm == tuple(range(ndim))
    if R == 2:  # the tree's one step, lane 0 + lane 1, without the copy it would add into
        as_rows = identity and rows == shape  # (the summed axis is already the last)

        def pair(x: np.ndarray) -> np.ndarray:  # (at a few elements, each layer step costs)
            a = x if as_rows else (x if identity else np.transpose(x, perm)).reshape(rows)
            if a.dtype == dtype:  # (numpy's dtype= costs 0.6 µs even when it changes nothing)
                total = np.add(a[..., 0], a[..., 1])
            else:
                total = np.add(a[..., 0], a[..., 1], dtype=dtype)
            return total if total.shape == final else total.reshape(final)
        return pair

    def small(x: np.ndarray) -> np.ndarray:
        a = np.array(x if identity else np.transpose(x, perm), dtype=dtype, order="C").reshape(rows)
        for m, n in steps:
            a[..., : m - n] += a[..., n:m]
        return a[..., 0].reshape(final)
    return small


def ordered_sum(x: np.ndarray, axes: Sequence[int], keepdims: bool = False,
                dtype: "np.dtype | None" = None) -> np.ndarray:
    """Sum ``x`` over ``axes`` in the documented order, accumulating in ``dtype`` (default: float32
    for float16/bfloat16/float32 data, else x's dtype).

    >>> ordered_sum(np.ones((2, 3, 4), np.float16), (0, 2)).tolist()
    [8.0, 8.0, 8.0]
    """
    x = np.asarray(x)
    if dtype is None:  # float16, bfloat16 and float32 data accumulate in float32
        dtype = np.float32 if x.dtype.itemsize <= 4 and x.dtype.kind in "fV" else x.dtype
    return sum_plan(x.shape, tuple(axes), keepdims, np.dtype(dtype))(x)
