"""Broadcasting elementwise arithmetic (ops-math Mul, Div, Sub, Add, Pow) and OnesLike. Each is
defined by its expansion into primitives, so it fuses at level 2 and its numpy semantics are one
IEEE operation rounded to the result dtype (f16/bf16 computed in float32 and rounded: the same
bits as native half arithmetic).

    >>> import numpy as np
    >>> Mul.compute([np.float16([1.5, 2]), np.float32([2])], Mul.make_attrs())[0].dtype
    dtype('float32')
    >>> Pow.compute([np.float32([4, 16]), np.float32(-0.5)], Pow.make_attrs())[0].tolist()
    [0.5, 0.25]
"""
from __future__ import annotations

from opgraph.core.dtypes import DataType
from opgraph.core.opdef import Fidelity, L0Error, require
from opgraph.core.types import broadcast_shape
from .define import define_op

F32, F16, BF16 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16
EXACT = (Fidelity("bit-faithful", "IEEE 754: one rounding to the result dtype"),)


def _shape(op: str, ts) -> tuple[int, ...]:
    try:
        return broadcast_shape(*(tuple(t.shape) for t in ts))
    except ValueError:
        raise L0Error(f"{op}: shapes {[list(t.shape) for t in ts]} do not broadcast") from None


def _promoting_infer(op: str):
    """Mul / Add: out dtype is a's, except that F16/BF16 mixed with F32 computes in F32."""
    def infer(ts, a):
        x, y = ts
        d = x.dtype
        if x.dtype != y.dtype:
            require({x.dtype, y.dtype} <= {F32, F16, BF16} and F32 in (x.dtype, y.dtype), op,
                    f"operand dtypes {x.dtype.short} and {y.dtype.short} do not mix")
            d = F32
        return [x.with_(shape=_shape(op, ts), dtype=d)]
    return infer


def _strict_infer(op: str):
    """Sub / Div: both operands of one dtype, which the result keeps (Sub: not BOOL, which
    numpy and torch do not subtract either)."""
    def infer(ts, a):
        x, y = ts
        require(x.dtype == y.dtype, op, f"operand dtypes differ ({x.dtype.short} vs {y.dtype.short})")
        require(not (op == "Sub" and x.dtype == DataType.BOOL), op, "bool operands do not subtract")
        return [x.with_(shape=_shape(op, ts))]
    return infer


def _binary(prim: str):
    def expand(emit, args, a, ts):
        d = ts[0].dtype if ts[0].dtype == ts[1].dtype else F32
        regs = [r if t.dtype == d else emit("cast", [r], d) for r, t in zip(args, ts)]
        return emit(prim, regs, d)
    return expand


Mul = define_op("Mul", num_inputs=2, infer=_promoting_infer("Mul"), expand=_binary("mul"),
                fidelity=EXACT, doc="a·b with numpy broadcasting")
Add = define_op("Add", num_inputs=2, infer=_promoting_infer("Add"), expand=_binary("add"),
                fidelity=EXACT, doc="a + b with numpy broadcasting")
Sub = define_op("Sub", num_inputs=2, infer=_strict_infer("Sub"), expand=_binary("sub"),
                fidelity=EXACT, doc="a − b with numpy broadcasting")
Div = define_op("Div", num_inputs=2, infer=_strict_infer("Div"), expand=_binary("div"),
                fidelity=EXACT, doc="a / b with numpy broadcasting")


def _pow(emit, args, a, ts) -> str:
    """The ``pow`` primitive: the 950 kernel's special-cased exponents (−0.5 = Sqrt then Div)."""
    d = ts[0].dtype
    exp = args[1] if ts[1].dtype == d else emit("cast", [args[1]], d)
    return emit("pow", [args[0], exp], d)


def _pow_infer(ts, a):
    require(ts[1].dtype == ts[0].dtype or ts[1].numel == 1, "Pow",
            f"exponent dtype {ts[1].dtype.short} differs from base's {ts[0].dtype.short}")
    return [ts[0].with_(shape=_shape("Pow", ts))]


Pow = define_op(
    "Pow", num_inputs=2, infer=_pow_infer, expand=_pow,
    fidelity=(Fidelity("bit-faithful", "950 tensor-scalar Pow kernel source for the exponents "
                       "it special-cases (−0.5 = Sqrt then Div); others: numpy power rounded once",
                       (3510,)),
              Fidelity("formula", "910B Pow is prebuilt: the same special cases assumed", (2201, 1001))),
    doc="base ** exponent (exponent: a one-element tensor or one broadcast like base)")

OnesLike = define_op(
    "OnesLike", num_inputs=1, kind="elementwise", infer=lambda ts, a: [ts[0].with_()],
    expand=lambda emit, args, a, ts: emit("fill", [], ts[0].dtype, shape=ts[0].shape, value=1.0),
    fidelity=(Fidelity("no arithmetic", "fills ones"),), doc="Ones of x's shape and dtype")
