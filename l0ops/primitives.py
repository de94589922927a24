"""Elementwise primitives and bodies: the instruction set l0 ops expand into, its type rules
and the numpy semantics of each instruction (:mod:`l0ops.interpreter` runs a whole body over an
iteration space).

Instructions have exact IEEE semantics in their dtype: ``add``, ``sub``, ``mul``, ``div``, ``max``,
``sqrt`` (one rounding to the instruction's dtype), ``fma(a, b, c) = a·b + c`` (evaluated in
float64, then rounded to the dtype: a·b is exact there, but the sum rounds twice, so on rare inputs
it is one ulp off a single-rounding fused multiply-add), ``cast`` (RNE into floats; float → int
truncates, NaN → 0), ``eq`` (a bool register), ``where(cond, a, b)`` and ``pow(x, e)`` (Pow's
special-cased exponents, :func:`pow_array`); ``view`` reshapes a hoisted register, ``sum`` reduces
a register to a scalar, or to ``shape`` (keepdims; reduced dims 1), in the order of
:mod:`l0ops.ordered`, ``fill`` is a constant. Registers ``in0``…``inK`` are the inputs; ``t0``…
temporaries.
FusedElementwise (``l0ops.fused``) runs a body as one kernel; ops defined by an expansion get
their numpy semantics from the same primitives (:mod:`l0ops.expansion`).

    >>> from opgraph.core.dtypes import DataType as D
    >>> import numpy as np
    >>> sub = Instr(op="sub", args=("in0", "in1"), dtype=D.FLOAT16)
    >>> types = body_types((sub,), [Sig(D.FLOAT16, (2, 2)), Sig(D.FLOAT16, (2, 1))])
    >>> types["t0"]
    (<DataType.FLOAT16: 1>, (2, 2))
    >>> compile_instr(sub, types)(np.float32([[1, 2], [3, 4]]), np.float32([[1], [1]])).tolist()
    [[0.0, 1.0], [2.0, 3.0]]
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from pydantic import field_validator

from opgraph.core.dtypes import DataType, Format
from opgraph.core.opdef import DType, L0Error, OpAttrs, require
from opgraph.core.tensor import MAX_RANK
from opgraph.core.types import TensorType, broadcast_shape
from .ordered import sum_plan
from .rounding import round_to_half, widen

T = TypeVar("T")
F32, F16, BF16, F64 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16, DataType.DOUBLE


def pow_array(base: np.ndarray, exp: np.ndarray, one_element: "bool | None" = None) -> np.ndarray:
    """x ** e in x's dtype as the 950 tensor-scalar Pow kernel special-cases a one-element
    exponent (pow_tensor_scalar_float.h): −0.5 is 1/sqrt(x) (Sqrt, then Div), 0.5 sqrt, 2 x·x,
    −1 1/x, 1 x, 0 ones; other exponents: numpy's power in float64, rounded once.
    ``one_element``: whether the exponent *tensor* has one element (default: ``exp``'s own
    size); a one-element chunk of a larger exponent takes the general path.

    >>> pow_array(np.float32([4, 16]), np.float32(-0.5)).tolist()
    [0.5, 0.25]
    >>> pow_array(np.float32([4]), np.float32([-0.5]), one_element=False).tolist()
    [0.5]
    """
    base, exp = np.asarray(base), np.asarray(exp)
    x = base.astype(np.float32)
    if one_element is None:
        one_element = exp.size == 1
    e = float(exp.reshape(-1)[0]) if one_element else None
    one = np.float32(1)
    special = {-0.5: lambda: one / np.sqrt(x), 0.5: lambda: np.sqrt(x), 2.0: lambda: x * x,
               -1.0: lambda: one / x, 1.0: lambda: x, 0.0: lambda: np.ones_like(x)}
    if e in special:
        y = special[e]()
    else:
        y = np.power(x.astype(np.float64), exp.astype(np.float64)).astype(np.float32)
    return np.asarray(y).astype(base.dtype)


def cast_array(x: np.ndarray, to: DataType) -> np.ndarray:
    """A Cast: round-to-nearest-even into floats; float→int truncates (ops-math Cast's
    CAST_ROUND_MODE_TRUNC, math/cast/op_kernel/arch35/cast_struct.h), saturates out of range and
    at ±inf (AscendC Cast: integer overflow saturates by default) and maps NaN to 0 (aclnnCast
    doc, 约束说明).

    >>> cast_array(np.float32([1.5, -2.7, np.nan, 3e9, -np.inf]), DataType.INT32).tolist()
    [1, -2, 0, 2147483647, -2147483648]
    """
    dst = to.np
    if x.dtype == dst:
        return x
    src_is_float = x.dtype.kind == "f" or x.dtype == DataType.BF16.np
    if src_is_float and dst.kind in "iu":
        info = np.iinfo(dst)
        whole = np.trunc(np.nan_to_num(x.astype(np.float64), nan=0.0))
        with np.errstate(invalid="ignore"):  # out-of-range lanes are replaced below
            fits = whole.astype(dst)
        # compare in float64: float(info.max) may round up (int64: 2**63), so ">=" saturates
        return np.where(whole >= float(info.max), info.max,
                        np.where(whole <= float(info.min), info.min, fits)).astype(dst)
    return x.astype(dst)


def as_f32(value: float) -> float:
    """``value`` rounded to float32 (RNE), as a Python float: beyond float32's range ±inf,
    without numpy's overflow warning (an expansion turns attributes into constants in phase 1).

    >>> as_f32(0.1), as_f32(1e39), as_f32(-1e39)
    (0.10000000149011612, inf, -inf)
    """
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def fill_value_ok(value: float, dtype: DataType) -> bool:
    """Whether ``value`` converts to ``dtype`` (aclnnInplaceFillScalar: "value must be
    convertible to selfRef's dtype"): any value into floats and BOOL; into an integer dtype a
    finite value whose integer part the dtype holds (the fraction is truncated).

    >>> fill_value_ok(300.0, DataType.INT8), fill_value_ok(-128.5, DataType.INT8), fill_value_ok(1e9, DataType.FLOAT16)
    (False, True, True)
    """
    if dtype.np.kind not in "iu":
        return True
    info = np.iinfo(dtype.np)
    return math.isfinite(value) and info.min <= math.trunc(value) <= info.max


ARITH = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
         "max": np.maximum}
PRIMS = tuple(ARITH) + ("cast", "view", "sum", "fill", "sqrt", "fma", "eq", "where", "pow")


class Instr(OpAttrs):
    """``<dst>: dtype = op(args)``; dst is ``t<index in body>``.

    ``view`` reshapes a per-channel (hoisted) register to ``shape``; ``sum`` reduces a register
    over all its elements to a scalar, or — with ``shape`` (keepdims) and ``over`` (the shape it
    sums, which the register broadcasts to) — over the dims where ``shape`` is 1; ``fill`` is the
    constant ``value`` of ``shape`` (default a scalar), always hoisted and never materialised.
    """

    op: str
    args: tuple[str, ...] = ()
    dtype: DType
    shape: "tuple[int, ...] | None" = None
    value: "float | None" = None
    over: "tuple[int, ...] | None" = None

    @field_validator("shape", "over")
    @classmethod
    def _dims(cls, v: "tuple[int, ...] | None") -> "tuple[int, ...] | None":
        if v is not None and (len(v) > MAX_RANK or any(not 0 <= n < 2 ** 63 for n in v)):
            raise ValueError(f"{list(v)}: at most {MAX_RANK} dims, each in [0, 2**63)")
        return v

    def render(self, dst: str) -> str:
        """The instruction's dump line with destination register ``dst``.

            >>> i = Instr(op="sum", args=("t0",), dtype=DataType.FLOAT, shape=(1, 3), over=(2, 3))
            >>> i.render("t1")
            't1: f32[1,3] = sum(t0) over [2,3]'
        """
        shape = "" if self.shape is None else "[" + ",".join(map(str, self.shape)) + "]"
        args = ", ".join(self.args) if self.op != "fill" else repr(self.value)
        over = "" if self.over is None else " over [" + ",".join(map(str, self.over)) + "]"
        return f"{dst}: {self.dtype.short}{shape} = {self.op}({args}){over}"


class FusedAttrs(OpAttrs):
    """FusedElementwise's attributes: ``shape``, the iteration space (the output's shape);
    ``body``, the instructions (operands are registers ``in<k>``); ``result``, the register
    written out, of dtype ``out_dtype``; ``store``, the last operand is the user tensor the
    result is stored into; ``out_format``, the output's format tag."""

    shape: tuple[int, ...]
    body: tuple[Instr, ...]
    result: str
    out_dtype: DType
    store: bool = False  # the last input is a user tensor the kernel writes (like ViewCopy)
    out_format: Format = Format.ND  # the format tag of the value the kernel replaces


def body_lines(a: FusedAttrs) -> list[str]:
    """The body as the dump prints it: one line per instruction, then ``return`` (or ``store``)
    and the result."""
    lines = [i.render(f"t{k}") for k, i in enumerate(a.body)]
    lines.append(("store " if a.store else "return ") + a.result)
    return lines


class Sig:
    """The (dtype, shape) of an operand: the part of a TensorType a fused body needs."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: DataType, shape: tuple[int, ...]):
        self.dtype, self.shape = dtype, tuple(shape)


class IdentityMemo:
    """Values made per (object, key): bounded (emptied when full) and safe under threads. An
    entry holds its object, so the object's id cannot be reused while the entry lives. The
    caches of compiled bodies, programs and plans, all keyed by an attrs object and operand types.

        >>> memo, body = IdentityMemo(limit=8), ("x",)
        >>> memo.get(body, (1,), lambda: [0]) is memo.get(body, (1,), lambda: [1])
        True
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._items: dict = {}
        self._lock = threading.Lock()

    def get(self, obj: object, key: tuple, make: Callable[[], T]) -> T:
        """The value for (``obj``, ``key``), made by ``make()`` the first time."""
        hit = self.peek(obj, key)
        if hit is not None:
            return hit
        value = make()
        self.put(obj, key, value)
        return value

    def peek(self, obj: object, key: tuple) -> "Any | None":
        """The value for (``obj``, ``key``) if there is one, else None."""
        hit = self._items.get((id(obj), key))
        return hit[1] if hit is not None and hit[0] is obj else None

    def put(self, obj: object, key: tuple, value: Any) -> None:
        """Remember ``value`` for (``obj``, ``key``)."""
        with self._lock:
            if len(self._items) >= self.limit:
                self._items.clear()
            self._items[(id(obj), key)] = (obj, value)


_TYPES = IdentityMemo(limit=4096)


RegTypes = dict[str, tuple[DataType, tuple[int, ...]]]


def body_types(body: Sequence[Instr], in_types: Sequence[TensorType]) -> RegTypes:
    """dtype and (numpy-broadcast) shape of every register of ``body``; L0Error on a malformed
    body. Memoised per (body tuple, input types)."""
    return _TYPES.get(body, tuple((t.dtype, t.shape) for t in in_types),
                      lambda: _check_body(body, in_types))


def reg_types(a: FusedAttrs, in_types: Sequence[TensorType]) -> RegTypes:
    """:func:`body_types` of a fused body, checking its result against the iteration space."""
    regs = body_types(a.body, in_types)
    require(a.result in regs, "FusedElementwise", f"result register {a.result} is undefined")
    try:
        ok = broadcast_shape(regs[a.result][1], tuple(a.shape)) == tuple(a.shape)
    except ValueError:
        ok = False
    require(ok, "FusedElementwise", f"result shape {list(regs[a.result][1])} does not broadcast "
            f"to {list(a.shape)}")
    return regs


def instr_shape(ins: Instr, operands: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of ``ins``'s register from its operands' shapes: ``fill``, ``view`` and ``sum``
    have their own (a scalar when none is given), the rest broadcast their operands' (ValueError
    when they do not). :func:`body_types` checks the rest.

        >>> instr_shape(Instr(op="add", args=("in0", "in1"), dtype=F32), [(2, 1), (3,)])
        (2, 3)
    """
    if ins.op in ("fill", "view", "sum"):
        return tuple(ins.shape or ())
    return broadcast_shape(*operands)


def _check_body(body: Sequence[Instr], in_types: Sequence[TensorType]) -> RegTypes:
    regs = {f"in{k}": (t.dtype, t.shape) for k, t in enumerate(in_types)}

    def fail(k: int, ins: Instr, msg: str):
        raise L0Error(f"FusedElementwise: t{k} ({ins.render(f't{k}')}): {msg}")

    for k, ins in enumerate(body):  # fields read once: pydantic attribute access is not free
        op, args, dtype = ins.op, ins.args, ins.dtype
        if op not in PRIMS:
            fail(k, ins, f"unknown primitive {op!r}")
        for r in args:
            if r not in regs:
                fail(k, ins, f"register {r} used before definition")
        arity = _ARITY.get(op, 2)
        if len(args) != arity:
            fail(k, ins, f"{op} takes {arity} operands")
        if op == "fill":
            if ins.value is None:
                fail(k, ins, "fill needs a value")
            if not fill_value_ok(ins.value, dtype):
                fail(k, ins, f"{ins.value!r} does not convert to {dtype.short}")
            regs[f"t{k}"] = (dtype, tuple(ins.shape or ()))
            continue
        src_dtype, src_shape = regs[args[0]]
        if op == "eq":
            if dtype != DataType.BOOL or regs[args[1]][0] != src_dtype:
                fail(k, ins, "eq compares two operands of one dtype into a bool register")
        elif op == "where":
            if src_dtype != DataType.BOOL or any(regs[r][0] != dtype for r in args[1:]):
                fail(k, ins, "where takes a bool condition and two operands of its dtype")
        elif op in ("view", "sum") and src_dtype != dtype:
            fail(k, ins, f"{op} keeps the dtype")
        if op == "view":
            shape = ins.shape
            if shape is None or math.prod(shape) != math.prod(src_shape):
                fail(k, ins, f"view must keep the element count of {list(src_shape)}")
            regs[f"t{k}"] = (dtype, tuple(shape))
            continue
        if op == "sum":
            out = tuple(ins.shape) if ins.shape is not None else ()
            over = tuple(ins.over) if ins.over is not None else src_shape
            try:
                ok = broadcast_shape(src_shape, over) == over
            except ValueError:
                ok = False
            if not ok or (ins.shape is not None and (len(out) != len(over) or any(
                    o not in (1, n) for o, n in zip(out, over)))):  # (shape (): a rank-0 sum only)
                fail(k, ins, f"sum of {list(src_shape)} over {list(over)} to {list(out)}: the register "
                             "must broadcast to the summed shape, whose rank the result keeps")
            regs[f"t{k}"] = (dtype, out)
            continue
        operands = [regs[r] for r in args]
        if op not in ("cast", "eq", "where") and any(d != dtype for d, _ in operands):
            fail(k, ins, f"operand dtypes differ from {dtype.short}")
        if op == "sub" and dtype == DataType.BOOL:
            fail(k, ins, "bool registers do not subtract")
        try:
            regs[f"t{k}"] = (dtype, instr_shape(ins, [shape for _, shape in operands]))
        except ValueError:
            fail(k, ins, "operand shapes do not broadcast")
    return regs


_ARITY = {"fill": 0, "cast": 1, "view": 1, "sum": 1, "sqrt": 1, "fma": 3, "where": 3, "pow": 2}


# --- numpy execution -------------------------------------------------------------------------


def _rounded(z: Any, d: DataType) -> Any:
    """A fresh float32 result ``z`` rounded to ``d`` (f16 or bf16), held as float32: float16 in
    place (:func:`.rounding.round_to_half`, same bits as numpy's round trip, a fifth the time)."""
    if d == F16 and type(z) is np.ndarray and z.dtype == np.float32 and z.ndim:
        return round_to_half(z)
    return z.astype(d.np).astype(np.float32)


def _load(x: np.ndarray, d: DataType) -> np.ndarray:
    """Register representation: f16/bf16/f32 values held as float32 (:func:`.rounding.widen`,
    as the interpreter loads its inputs); others natively."""
    if d in (F16, BF16):
        return widen(x)
    return x


def _method(fn: Callable, name: str, arg: Any) -> Callable:
    """``fn`` (which computes ``x.name(arg)``), marked so that a generated straight line
    (:mod:`.straight_line`) makes the method call itself rather than call ``fn``."""
    fn.method = (name, arg)  # type: ignore[attr-defined]
    return fn


def compile_instr(ins: Instr, types: dict) -> Callable[..., np.ndarray]:
    """A callable computing ``ins`` on register arrays (the numpy semantics of the primitive)."""
    d = ins.dtype
    rounding = d in (F16, BF16)
    if ins.op == "fill":  # a read-only broadcast view: no memory, whatever the shape
        const = np.broadcast_to(_load(np.asarray(ins.value, dtype=d.np), d), tuple(ins.shape or ()))
        return lambda: const
    if ins.op == "view":
        shape = tuple(ins.shape)
        return _method(lambda x: x.reshape(shape), "reshape", shape)
    if ins.op == "sum":  # the ordered reduction of ReduceSum: all axes, or to ``shape`` (keepdims)
        src = tuple(ins.over) if ins.over is not None else types[ins.args[0]][1]
        axes = (tuple(range(len(src))) if ins.shape is None
                else tuple(i for i, (n, o) in enumerate(zip(src, ins.shape)) if n != o))
        plan = sum_plan(src, axes, ins.shape is not None, np.dtype(np.float32 if rounding else d.np))
        if not rounding:  # registers of d hold d
            return lambda x: plan(x if x.shape == src else np.broadcast_to(x, src))

        def total(x):
            return _load(plan(np.broadcast_to(x.astype(d.np), src)).astype(d.np), d)
        return total
    if ins.op == "pow":
        scalar = math.prod(types[ins.args[1]][1]) == 1  # the register's size, not a chunk's
        return lambda x, e: _load(pow_array(x.astype(d.np) if rounding else x, e, scalar), d)
    if ins.op == "eq":
        return lambda x, y: np.equal(x, y)
    if ins.op == "where":
        return lambda c, x, y: np.where(c, x, y)
    if ins.op == "fma":
        return lambda a, b, c: _load((a.astype(np.float64) * b + c).astype(d.np), d)
    if ins.op == "sqrt":
        if rounding:
            return lambda x: _rounded(np.sqrt(x), d)
        return np.sqrt
    if ins.op == "cast":
        src = types[ins.args[0]][0]
        if d in (F16, BF16, F32) and src in (F16, BF16, F32):
            if not rounding:
                return lambda x: x.astype(np.float32, copy=False)
            if d == F16:  # rounded in place on a copy (x may be an input)
                return lambda x: _rounded(x.astype(np.float32), d)
            return lambda x: x.astype(d.np).astype(np.float32)
        if d == F32 and src.np.kind in "iub":  # an integer counter: what cast_array does, directly
            return _method(lambda x: x.astype(np.float32), "astype", np.float32)
        return lambda x: _load(cast_array(x.astype(src.np) if src in (F16, BF16) else x, d), d)
    ufunc = ARITH[ins.op]
    if d == F16:  # like a float32 ufunc, writes ``out`` when given (rounded there in place)
        return lambda x, y, out=None: _rounded(ufunc(x, y, out=out), d)
    if rounding:
        return lambda x, y: _rounded(ufunc(x, y), d)
    return ufunc
