"""A test helper: FusedReduce bodies for the native reduction tests and the check that the
native backend gives the numpy reference's bits for one.

    >>> a = stats_body((2, 3, 4))
    >>> a.results, a.out_shapes
    (('t3', 't7'), ((3,), (3,)))
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from backends.native.reduce import plan_for
from backends.native.reduce_run import run_fused_reduce_native
from l0ops.fused_reduce import FusedReduce, FusedReduceAttrs, Instr
from opgraph.core.dtypes import DataType as D

F32, F16, BF16 = D.FLOAT, D.FLOAT16, D.BF16
DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def bits(a: np.ndarray) -> np.ndarray:
    """``a``'s raw bits, as unsigned integers of its item size (for ``np.array_equal``)."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def keep(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a per-channel result kept at ``shape``'s rank: dim 1, every other dim 1."""
    return tuple(n if d == 1 else 1 for d, n in enumerate(shape))


def backward_body(shape, dt):
    """Σ f32(dy)·f32(x) and Σ f32(dy) in one pass, then a per-channel epilogue."""
    k, o = keep(shape), tuple(shape)
    body = (Instr(op="cast", args=("in0",), dtype=F32), Instr(op="cast", args=("in1",), dtype=F32),
            Instr(op="mul", args=("t0", "t1"), dtype=F32),
            Instr(op="sum", args=("t2",), dtype=F32, shape=k, over=o),
            Instr(op="sum", args=("t0",), dtype=F32, shape=k, over=o),
            Instr(op="mul", args=("in2", "t4"), dtype=F32),
            Instr(op="sub", args=("t3", "t5"), dtype=F32))
    C = shape[1]
    return FusedReduceAttrs(body=body, results=("t3", "t4", "t6"), out_shapes=((C,),) * 3)


def stats_body(shape, half: "D | None" = None):
    """Two passes: the mean, then Σ((x − mean)²·(1/N)); ``half`` rounds the difference to it."""
    k, o = keep(shape), tuple(shape)
    n = 1.0 / (np.prod(shape) // shape[1])
    body = [Instr(op="cast", args=("in0",), dtype=F32),
            Instr(op="sum", args=("t0",), dtype=F32, shape=k, over=o),
            Instr(op="fill", dtype=F32, value=float(np.float32(n))),
            Instr(op="mul", args=("t1", "t2"), dtype=F32),
            Instr(op="sub", args=("t0", "t3"), dtype=F32)]
    if half is not None:
        body += [Instr(op="cast", args=("t4",), dtype=half), Instr(op="cast", args=(f"t{len(body)}",), dtype=F32)]
    d = f"t{len(body) - 1}"
    body += [Instr(op="mul", args=(d, d), dtype=F32)]
    body += [Instr(op="mul", args=(f"t{len(body) - 1}", "t2"), dtype=F32)]
    body += [Instr(op="sum", args=(f"t{len(body) - 1}",), dtype=F32, shape=k, over=o)]
    C = shape[1]
    return FusedReduceAttrs(body=tuple(body), results=("t3", f"t{len(body) - 1}"), out_shapes=((C,),) * 2)


def check_same(a, inputs):
    got = run_fused_reduce_native(a, inputs)
    ref = FusedReduce.compute(inputs, a)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert np.array_equal(bits(g), bits(r))
    return got


def steps_of(a: FusedReduceAttrs, inputs: list) -> list[str]:
    """The kinds of the plan's steps for ``a`` on ``inputs`` (its passes), instructions left out."""
    return [st[0] for st in plan_for(a, inputs).steps if st[0] != "instr"]



def passes_of(a: FusedReduceAttrs, inputs: list) -> list:
    """The plan's passes for ``a`` on ``inputs``, a blocked pair's two included."""
    steps = plan_for(a, inputs).steps
    return [p for st in steps if st[0] in ("pass", "blocked")
            for p in ((st[1],) if st[0] == "pass" else (st[1].a, st[1].b))]


__all__ = ["BF16", "DTYPES", "F16", "F32", "backward_body", "bits", "check_same", "keep", "passes_of", "stats_body", "steps_of"]
