"""A small FusedReduce as one serial C call: every instruction of the body through the prologue
renderer (:mod:`.prologue`, the same C that computes a FusedElementwise's per-channel part),
the results read back from its float32 scratch. For the per-channel bodies the SyncBatchNorm
family fuses over a few ranks' statistics (BatchNormGatherStatsWithCounts: ~40 instructions
on [W, C] values), where numpy spends about a microsecond per instruction and C a few
nanoseconds. Bit-identical to numpy (the renderer rounds and sums as the reference does);
a body with an instruction the renderer does not cover raises :class:`Unsupported`.

    >>> import numpy as np
    >>> from l0ops.fused_reduce import FusedReduceAttrs, Instr
    >>> from opgraph.core.dtypes import DataType as D
    >>> body = (Instr(op="mul", args=("in0", "in0"), dtype=D.FLOAT),
    ...         Instr(op="sum", args=("t0",), dtype=D.FLOAT, shape=(1, 2)),
    ...         Instr(op="sqrt", args=("t1",), dtype=D.FLOAT))
    >>> a = FusedReduceAttrs(body=body, results=("t2",), out_shapes=((2,),))
    >>> x = np.float32([[3, 1], [4, 1]])
    >>> ok = __import__("backends.native.build", fromlist=["_"]).availability()[0]
    >>> (run_small_reduce_native(a, [x])[0] if ok else np.sqrt((x * x).sum(0))).tolist()
    [5.0, 1.4142135381698608]
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from l0ops.expansion import array_types
from l0ops.fused_reduce import FusedReduceAttrs, as_output
from l0ops.ordered import LANES
from l0ops.primitives import IdentityMemo, Instr, body_types
from opgraph.core.dtypes import DataType
from . import build
from .build import PointerArray, address, int64_array
from .prologue import HELPERS as SUM_HELPERS, Prologue
from .c_text import F32, HELPERS, V_HELPERS
from .unsupported import planned

_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


@dataclass
class SmallPlan:
    """The compiled body of one FusedReduce for given operand layouts: the C function, its
    table, the inputs it reads (in pointer order), the scratch size and each result's place in
    the scratch (element offset, shape, byte strides, register dtype)."""

    fn: Any
    table: Any
    small: tuple[int, ...]
    scratch: int
    results: tuple[tuple[int, tuple[int, ...], tuple[int, ...], DataType], ...]

    def __post_init__(self) -> None:
        packs = PointerArray(max(len(self.small), 1))  # packs the addresses (one slot at least:
        # a body of constants reads no input, and its call gets a NULL it never reads)
        self.pointers = packs if self.small else lambda *_: packs(0)


def _plan(a: FusedReduceAttrs, inputs: Sequence[np.ndarray]) -> SmallPlan:
    return compile_body(a.body, body_types(a.body, array_types(inputs)), inputs, a.results)


def compile_body(body: Sequence[Instr], types: dict, inputs: Sequence[np.ndarray],
                 results: Sequence[str]) -> SmallPlan:
    """The serial C call computing the registers ``results`` of ``body`` (``types``: every
    register's dtype and shape) from the per-channel ``inputs`` it reads, laid out as these are;
    :class:`Unsupported` when the prologue renderer does not cover an instruction or a result
    is not a float register. The reductions' epilogue uses it too (:mod:`.reduce`)."""
    needed = tuple(dict.fromkeys(results))
    pro = Prologue(body, types, inputs, needed)  # (Unsupported: a result not a float register)
    source = "\n".join([HELPERS, V_HELPERS, SUM_HELPERS, pro.source,
                        "int opg_small(const int64_t *tab, void *const *small, float *scr)",
                        "{", "    opg_prologue(tab, small, scr);", "    return 0;", "}", ""])
    fn = build.load(source, symbol="opg_small").fn
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    regs = tuple((pro.regs[r][0], tuple(pro.regs[r][1]), tuple(4 * s for s in pro.regs[r][2]),
                  types[r][0]) for r in results)
    return SmallPlan(fn, int64_array(pro.table), pro.small, pro.scratch, regs)


def short_sums(a: FusedReduceAttrs) -> bool:
    """Whether every sum of ``a``'s body adds at most 64 elements (by its ``over`` shape), each
    then in a lane of its own: the serial call folds them for 64 kept indices at a time, in
    vector registers (BatchNormGatherStatsWithCounts: a sum over the ranks).

        >>> from l0ops.fused_reduce import Instr
        >>> s = Instr(op="sum", args=("in0",), dtype=F32, shape=(1, 2048), over=(8, 2048))
        >>> short_sums(FusedReduceAttrs(body=(s,), results=("t0",), out_shapes=((2048,),)))
        True
    """
    for ins in a.body:
        if ins.op == "sum":
            if ins.over is None:
                return False
            reduced = ins.over if ins.shape is None else [n for o, n in zip(ins.shape, ins.over) if o != n]
            if math.prod(reduced) > LANES:
                return False
    return True


def sum_chain(body: Sequence[Instr]) -> int:
    """The most sums on one chain of ``body``'s dependencies (a sum reading what another sum
    gave, through any instructions): the reduction passes take one sum of a chain each, and
    from three on (BatchNormGatherStatsWithCounts: the counts', the mean's, the variance's)
    stop for numpy steps between them, where two run as one C call.

        >>> s = lambda x: Instr(op="sum", args=(x,), dtype=F32, shape=(1, 4), over=(2, 4))
        >>> sum_chain((s("in0"), Instr(op="sub", args=("in0", "t0"), dtype=F32), s("t1"))), sum_chain((s("in0"), s("in1")))
        (2, 1)
    """
    depth: dict[str, int] = {}
    for k, ins in enumerate(body):
        depth[f"t{k}"] = max((depth.get(r, 0) for r in ins.args), default=0) + (ins.op == "sum")
    return max(depth.values(), default=0)


LONG, SHORT, STEPPED = 0, 1, 2  # which threshold a FusedReduce takes (:func:`serial_below`)


def serial_kind(a: FusedReduceAttrs) -> int:
    """Which threshold sends ``a`` to the serial call (:func:`serial_below`; its body's
    structure only, remembered per body): ``LONG`` unless every sum adds at most 64 elements
    (:func:`short_sums`); then ``STEPPED`` from three sums on one chain (:func:`sum_chain`: the
    gather's passes took 2.3x the serial call's time at 16-64 ranks of 2048 channels), else
    ``SHORT`` (the statistics of a [N <= 64, C] input, whose passes lead from ~65K elements;
    HISTORY)."""
    def kind() -> int:
        if not short_sums(a):
            return LONG
        return STEPPED if sum_chain(a.body) >= 3 else SHORT
    return _KINDS.get(a.body, (), kind)


_KINDS = IdentityMemo(limit=1024)


def serial_below(kind: int, min_elements: int, min_short_elements: int,
                 min_stepped_elements: int) -> int:
    """The input elements below which a FusedReduce runs as the one serial C call rather than
    the reduction passes (the native backend's thresholds): ``min_elements`` for a ``LONG``
    body; for a body of :func:`short_sums` the larger of it and ``min_short_elements``
    (``SHORT``) or ``min_stepped_elements`` (``STEPPED``: :func:`serial_kind`).

        >>> serial_below(LONG, 4096, 1 << 16, 1 << 20), serial_below(STEPPED, 4096, 1 << 16, 1 << 20)
        (4096, 1048576)
    """
    return max(min_elements, (0, min_short_elements, min_stepped_elements)[kind])


_PLANS = IdentityMemo(limit=256)


def plan_small(a: FusedReduceAttrs, inputs: Sequence[np.ndarray]) -> SmallPlan:
    """The cached serial C call of ``a`` for operands of these layouts (Unsupported if the
    prologue renderer does not cover the body)."""
    return planned(_PLANS, a, tuple((x.dtype, x.shape, x.strides) for x in inputs),
                   lambda: _plan(a, inputs))


def _readers(plan: SmallPlan, a: FusedReduceAttrs, scr: np.ndarray) -> list[Callable[[], np.ndarray]]:
    """Per result, how to read it from the call's own scratch ``scr`` as its output: a float32
    one is a view made here, once; another dtype a cast made per read (the C call rounded the
    register to its dtype: the cast is exact)."""
    readers: list[Callable[[], np.ndarray]] = []
    for (off, shape, strides, dtype), out_shape in zip(plan.results, a.out_shapes):
        v = np.ndarray(shape, np.float32, scr, 4 * off, strides)
        view = as_output(v, out_shape) if dtype == F32 else None
        if view is not None and np.shares_memory(view, scr):  # a view: made once, read live
            readers.append(lambda view=view: view)
        elif dtype == F32:  # a broadcast (or a reshape that copies): copied from each call's values
            readers.append(lambda v=v, s=out_shape: as_output(v, s))
        else:
            readers.append(lambda v=v, t=dtype.np, s=out_shape: as_output(v.astype(t), s))
    return readers


class SmallCall:
    """``plan``'s serial C call with its own scratch and the views of the results in it made
    once; each call packs the inputs' addresses (the per-channel inputs ``plan.small`` reads, in
    that order), runs it and returns the results read from the scratch (a caller that keeps them
    past the next call, or shares the SmallCall between threads, copies them under a lock)."""

    def __init__(self, plan: SmallPlan, a: FusedReduceAttrs) -> None:
        self.plan, self.scratch = plan, np.empty(plan.scratch, np.float32)
        self.at, self.readers = address(self.scratch), _readers(plan, a, self.scratch)

    def __call__(self, addresses: Sequence[int]) -> list[np.ndarray]:
        self.compute(addresses)
        return [read() for read in self.readers]

    def compute(self, addresses: Sequence[int]) -> None:
        """Run the call; the results are in the scratch (:meth:`spans`)."""
        plan = self.plan
        plan.fn(plan.table, plan.pointers(*addresses), self.at)

    def spans(self, a: FusedReduceAttrs) -> Optional[list[tuple[int, int]]]:
        """Per result, its ``(address, bytes)`` in the scratch, when every result is a float32
        register laid out row-major with its output's size (a byte copy is then the read);
        else None."""
        spans = []
        for (off, shape, strides, dtype), out_shape in zip(self.plan.results, a.out_shapes):
            n = math.prod(shape)
            if dtype != F32 or n != math.prod(out_shape) or \
                    any(s != 4 * math.prod(shape[d + 1:]) for d, s in enumerate(strides) if shape[d] > 1):
                return None
            spans.append((self.at + 4 * off, 4 * n))
        return spans


def prepared_small(plan: SmallPlan, a: FusedReduceAttrs,
                   addresses: Sequence[int]) -> Callable[[], list[np.ndarray]]:
    """``plan``'s serial C call on the inputs at ``addresses``, prepared: a :class:`SmallCall`
    whose pointers are packed once too."""
    fn, table, ptrs, small = plan.fn, plan.table, plan.pointers(*addresses), SmallCall(plan, a)
    at, readers = small.at, small.readers

    def call() -> list[np.ndarray]:
        fn(table, ptrs, at)
        return [read() for read in readers]
    return call


def call_small(plan: SmallPlan, a: FusedReduceAttrs, addresses: Sequence[int]) -> list[np.ndarray]:
    """The results of ``plan``'s serial C call on the inputs at ``addresses``, once."""
    return prepared_small(plan, a, addresses)()


def run_small_reduce_native(a: FusedReduceAttrs, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The results of ``a`` on ``inputs`` (new arrays), computed by one serial C call."""
    inputs = [np.asarray(x) for x in inputs]
    plan = plan_small(a, inputs)
    return call_small(plan, a, [address(inputs[k]) for k in plan.small])


__all__ = ["SmallCall", "SmallPlan", "call_small", "compile_body", "plan_small", "prepared_small",
           "run_small_reduce_native", "serial_below", "serial_kind", "short_sums", "sum_chain", "LONG",
           "SHORT", "STEPPED"]
