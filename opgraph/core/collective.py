"""Collective groups: who implements AllGather / AllReduce for a group name. The l0 ops in
:mod:`l0ops.collectives` carry the group's name; their numpy semantics call the implementation
registered here (``opgraph.torch`` registers torch.distributed process groups; ``"local"`` is
the one-process group, built in).

    >>> import numpy as np
    >>> g = get_group("local")
    >>> g.world_size, [a.tolist() for a in g.all_gather([np.float32([1, 2])])]
    (1, [[[1.0, 2.0]]])
    >>> [a.tolist() for a in g.all_reduce([np.float32([3])])]
    [[3.0]]
"""
from __future__ import annotations

import threading
from typing import Protocol, Sequence

import numpy as np


class CollectiveGroup(Protocol):
    """A set of ranks that exchange arrays. Each call is one collective on every rank."""

    world_size: int

    def all_gather(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per array ``a``: a new array [world_size, *a.shape], row r being rank r's ``a``."""

    def all_reduce(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per array: a new array, the element-wise sum over the ranks."""


class LocalGroup:
    """The group of one process: gathering adds a rank axis, reducing copies."""

    world_size = 1

    def all_gather(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """See :meth:`CollectiveGroup.all_gather`; each array as a copy with a rank axis of 1."""
        return [np.array(a)[None] for a in arrays]

    def all_reduce(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """See :meth:`CollectiveGroup.all_reduce`; a copy of each array (the sum over one rank)."""
        return [np.array(a) for a in arrays]


_GROUPS: dict[str, CollectiveGroup] = {"local": LocalGroup()}
_LOCK = threading.Lock()


def register_group(name: str, group: CollectiveGroup) -> str:
    """Make ``group`` the implementation of collectives on ``name`` (replacing an earlier one);
    returns ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"group name must be a non-empty string, got {name!r}")
    if not isinstance(getattr(group, "world_size", None), int) or group.world_size < 1:
        raise ValueError(f"group {name!r}: world_size must be a positive int")
    with _LOCK:
        _GROUPS[name] = group
    return name


def get_group(name: str) -> CollectiveGroup:
    """The implementation registered for ``name``; KeyError naming the known groups."""
    try:
        return _GROUPS[name]
    except KeyError:
        raise KeyError(f"no collective group {name!r} is registered (known: "
                       f"{', '.join(sorted(_GROUPS))})") from None


__all__ = ["CollectiveGroup", "LocalGroup", "get_group", "register_group"]
