"""How the numpy interpreter (:func:`l0ops.interpreter.run_fused`) cuts a fused body's iteration
space into chunks, and how a chunk takes its part of a hoisted (per-channel) register. Three
layouts, tried in this order:

* **rows** (:func:`row_blocks`): blocks of whole rows (the dims from the channel on, e.g.
  ``x[n]``), or of a part of each row, read as contiguous runs; each part of the per-channel
  registers is written out once per thread (:func:`expand_part`) and read by every row, so
  nothing broadcasts inside a block (at 32×64×56×56 a block streams one 800 KB run where a
  channel's chunk streams 32 runs of 12.5 KB);
* **within a channel** (:func:`per_block_dims`): each chunk lies in one channel, whose terms are
  then single values;
* **C-order** chunks of at most ``limit`` elements, the per-channel terms broadcast.

Every layout computes the same operations on the same values: results are bit-identical.

    >>> [c[:2] for c in chunks((2, 3, 4), limit=8)]
    [(0, slice(0, 2, None)), (0, slice(2, 3, None)), (1, slice(0, 2, None)), (1, slice(2, 3, None))]
    >>> [c[:2] for c in chunks((2, 3, 4), limit=8, fixed=(1,))]
    [(slice(0, 2, None), 0), (slice(0, 2, None), 1), (slice(0, 2, None), 2)]
"""
from __future__ import annotations

import math
from typing import Iterator, Optional, Sequence

import numpy as np

MIN_RUN = 1024  # per-channel terms are one value per chunk when each channel's run is this long


def chunks(shape: tuple[int, ...], limit: int, fixed: Sequence[int] = ()) -> Iterator[tuple]:
    """Index tuples splitting ``shape`` into C-order blocks of at most ~``limit`` elements. Each
    dim in ``fixed`` takes one integer index per block: a per-channel operand is then one value
    per block, which numpy broadcasts faster than a run of channels."""
    if math.prod(shape) == 0:
        return
    free = [d for d in range(len(shape)) if d not in fixed]
    parts = list(_blocks(tuple(shape[d] for d in free), limit))
    for at in np.ndindex(*(shape[d] for d in fixed)):
        for part in parts:
            idx: list = [slice(None)] * len(shape)
            for d, i in zip(fixed, at):
                idx[d] = i
            for d, i in zip(free, part):
                idx[d] = i
            yield tuple(idx)


def _blocks(shape: tuple[int, ...], limit: int) -> Iterator[tuple]:
    """C-order blocks of ``shape`` of at most ~``limit`` elements as partial index tuples
    (leading dims an index, then one slice; the dims after it whole)."""
    if not shape:
        yield ()
        return
    k = 0
    while k < len(shape) and math.prod(shape[k + 1:]) > limit:
        k += 1
    if k == len(shape):
        k = len(shape) - 1
    inner = max(math.prod(shape[k + 1:]), 1)
    step = max(1, limit // inner)
    for outer in np.ndindex(*shape[:k]):
        for s in range(0, shape[k], step):
            yield tuple(outer) + (slice(s, min(s + step, shape[k])),)


def picker(shape: tuple[int, ...], block: tuple) -> tuple[list, list[int]]:
    """How to take a block of a broadcastable hoisted register: its index template (size-1 dims
    stay whole, or 0 where blocks index the dim with an integer) and the dims a block's own
    index fills in. Every block of :func:`chunks` has the same int/slice pattern.

        >>> picker((1, 3, 1), (0, slice(0, 2), slice(None)))
        ([0, slice(None, None, None), slice(None, None, None)], [1])
    """
    base = [slice(None) if isinstance(i, slice) else 0 for i in block]
    return base, [d for d, n in enumerate(shape) if n != 1]


def _varying_dims(full: tuple[int, ...], sliced: Sequence[np.ndarray]) -> tuple[int, ...]:
    """The dims of ``full`` along which some hoisted register varies (a channel dim)."""
    return tuple(d for d in range(len(full)) if full[d] > 1 and any(x.shape[d] > 1 for x in sliced))


def per_block_dims(full: tuple[int, ...], sliced: Sequence[np.ndarray],
                   big: Sequence[np.ndarray]) -> tuple[int, ...]:
    """The dims along which the sliced hoisted registers vary (the channel dim of per-channel
    terms), if every block can still run ``MIN_RUN`` elements along the dims after them and
    those dims are the inner ones in memory of every full-size array (not channels_last).

        >>> per_block_dims((2, 3, 40, 40), [np.ones((1, 3, 1, 1))], [np.zeros((2, 3, 40, 40))])
        (1,)
    """
    dims = _varying_dims(full, sliced)
    if not dims or math.prod(full[dims[-1] + 1:]) < MIN_RUN:
        return ()
    after = [e for e in range(dims[0] + 1, len(full)) if full[e] > 1 and e not in dims]
    for x in big:
        if any(abs(x.strides[d]) < abs(x.strides[e]) for d in dims for e in after):
            return ()
    return dims


def row_blocks(full: tuple[int, ...], sliced: Sequence[np.ndarray], big: Sequence[np.ndarray],
               limit: int, part_limit: int) -> Optional[tuple[int, list[tuple[tuple, tuple]]]]:
    """The row layout, or None where it does not apply: ``(start, [(index, part), ...])``. A row
    is the dims from ``start``, the first along which a sliced hoisted register varies (the
    channel); it is cut into parts of at most ~``part_limit`` elements (the index tuple ``part``
    over the row dims), and each block is one part of a run of rows, at most ~``limit``
    elements. Blocks come part by part, so a thread writes each part of the registers out once
    (:func:`expand_part`) and reuses it for every row. It applies where rows repeat (the dims
    before ``start`` hold at least 2) and every full-size array holds each row as one C-order
    run.

        >>> x = np.zeros((4, 6, 100), np.float32)
        >>> start, blocks = row_blocks(x.shape, [np.ones((1, 6, 1))], [x, x], 600, 300)
        >>> start, len(blocks), blocks[0][1], blocks[0][0][0]  # 2 rows of channels 0-2
        (1, 4, (slice(0, 3, None),), slice(0, 2, None))
    """
    dims = _varying_dims(full, sliced)
    if not dims:
        return None
    start = dims[0]
    if math.prod(full[:start]) < 2 or not all(_c_order_from(x, start) for x in big):
        return None
    parts = list(_blocks(full[start:], part_limit))
    blocks = []
    for part in parts:
        size = math.prod(part_shape(full[start:], part))
        for rows in _blocks(full[:start], max(1, limit // max(size, 1))):
            idx = _padded(rows, start) + _padded(part, len(full) - start)
            blocks.append((idx, part))
    return start, blocks


def _padded(index: tuple, rank: int) -> tuple:
    """A partial index tuple of :func:`_blocks` completed with whole dims to ``rank``."""
    return tuple(index) + (slice(None),) * (rank - len(index))


def part_shape(shape: tuple[int, ...], part: tuple) -> tuple[int, ...]:
    """The shape of ``np.empty(shape)[part]`` (``part`` of ints and slices).

        >>> part_shape((3, 4, 5), (1, slice(0, 2)))
        (2, 5)
    """
    index = _padded(part, len(shape))
    return tuple(len(range(*i.indices(n))) for n, i in zip(shape, index) if isinstance(i, slice))


def _c_order_from(x: np.ndarray, start: int) -> bool:
    """Whether ``x`` lays out its dims from ``start`` on as one C-order run (size-1 dims aside)."""
    step = x.itemsize
    for n, stride in zip(reversed(x.shape[start:]), reversed(x.strides[start:])):
        if n != 1 and stride != step:
            return False
        step *= n
    return True


def expand_part(value: np.ndarray, full: tuple[int, ...], start: int, part: tuple,
                out: Optional[np.ndarray] = None) -> np.ndarray:
    """Row part ``part`` of ``value`` (broadcastable to ``full``, of size 1 before ``start``)
    written out in full, as the blocks of that part read it; into ``out`` when given (of the
    part's shape and ``value``'s dtype), else a new array.

        >>> expand_part(np.float32([[[1], [2], [3]]]), (4, 3, 2), 1, (slice(1, 3),)).tolist()
        [[2.0, 2.0], [3.0, 3.0]]
    """
    index = _padded(part, len(full) - start)
    sel = tuple(i if n != 1 else (0 if isinstance(i, int) else slice(None))
                for n, i in zip(value.shape[start:], index))
    spread = np.broadcast_to(value[(0,) * start + sel], part_shape(full[start:], part))
    if out is None:
        return np.ascontiguousarray(spread)
    np.copyto(out, spread)
    return out


__all__ = ["MIN_RUN", "chunks", "expand_part", "part_shape", "per_block_dims", "picker",
           "row_blocks"]
