"""Collectives as l0 ops: AllGather and AllReduce (sum) over a named group of ranks. Every rank
must issue them in the same order, so they never expand (no pass fuses them or moves work
across them), carry ``seq`` (their place among the capture's collectives: CSE never merges two
calls, and a compiled program is checked to keep their order) and run through the
implementation registered for ``group`` (:mod:`opgraph.core.collective`). A capture stores every
collective result no later call reads, so DCE drops one only when what reads it is dead — on
every rank alike, since every rank captures the same calls. One node may move several tensors
in one exchange.

    >>> import numpy as np
    >>> a = AllGather.make_attrs(group="local", world=1, seq=0)
    >>> [r.shape for r in AllGather.compute([np.zeros(3, np.float32), np.ones(3, np.float32)], a)]
    [(1, 3), (1, 3)]
    >>> AllReduce.compute([np.float32([1, 2])], AllReduce.make_attrs(group="local", seq=1))[0].tolist()
    [1.0, 2.0]
"""
from __future__ import annotations

import numpy as np

from opgraph.core.collective import get_group
from opgraph.core.ir import Node
from opgraph.core.opdef import Fidelity, L0Error, OpAttrs, require
from opgraph.core.types import TensorType
from .define import define_op

__all__ = ["AllGather", "AllReduce", "COLLECTIVES", "CollectiveAttrs", "GatherAttrs", "is_collective"]


class CollectiveAttrs(OpAttrs):
    """AllReduce's attributes (and AllGather's, with ``world``): ``group``, the name of a
    registered :class:`~opgraph.core.collective.CollectiveGroup`; ``seq``, the collective's
    number in its capture."""

    group: str   # the name a CollectiveGroup is registered under
    seq: int = 0  # the collective's number in its capture (keeps distinct calls distinct)


class GatherAttrs(CollectiveAttrs):
    """AllGather's attributes: those of :class:`CollectiveAttrs` and ``world``, the group's rank
    count (≥ 1; must equal the registered group's world_size at run time)."""

    world: int   # ranks in the group: the size of the new leading axis


def _plain(t: TensorType, shape: "tuple[int, ...] | None" = None) -> TensorType:
    return TensorType(t.shape if shape is None else shape, t.dtype)


def _gather_infer(ts, a: GatherAttrs):
    require(len(ts) > 0, "AllGather", "needs at least one tensor")
    require(a.world >= 1, "AllGather", f"world must be >= 1, got {a.world}")
    return [_plain(t, (a.world,) + tuple(t.shape)) for t in ts]


def _reduce_infer(ts, a: CollectiveAttrs):
    require(len(ts) > 0, "AllReduce", "needs at least one tensor")
    return [_plain(t) for t in ts]


def _checked(op: str, got: list, want: list[tuple]) -> list[np.ndarray]:
    if len(got) != len(want):
        raise L0Error(f"{op}: the group returned {len(got)} arrays for {len(want)}")
    out = []
    for g, (shape, dtype) in zip(got, want):
        g = np.asarray(g)
        if g.shape != shape or g.dtype != dtype:  # the message built only when raised
            raise L0Error(f"{op}: the group returned {g.dtype}{list(g.shape)}, expected "
                          f"{dtype}{list(shape)}")
        out.append(g)
    return out


def _gather(xs, a: GatherAttrs):
    group = get_group(a.group)
    if group.world_size != a.world:
        raise L0Error(f"AllGather: group {a.group!r} has {group.world_size} ranks, the graph was "
                      f"captured with {a.world}")
    xs = [np.asarray(x, order="C") for x in xs]  # (0-d stays 0-d)
    return _checked("AllGather", group.all_gather(xs), [((a.world,) + x.shape, x.dtype) for x in xs])


def _reduce(xs, a: CollectiveAttrs):
    xs = [np.asarray(x, order="C") for x in xs]  # (0-d stays 0-d)
    return _checked("AllReduce", get_group(a.group).all_reduce(xs), [(x.shape, x.dtype) for x in xs])


_MOVES = (Fidelity("no arithmetic", "data movement between ranks"),)
AllGather = define_op(
    "AllGather", attrs=GatherAttrs, kind="kernel", infer=_gather_infer, compute=_gather,
    fidelity=_MOVES, doc="Each input gathered from every rank of ``group``: [world, *shape].")
AllReduce = define_op(
    "AllReduce", attrs=CollectiveAttrs, kind="kernel", infer=_reduce_infer, compute=_reduce,
    fidelity=(Fidelity("formula", "the sum the group's implementation computes (gloo: its own "
                       "order)"),),
    doc="Each input summed element-wise over the ranks of ``group``.")
COLLECTIVES = ("AllGather", "AllReduce")


def is_collective(node: Node) -> bool:
    """True for an AllGather / AllReduce node."""
    return node.op in COLLECTIVES
