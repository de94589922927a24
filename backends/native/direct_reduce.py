"""A compiled program that is one FusedReduce over the caller's tensors whose results the memory
plan places in the caller's output tensors (the copies after it redirected): BatchNormStats,
BatchNormReduceBackward, BatchNormReduce and BatchNormGatherStatsWithCounts at level 2. It runs
without the node-by-node interpreter — no environment of views, no per-node lowering lookup,
no placement — computing exactly what the node's lowering computes and copying each result
into its tensor as the interpreter's placement does, so the bits are the same:

* below the backend's threshold (``min_elements``, or for a body whose sums are over at most
  64 elements ``min_short_elements`` or ``min_stepped_elements``: :func:`.small.serial_kind`),
  the serial C call of :mod:`.small` on the bound tensors' addresses, its results read from
  the call's scratch;
* from there on, the reduction passes of :mod:`.reduce` on the bound tensors' views, then
  their epilogue as one C call into the call's scratch (:attr:`.reduce.Plan.tail`; where the
  renderer does not cover it, numpy instructions under ``np.errstate(all="ignore")``, as the
  interpreter runs); where the passes read nothing but the big inputs (the family's stats and
  backward sums), from the bound tensors' addresses alone, no views
  (:func:`.reduce_run.run_by_address`).

:meth:`DirectReduce.prepare` gives None when the body is one its path does not cover (the
program then runs node by node, where the node falls back to numpy); a run whose size no longer
falls on the prepared side of the threshold (it was changed since) returns None likewise.

    >>> import numpy as np, opgraph
    >>> from opgraph import ops
    >>> ok = __import__("backends.native.build", fromlist=["_"]).availability()[0]
    >>> x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)   # channel 0: 0..3 and 12..15
    >>> with opgraph.use_backend("native" if ok else "numpy"):  # the second call runs directly
    ...     runs = [ops.batch_norm_stats(x, 1e-5)[0].tolist() for _ in range(2)]
    >>> runs[1]
    [7.5, 11.5, 15.5]
"""
from __future__ import annotations

import ctypes
import math
import threading
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from l0ops.fused_reduce import FusedReduceAttrs
from opgraph.core.ir import Node
from opgraph.core.backend import Addressed, data_addresses
from .reduce import plan_for
from .reduce_run import PassRun, run_by_address, run_planned, tail_addresses
from .unsupported import Unsupported
from .small import SmallCall, call_small, plan_small, serial_below, serial_kind


class DirectReduce:
    """The direct run of one FusedReduce program for its bound tensors' layouts. ``dests``: per
    result, the output tensor's binding name and the result's shape there; ``outputs``: the
    graph's outputs as ``(value name, binding name)``; ``small``: whether it was prepared for
    the serial C call (below the threshold) or for the reduction passes; ``kind``: which
    threshold applies (:func:`.small.serial_kind`)."""

    def __init__(self, node: Node, small: bool, kind: int, plan: Any, elements: int,
                 dests: Sequence[tuple[str, tuple[int, ...]]], outputs: Sequence[tuple[str, str]]):
        self.attrs: FusedReduceAttrs = node.attrs
        self.names = tuple(v.name for v in node.inputs)
        self.small, self.kind, self.plan, self.elements = small, kind, plan, elements
        self.reads = tuple(self.names[k] for k in plan.small) if small else ()
        self.dests, self.outputs = tuple(dests), tuple(outputs)
        tail = plan.tail.call if not small and plan.tail is not None else None
        # the serial call (or the passes and their epilogue), the buffers used under the lock
        self.call = SmallCall(plan if small else tail, self.attrs) if small or tail else None
        self.passes = PassRun(plan) if tail is not None else None
        self.lock = threading.Lock()
        # per result, (its dest, its span in the call's scratch) when a byte copy places it
        self.moves: Optional[tuple[tuple[str, int, int], ...]] = None

    @classmethod
    def prepare(cls, node: Node, bindings: Mapping[str, Addressed], limits: tuple[int, int, int],
                dests: Sequence[tuple[str, tuple[int, ...]]],
                outputs: Sequence[tuple[str, str]]) -> "Optional[DirectReduce]":
        """The direct run of ``node`` for these bindings' layouts, or None."""
        elements = sum(math.prod(v.shape) for v in node.inputs)
        kind = serial_kind(node.attrs)
        small = elements < serial_below(kind, *limits)  # as the node's lowering decides
        views = [bindings[v.name].view() for v in node.inputs]
        try:
            plan = plan_small(node.attrs, views) if small else plan_for(node.attrs, views)
        except Unsupported:
            return None
        made = cls(node, small, kind, plan, elements, dests, outputs)
        spans = made.call.spans(made.attrs) if made.call is not None else None
        if spans is not None and all(_row_major(bindings[d].view(), np.float32) for d, _ in dests):
            made.moves = tuple((dest, at, n) for (dest, _), (at, n) in zip(made.dests, spans))
        return made

    def run(self, bindings: Mapping[str, Addressed], limits: tuple[int, int, int]) -> bool:
        """Compute into the bound output tensors; False (nothing done) when the size is no
        longer on the prepared side of the threshold (``limits``: the backend's
        :meth:`~backends.native.NativeBackend.limits`)."""
        if (self.elements < serial_below(self.kind, *limits)) != self.small:
            return False
        if self.small:
            self._compute(bindings, data_addresses(bindings, self.reads))
            return True
        passes = self.passes
        if (passes is not None and passes.by_address and self.moves is not None
                and self.lock.acquire(blocking=False)):
            try:  # C calls only: the inputs' addresses, no views
                self._finish(bindings, run_by_address(passes, data_addresses(bindings, self.names)))
            finally:
                self.lock.release()
            return True
        with np.errstate(all="ignore"):  # the plan is for these layouts: no lookup
            views = [bindings[n].view() for n in self.names]
            if self.passes is not None and self.lock.acquire(blocking=False):
                try:  # this object's pass buffers and scratch
                    self._finish(bindings, tail_addresses(self.plan, views, self.passes.run(views)))
                finally:
                    self.lock.release()
            else:  # no tail, or another thread is in them: buffers and a scratch of its own
                self._place(bindings, run_planned(self.plan, self.attrs, views))
        return True

    def _compute(self, bindings: Mapping[str, Addressed], addresses: Sequence[int]) -> None:
        """The serial call on ``addresses`` into the outputs, in this object's scratch (under
        the lock; while another thread is in it, a call with a scratch of its own)."""
        if not self.lock.acquire(blocking=False):
            self._place(bindings, call_small(self.call.plan, self.attrs, addresses))
            return
        try:
            self._finish(bindings, addresses)
        finally:
            self.lock.release()

    def _finish(self, bindings: Mapping[str, Addressed], addresses: Sequence[int]) -> None:
        """Run the serial call in this object's scratch (the lock held) and copy its results
        into the outputs: by byte (:attr:`moves`), else placed."""
        moves = self.moves
        if moves is not None:
            self.call.compute(addresses)
            for (_, at, n), to in zip(moves, data_addresses(bindings, [m[0] for m in moves])):
                ctypes.memmove(to, at, n)
        else:
            self._place(bindings, self.call(addresses))

    def graph_outputs(self, bindings: Mapping[str, Addressed]) -> dict[str, np.ndarray]:
        """The graph's outputs by value name, as views of the tensors they were copied into."""
        return {name: bindings[dest].view() for name, dest in self.outputs}

    def _place(self, bindings: Mapping[str, Addressed], results: Sequence[np.ndarray]) -> None:
        for (dest, shape), r in zip(self.dests, results):
            np.copyto(bindings[dest].view().reshape(shape), r)


def _row_major(x: np.ndarray, dtype: type) -> bool:
    """Whether ``x`` is a C-contiguous array of ``dtype`` (its elements one run of bytes)."""
    return x.dtype == dtype and x.flags.c_contiguous


__all__ = ["DirectReduce"]
