"""A reducing body run a few channels at a time: where every ``sum`` keeps the same one dim (the
channel) and nothing mixes channels, the body separates along that dim, so it can run on blocks
of channels — each block's registers in cache, the blocks on the worker threads — instead of on
whole arrays (full-size temporaries, a transposed copy per sum). The bits are the same: every
element sees the same operations, and each channel's sum adds the same elements in the same
order (:mod:`l0ops.ordered` orders a sum per kept index, over the reduced dims only).

:func:`channel_split` finds the channel: the one non-1 dim the first keepdims ``sum`` keeps. It
labels every register with the axis that holds the channel (None: a register that does not
depend on it, such as a constant), going through the body in order. No unlabelled register has
a dim of size C (an input, fill, view or sum that would make one is refused), so one broadcasts
along the channel. It refuses (None, and the body runs whole) anything that does not separate:
a sum that reduces the channel, a per-channel ``pow`` exponent (its special cases depend on the
exponent's size), operands whose channels do not line up, a view that does more than add or
drop size-1 dims. :func:`block_body` renames the ``sum`` and ``view`` shapes to a block of ``k``
channels; :func:`channel_ranges` cuts the channels into blocks.

    >>> from opgraph.core.dtypes import DataType as D
    >>> from opgraph.core.types import TensorType
    >>> body = (Instr(op="mul", args=("in0", "in0"), dtype=D.FLOAT),
    ...         Instr(op="sum", args=("t0",), dtype=D.FLOAT, shape=(1, 6, 1), over=(4, 6, 5)),
    ...         Instr(op="view", args=("t1",), dtype=D.FLOAT, shape=(6,)))
    >>> split = channel_split(body, (TensorType((4, 6, 5), D.FLOAT),), ("t2",))
    >>> split.channels, split.in_axes, split.result_axes
    (6, (1,), (0,))
    >>> [i.render(f"t{k}") for k, i in enumerate(block_body(body, split, 2))]
    ['t0: f32 = mul(in0, in0)', 't1: f32[1,2,1] = sum(t0) over [4,2,5]', 't2: f32[2] = view(t1)']
    >>> channel_ranges(6, 5 * 4, 2, block_elems=40)
    [(0, 2), (2, 4), (4, 6)]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from opgraph.core.types import TensorType
from .primitives import IdentityMemo, Instr, body_types

BLOCK_ELEMS = 1 << 19  # a block's full-size registers: 2 MiB of float32, in the L2/L3 caches
# a body whose sums cover fewer elements runs whole: below, two blocks on two threads cost
# more than they save (handing a block to a thread, each block's own numpy calls)
MIN_ELEMS = 1 << 20

Axis = Optional[int]


@dataclass(frozen=True)
class ChannelSplit:
    """Where the channel is: its count, the axis of each input and result (None: the value does
    not depend on the channel), and per instruction of the body the axis its ``sum``/``view``
    shape holds the channel at (None: nothing to rename). ``summed``: the elements the first
    keepdims sum covers (its ``over``), which size the blocks."""

    channels: int
    in_axes: tuple[Axis, ...]
    result_axes: tuple[Axis, ...]
    renamed: tuple[Axis, ...]
    summed: int


_SPLITS = IdentityMemo(limit=4096)
_BLOCK_BODIES = IdentityMemo(limit=4096)


def channel_split(body: Sequence[Instr], in_types: Sequence[TensorType],
                  results: Sequence[str]) -> Optional[ChannelSplit]:
    """How ``body`` separates along its channel, or None (memoised per body and input types)."""
    key = (tuple((t.dtype, t.shape) for t in in_types), tuple(results))
    hit = _SPLITS.get(body, key, lambda: _split(body, in_types, results) or _REFUSED)
    return None if hit is _REFUSED else hit


_REFUSED = object()  # (memoised too: a body that does not separate is not analysed again)


def _channel(body: Sequence[Instr], types: dict) -> Optional[tuple[int, int, int]]:
    """``(C, distance from the right, elements)`` of the first keepdims sum's one kept non-1 dim."""
    for ins in body:
        if ins.op == "sum" and ins.shape is not None:
            over = tuple(ins.over) if ins.over is not None else types[ins.args[0]][1]
            kept = [i for i, (o, n) in enumerate(zip(ins.shape, over)) if o == n and n > 1]
            if len(kept) != 1:
                return None
            return over[kept[0]], len(over) - kept[0], math.prod(over)
    return None


def _input_axis(shape: tuple[int, ...], C: int, distance: int) -> tuple[bool, Axis]:
    """(accepted, axis) of an input: the channel right-aligned as in the summed shape, or a
    vector of C; an input without a dim of size C does not depend on it."""
    r = len(shape)
    if r >= distance and shape[r - distance] == C:
        return True, r - distance
    if r == 1 and shape[0] == C:
        return True, 0
    return C not in shape, None


def _split(body: Sequence[Instr], in_types: Sequence[TensorType],
           results: Sequence[str]) -> Optional[ChannelSplit]:
    types = body_types(body, in_types)
    found = _channel(body, types)  # (C >= 2: the kept dim is not 1)
    if found is None:
        return None
    C, distance, summed = found
    axes: dict[str, Axis] = {}
    for k, t in enumerate(in_types):
        ok, axes[f"in{k}"] = _input_axis(tuple(t.shape), C, distance)
        if not ok:
            return None
    renamed: list[Axis] = []
    for k, ins in enumerate(body):
        shape = types[f"t{k}"][1]
        ok, axis, rename = _instr_axis(ins, shape, [(axes[r], types[r][1]) for r in ins.args], C)
        if not ok:
            return None
        axes[f"t{k}"] = axis
        renamed.append(rename)
    return ChannelSplit(C, tuple(axes[f"in{k}"] for k in range(len(in_types))),
                        tuple(axes[r] for r in results), tuple(renamed), summed)


def _instr_axis(ins: Instr, shape: tuple[int, ...], operands: list[tuple[Axis, tuple[int, ...]]],
                C: int) -> tuple[bool, Axis, Axis]:
    """(accepted, the result's channel axis, the axis of the instruction's shape to rename)."""
    op = ins.op
    if op == "fill":
        return C not in tuple(ins.shape or ()), None, None
    if op == "view":
        (a, src), = operands
        if a is None:
            return C not in shape, None, None
        same = [n for n in src if n != 1] == [n for n in shape if n != 1]
        if not same:
            return False, None, None
        nth = sum(1 for n in src[:a] if n != 1)  # the channel's place among the non-1 dims
        at = [i for i, n in enumerate(shape) if n != 1][nth]
        return True, at, at
    if op == "sum":
        (a, src), = operands
        over = tuple(ins.over) if ins.over is not None else src
        if a is None:
            return C not in over, None, None
        p = len(over) - (len(src) - a)
        if ins.shape is None or ins.shape[p] != C:  # the channel summed away
            return False, None, None
        return True, p, p
    if op == "pow" and operands[1][0] is not None:  # a per-channel exponent
        return False, None, None
    distances = {len(s) - a for a, s in operands if a is not None}
    if not distances:
        return True, None, None
    if len(distances) > 1:
        return False, None, None
    d, = distances  # (an unlabelled operand has size 1 there: no unlabelled register has C)
    return True, len(shape) - d, None


def block_body(body: Sequence[Instr], split: ChannelSplit, k: int) -> tuple[Instr, ...]:
    """``body`` for a block of ``k`` channels: each ``sum``'s and ``view``'s shape (and a sum's
    ``over``) with k at the channel's axis (one object per body and k: compiled once)."""
    def make() -> tuple[Instr, ...]:
        out = []
        for ins, at in zip(body, split.renamed):
            if at is None:
                out.append(ins)
                continue
            update = {"shape": _at(ins.shape, at, k)}
            if ins.over is not None:
                update["over"] = _at(ins.over, at, k)
            out.append(ins.model_copy(update=update))
        return tuple(out)
    return _BLOCK_BODIES.get(body, (split, k), make)


def _at(dims: Sequence[int], axis: int, n: int) -> tuple[int, ...]:
    return tuple(n if i == axis else d for i, d in enumerate(dims))


def channel_ranges(channels: int, per_channel: int, threads: int,
                   block_elems: Optional[int] = None) -> list[tuple[int, int]]:
    """Blocks ``[c0, c1)`` of about ``block_elems`` (default :data:`BLOCK_ELEMS`) elements, at
    least one channel each, and at least ``threads`` of them when there are that many channels."""
    limit = BLOCK_ELEMS if block_elems is None else block_elems
    k = max(1, min(limit // max(per_channel, 1), -(-channels // max(threads, 1))))
    return [(c, min(c + k, channels)) for c in range(0, channels, k)]


__all__ = ["BLOCK_ELEMS", "MIN_ELEMS", "ChannelSplit", "block_body", "channel_ranges",
           "channel_split"]
