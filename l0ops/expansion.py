"""Ops defined by their expansion: collecting the primitive body of one call, evaluating a body
on whole arrays (reductions included), and the numpy semantics derived from it — so an op's
steps are written once, in its ``expand``.

An expansion returns one register per output (a tuple for multi-output ops). A body without a
reduction of full-size data runs chunk by chunk (:func:`l0ops.interpreter.run_fused`); one with
such a reduction is evaluated on whole arrays, in order (:func:`evaluate_body`).

    >>> import numpy as np
    >>> from opgraph.core.dtypes import DataType
    >>> body, res = expand_body(lambda emit, a, at, ts: emit("mul", [a[0], a[0]], ts[0].dtype), None,
    ...                         [TensorType((2,), DataType.FLOAT)])
    >>> [i.render(f"t{k}") for k, i in enumerate(body)], res
    (['t0: f32 = mul(in0, in0)'], ('t0',))
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from opgraph.core.dtypes import DataType, dtype_of
from opgraph.core.memo import BoundedMemo
from opgraph.core.opdef import ExpandFn, OpAttrs
from opgraph.core.types import TensorType
from .channel_blocks import MIN_ELEMS, ChannelSplit, block_body, channel_ranges, channel_split
from .interpreter import run_fused
from .primitives import FusedAttrs, IdentityMemo, Instr, body_types, cast_array, compile_instr
from .rounding import widen
from .workers import run_split, threads

Body = tuple[Instr, ...]


class BodyBuilder:
    """Collects instructions from an op's ``expand(emit, args, attrs, in_types)``.

    >>> b = BodyBuilder()
    >>> r = b.emit("mul", ["in0", "in0"], DataType.FLOAT)
    >>> r, b.body[0].render(r)
    ('t0', 't0: f32 = mul(in0, in0)')
    """

    def __init__(self) -> None:
        self.body: list[Instr] = []

    def emit(self, op: str, args: Sequence[str], dtype: DataType,
             shape: "tuple[int, ...] | None" = None, value: "float | None" = None,
             over: "tuple[int, ...] | None" = None) -> str:
        """Append one instruction (``op`` on registers ``args``, result ``dtype``; ``shape``,
        ``value``, ``over`` as :class:`Instr` reads them) and return its register, ``t<index>``."""
        self.body.append(Instr(op=op, args=tuple(args), dtype=dtype, shape=shape, value=value,
                               over=over))
        return f"t{len(self.body) - 1}"


_BODIES: dict = {}
_INTERNED: dict = {}  # body -> the one object of that value


def expand_body(expand: ExpandFn, attrs: Any, in_types: Sequence[TensorType]) -> tuple[Body, tuple[str, ...]]:
    """The body of one call and its result registers, one per output (memoised). Equal bodies
    are one object (interned): an op whose body does not depend on the sizes gives the same body
    at every size, so what is cached per body object — the interpreter's program, renamed to new
    sizes — serves them all."""
    key = (expand, attrs, tuple((t.dtype, t.shape) for t in in_types))
    hit = _BODIES.get(key)
    if hit is None:
        b = BodyBuilder()
        res = expand(b.emit, [f"in{k}" for k in range(len(in_types))], attrs, list(in_types))
        body = tuple(b.body)
        if len(_BODIES) > 4096:
            _BODIES.clear()
            _INTERNED.clear()
        hit = (_INTERNED.setdefault(body, body), tuple(res) if isinstance(res, tuple) else (res,))
        _BODIES[key] = hit
    return hit


def reduces_live_data(body: Body, in_types: Sequence[TensorType]) -> bool:
    """True when a ``sum`` reduces to a shape (a partial reduction: needs whole arrays)."""
    return any(ins.op == "sum" and ins.shape is not None for ins in body)


_ARRAY_TYPES = BoundedMemo(limit=4096)  # (numpy dtype, shape) -> TensorType


def array_types(arrays: Sequence[np.ndarray]) -> list[TensorType]:
    """The TensorType of each array (shape and dtype), made once per (dtype, shape).

    >>> [str(t) for t in array_types([np.zeros((2, 3), np.float16)])]
    ['f16[2,3]']
    """
    out = []
    for a in arrays:
        key = (a.dtype, a.shape)
        t = _ARRAY_TYPES.get(key)
        out.append(t if t is not None else _ARRAY_TYPES.put(key, TensorType(a.shape, dtype_of(a.dtype))))
    return out


def evaluate_body(body: Body, results: Sequence[str], inputs: Sequence[np.ndarray],
                  in_types: Sequence[TensorType], channel_blocks: bool = True) -> list[np.ndarray]:
    """Run ``body`` on whole arrays in order; returns the result registers as arrays of their
    dtype (numpy broadcasting between registers; reductions in the documented order). A large
    body that separates along its channel runs on blocks of channels instead, on the worker
    threads (:mod:`.channel_blocks`; the same bits); ``channel_blocks=False``: always whole."""
    arrays = [np.asarray(x) for x in inputs]
    big = channel_blocks and sum(x.size for x in arrays) >= MIN_ELEMS  # (a small call: no lookup)
    split = channel_split(body, in_types, results) if big else None
    if split is None or split.summed < MIN_ELEMS:
        return _values(body, results, arrays, in_types)
    return _by_channels(body, results, arrays, in_types, split)


def _values(body: Body, results: Sequence[str], inputs: Sequence[np.ndarray],
            in_types: Sequence[TensorType]) -> list[np.ndarray]:
    """:func:`evaluate_body` on whole arrays."""
    steps, types = _compiled(body, in_types)
    regs: dict[str, np.ndarray] = {}
    for k, x in enumerate(inputs):
        d = in_types[k].dtype
        regs[f"in{k}"] = widen(x) if d in (DataType.FLOAT16, DataType.BF16) else x
    for name, fn, args in steps:
        regs[name] = fn(*[regs[r] for r in args])
    out = []
    for r in results:  # new arrays: a register may view an input
        d, shape = types[r]
        v = regs[r]
        if v.dtype != d.np:
            v = cast_array(v.astype(d.np), d)
        out.append(np.array(v) if v.shape == shape else np.array(np.broadcast_to(v, shape)))
    return out


def _by_channels(body: Body, results: Sequence[str], inputs: Sequence[np.ndarray],
                 in_types: Sequence[TensorType], split: ChannelSplit) -> list[np.ndarray]:
    """:func:`evaluate_body` block of channels by block, the blocks on the worker threads; a
    result that does not depend on the channel is the first block's."""
    types = body_types(body, in_types)
    outs = [np.empty(types[r][1], types[r][0].np) for r in results]
    C = split.channels

    def blocks(part: Sequence[tuple[int, int]]) -> None:
        for c0, c1 in part:
            xs = [x if a is None else x[_channels(a, c0, c1)] for x, a in zip(inputs, split.in_axes)]
            values = _values(block_body(body, split, c1 - c0), results, xs, array_types(xs))
            for out, v, a in zip(outs, values, split.result_axes):
                if a is not None:
                    out[_channels(a, c0, c1)] = v
                elif c0 == 0:
                    out[...] = v
    run_split(blocks, channel_ranges(C, split.summed // C, threads()))
    return outs


def _channels(axis: int, c0: int, c1: int) -> tuple[slice, ...]:
    """The index of channels ``[c0, c1)`` along ``axis``."""
    return (slice(None),) * axis + (slice(c0, c1),)


_COMPILED = IdentityMemo(limit=4096)


def _compiled(body: Body, in_types: Sequence[TensorType]) -> tuple[list[tuple[str, Callable, tuple[str, ...]]], dict]:
    """``body`` as (register, numpy callable, operands), and every register's type, made once
    per body and input types (a cached call evaluates; it neither types nor compiles again)."""
    def make() -> tuple[list, dict]:
        types = body_types(body, in_types)
        return [(f"t{k}", compile_instr(ins, types), ins.args) for k, ins in enumerate(body)], types
    return _COMPILED.get(body, tuple((t.dtype, t.shape) for t in in_types), make)


def expansion_compute(expand: ExpandFn) -> Callable[[list, OpAttrs], list]:
    """numpy semantics of an op defined by its expansion: interpret the expanded body. The
    outputs have the types of the result registers (the graph was type-checked when built)."""
    def compute(xs: list, attrs: OpAttrs) -> list:
        arrays = [np.asarray(x) for x in xs]
        in_types = array_types(arrays)
        body, results = expand_body(expand, attrs, in_types)
        if len(results) == 1 and not reduces_live_data(body, in_types):
            res = results[0]
            if res.startswith("in"):  # an identity: a copy of the operand
                return [arrays[int(res[2:])].copy()]
            fa = _FUSED.get(body, tuple((t.dtype, t.shape) for t in in_types),
                            lambda: _fused_attrs(body, res, in_types))
            return [run_fused(fa, arrays)]
        return evaluate_body(body, results, arrays, in_types)
    return compute


# the FusedAttrs of one op call, kept per memoised body and input types: the interpreter caches
# its program per attrs object (a new one per call would type-check and compile every time)
_FUSED = IdentityMemo(limit=4096)


def _fused_attrs(body: Body, res: str, in_types: Sequence[TensorType]) -> FusedAttrs:
    """The attrs over ``body`` itself: validating would copy the (already validated) tuple, and
    the interpreter renames a program made for a body object to the sizes of another call."""
    d, shape = body_types(body, in_types)[res]
    return FusedAttrs.model_construct(shape=tuple(shape), body=body, result=res, out_dtype=d)
