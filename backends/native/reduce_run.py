"""Running a planned FusedReduce (:mod:`.reduce`) on the native backend: every pass a C sweep
over the big inputs (:class:`_PassCall`), two passes run channel by channel one C call
(:class:`_BlockedCall`), the per-channel numpy instructions between them, then the epilogue as
one serial C call on the passes' sums (the plan's tail) or in numpy. A :class:`PassRun` makes
each pass's buffer and C arguments once; a caller with fixed layouts (the direct path) keeps
one and runs it under a lock. Bit-identical to numpy and the same for any thread count.

    >>> import numpy as np
    >>> from l0ops.fused_reduce import FusedReduceAttrs, Instr
    >>> from opgraph.core.dtypes import DataType as D
    >>> body = (Instr(op="mul", args=("in0", "in0"), dtype=D.FLOAT),
    ...         Instr(op="sum", args=("t0",), dtype=D.FLOAT, shape=(1, 3, 1)))
    >>> a = FusedReduceAttrs(body=body, results=("t1",), out_shapes=((3,),))
    >>> x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    >>> ok = __import__("backends.native.build", fromlist=["_"]).availability()[0]
    >>> (run_fused_reduce_native(a, [x])[0] if ok else (x.astype(np.float64) ** 2).sum((0, 2))).tolist()
    [748.0, 1356.0, 2220.0]
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence, Union

import numpy as np

from l0ops.fused_reduce import FusedReduceAttrs
from l0ops.ordered import BLOCK
from l0ops.primitives import cast_array
from . import team
from .build import address
from .reduce import BlockedPair, Pass, Plan, plan_for
from .small import call_small


Addresses = Union[Sequence[int], Mapping[int, int]]  # by input index


def _fill_kept(p: Pass, plan: Plan, values: dict, rows: np.ndarray, skip: Sequence[int] = ()) -> None:
    """Pass ``p``'s kept registers into ``rows`` (one row of K each; rows in ``skip`` are the
    call's own to fill)."""
    for j, r in enumerate(p.kept):
        if j in skip:
            continue
        v = values[r]  # a register of K elements is in kept order; others broadcast
        if v.size == plan.K:
            rows[j] = v.reshape(plan.K)
        else:  # assigning broadcasts (np.broadcast_to costs ~6 µs)
            rows[j].reshape(plan.kept_view)[...] = v


def _store(p: Pass, sums: np.ndarray, values: dict) -> None:
    """Pass ``p``'s folded sums (one row each) as their registers, rounded to a narrow dtype."""
    for total, (name, narrow, shape) in zip(sums, p.stores):
        values[name] = (total.astype(narrow).astype(np.float32) if narrow is not None else total).reshape(shape)


def _bind(ptrs: Any, p: Pass, addresses: Addresses) -> None:
    """Write the addresses of pass ``p``'s big inputs (``addresses[input index]``) into the
    first slots of ``ptrs``."""
    for j, i in enumerate(p.big):
        ptrs[j] = addresses[i]


def _big_addresses(inputs: Sequence[np.ndarray], *passes: Pass) -> dict[int, int]:
    """The addresses of the big inputs of ``passes``, by input index."""
    return {i: address(inputs[i]) for p in passes for i in p.big}


class _PassCall:
    """One C sweep of pass ``p`` with its float32 buffer (the kept registers' rows, then the
    sums') and its C arguments made once: a call writes the big inputs' addresses and the kept
    rows, runs the sweep, and, with ``store``, stores the folded sums into the registers."""

    def __init__(self, p: Pass, plan: Plan, store: bool) -> None:
        K, nk = plan.K, len(p.kept)
        self.p, self.plan, self.store = p, plan, store
        self.buf = np.empty((nk + len(p.batch), K), np.float32)
        base = address(self.buf)
        self.ptrs = p.ptr_array(*[0] * len(p.big), *[base + 4 * K * j for j in range(nk)])
        rshape, koff, rstr = p.addresses
        self.head = (K, plan.R, len(p.rshape), rshape, self.ptrs, koff, rstr, -(-plan.R // BLOCK),
                     base + 4 * K * nk)
        self.sums = self.buf[nk:]

    def __call__(self, inputs: Sequence[np.ndarray], values: dict) -> np.ndarray:
        p = self.p
        _fill_kept(p, self.plan, values, self.buf)
        self.from_addresses(_big_addresses(inputs, p))
        if self.store:
            _store(p, self.sums, values)
        return self.sums

    def from_addresses(self, addresses: Addresses) -> None:
        """The sweep on the big inputs at ``addresses`` (by input index), its kept registers'
        rows already filled (a pass with none needs nothing else: :attr:`PassRun.by_address`)."""
        _bind(self.ptrs, self.p, addresses)
        if self.p.fn(*self.head, team.runner_or_null()):
            raise MemoryError("FusedReduce: no memory for the per-block sums")


class _BlockedCall:
    """Both passes of ``bp`` in one C call, as :class:`_PassCall` makes one: one float32 buffer
    holds pass a's kept registers, pass b's (the derived ones written by the call), then the two
    passes' sums (pass a's rows, then pass b's)."""

    def __init__(self, bp: BlockedPair, plan: Plan, store: bool) -> None:
        a, b, K = bp.a, bp.b, plan.K
        na, nb = len(a.kept), len(b.kept)
        self.bp, self.plan, self.store, self.na, self.nb = bp, plan, store, na, nb
        self.skip = [j for j, _ in bp.derived]
        self.buf = np.empty((na + nb + len(a.batch) + len(b.batch), K), np.float32)
        base, row = address(self.buf), 4 * K
        self.ptrs_a = a.ptr_array(*[0] * len(a.big), *[base + row * j for j in range(na)])
        self.ptrs_b = b.ptr_array(*[0] * len(b.big), *[base + row * (na + j) for j in range(nb)])
        out_a = na + nb
        self.head = (K, plan.R, -(-plan.R // BLOCK), len(a.rshape), a.addresses[0], self.ptrs_a,
                     a.addresses[1], a.addresses[2], base + row * out_a, len(b.rshape),
                     b.addresses[0], self.ptrs_b, b.addresses[1], b.addresses[2],
                     base + row * (out_a + len(a.batch)))
        self.sums = self.buf[out_a:]

    def __call__(self, inputs: Sequence[np.ndarray], values: dict) -> np.ndarray:
        bp, plan, na = self.bp, self.plan, self.na
        a, b = bp.a, bp.b
        _fill_kept(a, plan, values, self.buf[:na])
        _fill_kept(b, plan, values, self.buf[na:na + self.nb], self.skip)
        self.from_addresses(_big_addresses(inputs, a, b))
        if self.store:
            _store(a, self.sums[:len(a.batch)], values)
            _store(b, self.sums[len(a.batch):], values)
        return self.sums

    def from_addresses(self, addresses: Addresses) -> None:
        """Both passes on the big inputs at ``addresses`` (see :meth:`_PassCall.from_addresses`)."""
        _bind(self.ptrs_a, self.bp.a, addresses)
        _bind(self.ptrs_b, self.bp.b, addresses)
        if self.bp.fn(*self.head, team.runner_or_null()):
            raise MemoryError("FusedReduce: no memory for the per-block sums")


class PassRun:
    """The steps of ``plan`` up to its tail (all of them without one) with every pass's buffer
    and C arguments made once (:class:`_PassCall`, :class:`_BlockedCall`). Each run writes the
    registers into ``values`` (the last pass's sums only without a tail, which reads them from
    their rows) and returns every pass's sums, rows of its buffers that the next run
    overwrites: one run at a time (a caller that shares a PassRun holds a lock; a run of its
    own makes a new one, as :func:`run_planned` does)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        steps = plan.steps if plan.tail is None else plan.steps[:plan.tail.at]
        last = max(i for i, st in enumerate(steps) if st[0] != "instr")
        self.steps: list = []
        for i, st in enumerate(steps):
            store = plan.tail is None or i != last
            if st[0] == "pass":
                self.steps.append(("call", _PassCall(st[1], plan, store)))
            elif st[0] == "blocked":
                self.steps.append(("call", _BlockedCall(st[1], plan, store)))
            else:
                self.steps.append(st)
        # calls that read nothing but the big inputs and store nothing (a pass with no kept
        # registers, or a blocked pair whose pass b's are its own), as the family's stats and
        # backward sums at level 2 are: then a run needs only the inputs' addresses
        self.by_address = plan.tail is not None and all(
            kind == "call" and not call.store and not call_reads_registers(call)
            for kind, call, *_ in self.steps)
        self.rows = [address(c.sums) + 4 * plan.K * i for _, c, *_ in self.steps
                     for i in range(len(c.sums))] if self.by_address else []  # the tail's sum rows

    def run(self, inputs: Sequence[np.ndarray], values: "dict | None" = None) -> list[np.ndarray]:
        """The passes' sums (float32 rows of K, in pass order); the registers into ``values``."""
        plan = self.plan
        values = {} if values is None else values
        values.update(plan.consts)
        for k, narrow in plan.small:
            values[f"in{k}"] = inputs[k].astype(np.float32) if narrow else inputs[k]
        sums = []
        for step in self.steps:
            if step[0] == "call":
                sums.append(step[1](inputs, values))
            else:
                _, name, fn, args = step
                values[name] = fn(*[values[r] for r in args])
        return sums


def call_reads_registers(call: "_PassCall | _BlockedCall") -> bool:
    """Whether a pass call fills kept registers from the run's values before its sweep."""
    if isinstance(call, _PassCall):
        return bool(call.p.kept)
    return bool(call.bp.a.kept) or len(call.skip) != len(call.bp.b.kept)


def run_fused_reduce_native(a: FusedReduceAttrs, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The results of ``a`` on ``inputs``; :class:`Unsupported` for bodies the C pass does not
    cover (full-size results, reductions over different shapes, non-float data)."""
    inputs = [np.asarray(x) for x in inputs]
    return run_planned(plan_for(a, inputs), a, inputs)


def run_planned(plan: Plan, a: FusedReduceAttrs, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """:func:`run_fused_reduce_native` with the plan already made for these operands' layouts
    (:func:`plan_for`): a caller whose layouts are fixed looks it up once."""
    values: dict[str, np.ndarray] = {}
    sums = PassRun(plan).run(inputs, values)  # held until the tail call has read them
    if plan.tail is not None:
        return call_small(plan.tail.call, a, tail_addresses(plan, inputs, sums))
    out = []
    types = plan.types
    for r, shape in zip(a.results, a.out_shapes):
        d, rshape = types[r]
        v = values[r]
        if v.dtype != d.np:
            v = cast_array(v.astype(d.np), d)
        if v.shape != rshape:
            v = np.broadcast_to(v, rshape)
        out.append(v.reshape(shape) if v.size == math.prod(shape) else np.array(np.broadcast_to(v, shape)))
    return out


def run_by_address(passes: PassRun, addresses: Sequence[int]) -> list[int]:
    """The pointers of the plan's tail call after running ``passes`` (:attr:`PassRun.by_address`)
    on the inputs at ``addresses``: what :func:`tail_addresses` gives after
    :meth:`PassRun.run`, without the inputs' views."""
    for _, call, *_ in passes.steps:
        call.from_addresses(addresses)
    n, rows = len(addresses), passes.rows
    return [addresses[k] if k < n else rows[k - n] for k in passes.plan.tail.call.small]


def tail_addresses(plan: Plan, inputs: Sequence[np.ndarray], sums: Sequence[np.ndarray]) -> list[int]:
    """The pointers of ``plan``'s tail call: the per-channel inputs it reads, then the sum rows
    (``sums`` from :meth:`PassRun.run`)."""
    rows = [address(s) + 4 * plan.K * i for s in sums for i in range(len(s))]
    n = len(inputs)
    return [address(inputs[k]) if k < n else rows[k - n] for k in plan.tail.call.small]


__all__ = ["PassRun", "run_by_address", "run_fused_reduce_native", "run_planned", "tail_addresses"]
