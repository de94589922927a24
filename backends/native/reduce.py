"""FusedReduce on the native backend: the reductions run as compiled C (kept index × block on
the thread team, vectorised lanes), bit-identical to numpy and the same for any thread count.

A reduction pass computes the per-element instructions its sums need and adds them into the 64
lane accumulators of each (kept index, block) — the order of :mod:`l0ops.ordered` — then folds
the lanes and blocks with the same tree (:mod:`.reduce_c`). numpy runs the per-channel
instructions between passes (a variance's mean); those after the last pass (the epilogue) run
as one serial C call on the passes' sums (:class:`Tail`: ~7 numpy calls a stats call, 12–16 µs
of its 90–130 µs at 8×64×28×28 and below), or in numpy where the renderer does not cover them.
Sums that need only inputs and finished per-channel values share one pass over the data. Two
passes with only simple per-channel arithmetic between them (a mean, then the squared
differences from it) run channel by channel in one C call, the second while the channel's data
is still in cache (:func:`_blocked`); each block's sum and fold is the same, so are the bits.
Everything that depends only on the operands' dtypes, shapes and strides (which registers are
per element, the passes, their C kernels, offsets and strides) is planned once per FusedReduce
and reused.

This module plans; :mod:`.reduce_run` runs the plans.

    >>> import numpy as np
    >>> from l0ops.fused_reduce import FusedReduceAttrs, Instr as I
    >>> from opgraph.core.dtypes import DataType as D
    >>> k = dict(dtype=D.FLOAT, shape=(1, 3, 1))   # Σx and Σx² over dims 0 and 2: one pass
    >>> a = FusedReduceAttrs(body=(I(op="sum", args=("in0",), **k), I(op="mul", args=("in0", "in0"),
    ...     dtype=D.FLOAT), I(op="sum", args=("t1",), **k)), results=("t0", "t2"), out_shapes=((3,),) * 2)
    >>> ok = __import__("backends.native.build", fromlist=["_"]).availability()[0]
    >>> plan = plan_for(a, [np.ones((2, 3, 4), np.float32)]) if ok else None
    >>> [(st[0], st[1].batch) for st in plan.steps] if ok else [("pass", (0, 2))]
    [('pass', (0, 2))]
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any, Container, Optional, Sequence

import numpy as np

from l0ops.fused_reduce import FusedReduceAttrs
from l0ops.primitives import IdentityMemo, Instr, body_types, compile_instr
from opgraph.core.dtypes import DataType, dtype_of
from opgraph.core.types import TensorType
from . import build
from .build import PointerArray
from .pair_c import render_blocked, render_cols_pair
from .reduce_c import render_pass
from .c_text import C_OP, FLOATS
from .small import SmallPlan, compile_body
from .unsupported import Unsupported, planned

_ARGTYPES = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
_PASS_ARGS = [ctypes.c_int64] + [ctypes.c_void_p] * 5  # nr, rshape, ptrs, koff, rstr, out
_BLOCKED_ARGTYPES = [ctypes.c_int64] * 3 + _PASS_ARGS * 2 + [ctypes.c_void_p]
BLOCKED_MIN_K = 8  # kept indices from which two passes run index by index (see _blocked)
_PER_INDEX_OPS = (*C_OP, "sqrt", "cast", "view")  # instructions the blocked call renders per index
_NARROW = (DataType.FLOAT16, DataType.BF16)


@dataclass
class Pass:
    """One C sweep: the sums ``batch`` (body indices) over the big inputs ``big`` (input
    indices), reading the per-kept registers ``kept``."""

    batch: tuple[int, ...]
    big: tuple[int, ...]
    kept: tuple[str, ...]
    fn: Any
    rshape: np.ndarray
    koff: np.ndarray
    rstr: np.ndarray
    stores: tuple = ()      # per sum: (register, dtype to round to or None, shape)
    cols: bool = False      # the channels_last kernel (items across contiguous kept indices)
    spec: tuple = ()        # render_pass's (big, kept, live, sums)

    def __post_init__(self) -> None:
        self.ptr_array = PointerArray(len(self.big) + len(self.kept))
        self.addresses = tuple(int(a.ctypes.data) for a in (self.rshape, self.koff, self.rstr))


@dataclass
class Plan:
    """A FusedReduce planned for its operands: ``steps`` are ("instr", name, fn, args) run in
    numpy on per-channel values, or ("pass", Pass)."""

    steps: list
    small: list[tuple[int, bool]]   # per-channel inputs (index, f16/bf16 to widen)
    types: dict
    K: int
    R: int
    kept_view: tuple[int, ...]      # kept registers broadcast to this shape, then flattened
    consts: dict                    # the fill instructions' values (read-only), made once
    tail: "Optional[Tail]" = None  # the instructions after the last pass, as one C call


@dataclass
class Tail:
    """The instructions after a plan's last pass (its epilogue) as one serial C call
    (:func:`.small.compile_body`): ``call`` reads the body's per-channel inputs and then every
    pass's sums, one float32 row of K each in pass order; ``at`` is the index of the first step
    it replaces."""

    call: SmallPlan
    at: int


@dataclass
class BlockedPair:
    """Two passes run a group of kept indices at a time in one C call
    (:func:`.pair_c.render_blocked`): pass ``a``, the per-index instructions between them,
    pass ``b`` over the same data while it is in cache. ``derived``: pass b's kept registers the call computes, ``(row, register)``."""

    a: Pass
    b: Pass
    fn: Any
    derived: tuple[tuple[int, str], ...]


_PLANS = IdentityMemo(limit=256)


def _closure(body: Sequence[Instr], reg: str, full: set[str], leaves: Container[str] = ()) -> list[int]:
    """Indices of the full-size instructions ``reg`` depends on, in body order (registers in
    ``leaves`` are read as they are, like inputs)."""
    need, stack = set(), [reg]
    while stack:
        r = stack.pop()
        if r.startswith("t") and r in full and r not in leaves and int(r[1:]) not in need:
            need.add(int(r[1:]))
            stack.extend(body[int(r[1:])].args)
    return sorted(need)


def _reads(body: Sequence[Instr], j: int, full: set[str], leaves: Container[str] = ()) -> set[str]:
    """The registers the C pass for sum ``j`` reads: its argument and its closure's operands."""
    return ({r for i in _closure(body, body[j].args[0], full, leaves) for r in body[i].args}
            | {body[j].args[0]})


def _input_views(body: Sequence[Instr], types: dict, full: set[str], inputs: Sequence[np.ndarray]
                 ) -> dict[str, tuple[int, np.ndarray]]:
    """Full-size registers that are an input under another shape: a ``view`` of the input, or of
    its exact widening to float32 (a C pass loads f16/bf16 as float anyway), that numpy makes
    without copying — e.g. counts [W] as [W, 1] over [W, C]. Register -> (input index, the
    input under the view's shape); a pass reads them as inputs at those strides."""
    views = {}
    for k, ins in enumerate(body):
        if ins.op != "view" or f"t{k}" not in full:
            continue
        src = ins.args[0]
        while src.startswith("t") and body[int(src[1:])].op in ("view", "cast"):
            step = body[int(src[1:])]
            if step.op == "cast" and (step.dtype != DataType.FLOAT or types[step.args[0]][0] not in FLOATS):
                break  # only an exact widening is what a load does
            src = step.args[0]
        if not src.startswith("in"):
            continue
        x = inputs[int(src[2:])].view()
        try:
            x.shape = tuple(ins.shape)  # raises where only a copy would do
        except (AttributeError, ValueError):
            continue
        views[f"t{k}"] = (int(src[2:]), x)
    return views


def collapse_reduced(shape: Sequence[int], strides: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 reduced dims and merge neighbours every operand walks contiguously (the
    row-major index, hence the summation order, is unchanged).

    >>> collapse_reduced((32, 56, 56), [[200704, 56, 1]])
    ([32, 3136], [[200704, 1]])
    """
    out_shape: list[int] = []
    out_st: list[list[int]] = [[] for _ in strides]
    for d, n in enumerate(shape):
        if n == 1:
            continue
        if out_shape and all(st[-1] == s[d] * n for st, s in zip(out_st, strides)):
            out_shape[-1] *= n
            for st, s in zip(out_st, strides):
                st[-1] = s[d]
            continue
        out_shape.append(n)
        for st, s in zip(out_st, strides):
            st.append(s[d])
    if not out_shape:
        return [1], [[0] for _ in strides]
    return out_shape, out_st


def _plan(a: FusedReduceAttrs, inputs: Sequence[np.ndarray]) -> Plan:
    in_types = [TensorType(x.shape, dtype_of(x.dtype)) for x in inputs]
    types = body_types(a.body, in_types)
    sums = [k for k, ins in enumerate(a.body) if ins.op == "sum" and ins.shape is not None]
    if not sums:
        raise Unsupported("no partial reduction")

    def summed(ins: Instr) -> tuple[int, ...]:
        return tuple(ins.over) if ins.over is not None else types[ins.args[0]][1]
    full_shape = summed(a.body[sums[0]])
    kept_shape = tuple(a.body[sums[0]].shape)
    if any(summed(a.body[k]) != full_shape or tuple(a.body[k].shape) != kept_shape for k in sums):
        raise Unsupported("reductions over different shapes")
    raxes = [d for d, (n, o) in enumerate(zip(full_shape, kept_shape)) if n != o]
    # registers that vary along a reduced dim (a lower-rank one right-aligned, as it broadcasts)
    full = {r for r, (_, s) in types.items() if len(s) <= len(full_shape)
            and any(((1,) * (len(full_shape) - len(s)) + tuple(s))[d] == full_shape[d] for d in raxes)}
    if any(r in full for r in a.results):
        raise Unsupported("a full-size result")
    K, R = math.prod(kept_shape), math.prod(full_shape[d] for d in raxes)
    if R == 0 or K == 0:
        raise Unsupported("an empty reduction")
    small = [(k, t.dtype in _NARROW) for k, t in enumerate(in_types) if f"in{k}" not in full]
    views = _input_views(a.body, types, full, inputs)
    ready = {f"in{k}" for k, _ in small}
    steps: list = []
    consts: dict = {}
    done: set[int] = set()
    for k, ins in enumerate(a.body):
        name = f"t{k}"
        if name in full and ins.op != "sum":
            continue  # computed inside a C pass
        if k in sums:
            if k not in done:  # this pass also takes every later sum whose inputs are ready
                batch = [j for j in sums if j not in done
                         and all(r in ready for r in _reads(a.body, j, full) if r not in full)]
                steps.append(("pass", _make_pass(a.body, batch, full, types, inputs, full_shape,
                                                 raxes, K, views)))
                done.update(batch)
                ready.update(f"t{j}" for j in batch)
            continue
        if any(r in full for r in ins.args):
            raise Unsupported(f"{ins.render(name)} reads per-element data")
        fn = compile_instr(ins, types)
        if ins.op == "fill":  # no operands: the same read-only value on every run
            consts[name] = fn()
        else:
            steps.append(("instr", name, fn, ins.args))
        ready.add(name)
    kept_view = tuple(1 if d in raxes else n for d, n in enumerate(full_shape))
    steps = _blocked(steps, a.body, types, consts, K)
    return Plan(steps, small, types, K, R, kept_view, consts, _tail(a, steps, in_types, inputs))


def _tail(a: FusedReduceAttrs, steps: list, in_types: list, inputs: Sequence[np.ndarray]
          ) -> "Optional[Tail]":
    """The results computed from the passes' sums by one C call, or None when the prologue
    renderer does not cover an instruction of the epilogue. The call runs the body with each
    sum instruction replaced by a cast (to the sum's dtype: the rounding :func:`_store` makes)
    of a new float32 input, the sum's row; everything the results depend on is then per-channel."""
    last = max(i for i, st in enumerate(steps) if st[0] != "instr")
    sums = [j for st in steps[:last + 1] if st[0] != "instr"
            for j in (st[1].batch if st[0] == "pass" else st[1].a.batch + st[1].b.batch)]
    body, types, shaped = list(a.body), list(in_types), list(inputs)
    for j in sums:
        shape = tuple(a.body[j].shape)
        body[j] = Instr(op="cast", args=(f"in{len(types)}",), dtype=a.body[j].dtype)
        types.append(TensorType(shape, DataType.FLOAT))
        shaped.append(np.empty(shape, np.float32))
    body_t = tuple(body)
    try:
        return Tail(compile_body(body_t, body_types(body_t, types), shaped, a.results), last + 1)
    except Unsupported:
        return None


def _blocked(steps: list, body: Sequence[Instr], types: dict, consts: dict, K: int) -> list:
    """``steps`` with its first two passes and the instructions between them as one
    ("blocked", :class:`BlockedPair`) step where that applies — both passes kept-index major
    with at least :data:`BLOCKED_MIN_K` kept indices (run index by index), or both channels_last
    (run whole, one after the other: :func:`.pair_c.render_cols_pair`), every instruction between
    them a float add/sub/mul/div/sqrt/cast/view of pass a's sums, one-element constants or each
    other, with one value per kept index or one for all — else ``steps`` unchanged. The
    instructions stay as numpy steps after it too: they give the registers later steps read."""
    at = [i for i, st in enumerate(steps) if st[0] == "pass"][:2]
    if len(at) < 2:
        return steps
    a, b = steps[at[0]][1], steps[at[1]][1]
    cols = a.cols and b.cols  # channels_last: both passes whole, one C call (render_cols_pair)
    if (K < BLOCKED_MIN_K and not cols) or a.cols != b.cols:
        return steps
    a_regs = [(name, types[name][0]) for name, _, _ in a.stores]
    between = [(name, f"opg_f(0x{int(v.reshape(()).view(np.uint32)):08X}u)", DataType.FLOAT)
               for name, v in consts.items() if v.size == 1 and v.dtype == np.float32]
    known = {name for name, _ in a_regs} | {name for name, _, _ in between}
    for _, name, _, args in steps[at[0] + 1:at[1]]:
        ins = body[int(name[1:])]
        dtype, shape = types[name]
        if (ins.op not in _PER_INDEX_OPS or dtype not in FLOATS or any(r not in known for r in args)
                or any(math.prod(types[r][1]) not in (1, K) for r in (name, *args))):
            return steps
        x = [f"r_{r}" for r in args]  # float values; the call rounds the result to dtype
        between.append((name, f"sqrtf({x[0]})" if ins.op == "sqrt" else x[0] if len(x) == 1
                        else f" {C_OP[ins.op]} ".join(x), dtype))
        known.add(name)
    derived = tuple((j, r) for j, r in enumerate(b.kept) if r in known)
    src = (render_cols_pair if cols else render_blocked)(a.spec, b.spec, a_regs, between, derived)
    fn = build.load(src).fn
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _BLOCKED_ARGTYPES, ctypes.c_int
    return [*steps[:at[0]], ("blocked", BlockedPair(a, b, fn, derived)), *steps[at[0] + 1:at[1]],
            *steps[at[1] + 1:]]


def _make_pass(body, batch, full, types, inputs, full_shape, raxes, K, views) -> Pass:
    live_idx = sorted({i for j in batch for i in _closure(body, body[j].args[0], full, views)})
    regs_used = set().union(*(_reads(body, j, full, views) for j in batch))
    source = {r: (int(r[2:]), inputs[int(r[2:])]) for r in regs_used if r.startswith("in")}
    source.update({r: views[r] for r in regs_used if r in views})
    big = sorted((r for r in source if r in full), key=lambda r: (source[r][0], r))
    kept = sorted((r for r in regs_used if r not in full), key=str)
    for i in live_idx:
        ins = body[i]
        if ins.op not in C_OP and ins.op != "cast" or ins.dtype not in FLOATS:
            raise Unsupported(f"{ins.render(f't{i}')} per element")
    if (any(dtype_of(source[r][1].dtype) not in FLOATS for r in big) or any(types[r][0] not in FLOATS for r in kept)
            or any(body[j].dtype not in FLOATS for j in batch)):
        raise Unsupported("operand dtype")
    kdims = [d for d in range(len(full_shape)) if d not in raxes]
    kshape = tuple(full_shape[d] for d in kdims)
    koff = np.zeros((max(len(big), 1), K), np.int64)
    rst = []
    for i, r in enumerate(big):
        xb = np.broadcast_to(source[r][1], full_shape)
        if any(s % xb.itemsize for s in xb.strides):
            raise Unsupported("strides not in whole elements")
        st = [s // xb.itemsize for s in xb.strides]
        grid = np.indices(kshape).reshape(len(kdims), -1) if kdims else np.zeros((0, 1), np.int64)
        koff[i] = sum(grid[j] * st[d] for j, d in enumerate(kdims)) if kdims else 0
        rst.append([st[d] for d in raxes])
    rshape, rstr = collapse_reduced([full_shape[d] for d in raxes], rst or [[0] * len(raxes)])
    # channels_last: kept indices contiguous in every big input, the reduced dims strided
    cols = bool(big) and any(st[-1] != 1 for st in rstr) and K > 1 and all(
        np.array_equal(row - row[0], np.arange(K)) for row in koff)
    spec = ([(r, dtype_of(source[r][1].dtype)) for r in big], kept, [(f"t{i}", body[i]) for i in live_idx],
            [body[j].args[0] for j in batch])
    src = render_pass(*spec, cols)
    fn = build.load(src).fn
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    stores = tuple((f"t{j}", types[f"t{j}"][0].np if types[f"t{j}"][0] in _NARROW else None,
                    types[f"t{j}"][1]) for j in batch)
    return Pass(tuple(batch), tuple(source[r][0] for r in big), tuple(kept), fn,
                 np.asarray(rshape, np.int64), koff, np.ascontiguousarray(rstr, np.int64).reshape(-1),
                 stores, cols, spec)


def plan_for(a: FusedReduceAttrs, inputs: Sequence[np.ndarray]) -> Plan:
    """The cached plan of ``a`` for operands of these dtypes, shapes and strides (a body the C
    passes do not cover raises :class:`Unsupported`, also remembered)."""
    return planned(_PLANS, a, tuple((x.dtype, x.shape, x.strides) for x in inputs),
                   lambda: _plan(a, inputs))


__all__ = ["BlockedPair", "Pass", "Plan", "Tail", "collapse_reduced", "plan_for"]
