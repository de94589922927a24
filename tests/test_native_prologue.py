"""The native backend's C prologue (the hoisted per-channel part of a fused body): bit-identical
to the numpy interpreter (:func:`l0ops.interpreter.run_fused`) for casts, rounding arithmetic, sqrt,
max/fma/eq/where, fill, view and ordered sums (several blocks, keepdims, NaN/Inf/-0.0), int32/int64 counters,
strided per-channel inputs and per-channel data larger than the on-stack scratch; bodies it does
not cover fall back to numpy hoisting with the same bits; a new size reuses the compiled code."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import backends as B
import opgraph

from backends import native
from backends.native import build, launch
from l0ops.interpreter import run_fused
from l0ops.primitives import FusedAttrs, Instr
from opgraph.aclnn import aclnnBatchNormElemt, aclnnBatchNormElemtGetWorkspaceSize
from opgraph.core.dtypes import DataType as D

import reference as R

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])

NP = {D.FLOAT: np.float32, D.FLOAT16: np.float16, D.BF16: ml_dtypes.bfloat16}


def I(op, *args, dtype=D.FLOAT, **kw):  # noqa: E743 - short name for body listings
    return Instr(op=op, args=args, dtype=dtype, **kw)


def check(a: FusedAttrs, inputs, fused: bool = True):
    """run_fused_native == run_fused bit for bit; the launch used the C prologue iff ``fused``."""
    expected = run_fused(a, inputs)
    got = native.run_fused_native(a, inputs)
    R.assert_bits_equal(got, expected)
    launches = [ln for ln in launch._LAUNCHES.values() if isinstance(ln, launch.Launch) and ln.attrs is a]
    assert launches and all(ln.fused == fused for ln in launches)
    return got


def bn_body(dt: D, counter=D.INT32):
    """The BatchNormElemtBackward shape of body: counter sum, divisions, views, rounding."""
    return (I("cast", "in0"), I("sum", "t0"), I("cast", "in1"), I("div", "t2", "t1"),
            I("view", "t3", shape=(1, 4, 1)), I("cast", "t4", dtype=dt),
            I("view", "in2", dtype=dt, shape=(1, 4, 1)), I("mul", "t6", "t6", dtype=dt),
            I("mul", "t7", "t5", dtype=dt), I("sub", "in3", "t8", dtype=dt))


# counts that round when cast to float32 (ties to even at 2^24), and an int64 one past 2^32
COUNTS = {"small": [7, 9, 11], "rounding": [2**24 + 1, 2**24 + 3, 2**31 - 1],
          "wide": [2**40 + 2**16 + 1, 3, 2**33 + 1]}


@pytest.mark.parametrize("counter,counts", [(np.int32, "small"), (np.int32, "rounding"),
                                            (np.int64, "small"), (np.int64, "rounding"),
                                            (np.int64, "wide")])
@pytest.mark.parametrize("dt", [D.FLOAT, D.FLOAT16, D.BF16])
def test_batch_norm_like_body(dt, counter, counts):
    rng = np.random.default_rng(1)
    t = NP[dt]
    a = FusedAttrs(shape=(3, 4, 50), body=bn_body(dt), result="t9", out_dtype=dt)
    ins = [np.array(COUNTS[counts], counter), rng.standard_normal(4).astype(t),
           rng.standard_normal(4).astype(t), rng.standard_normal((3, 4, 50)).astype(t)]
    check(a, ins)


def test_sum_over_several_blocks_keepdims_and_special_values():
    """Sums over 2·32768+5 elements per channel (three blocks, a short last one) of values with
    very different magnitudes, where the order of the additions shows in the bits."""
    rng = np.random.default_rng(2)
    C, n = 3, 2 * 32768 + 5
    x = rng.uniform(0.5, 1.5, (C, n)).astype(np.float32)  # every addition rounds
    x[1] *= (10.0 ** rng.integers(-6, 7, n)).astype(np.float32)
    y = x[1].copy()
    x[0, 5], x[1, 7], x[2, :] = np.inf, -0.0, -0.0
    body = (I("sum", "in0", shape=(C, 1)), I("view", "t0", shape=(C, 1)), I("add", "in1", "t1"))
    a = FusedAttrs(shape=(C, 8), body=body, result="t2", out_dtype=D.FLOAT)
    got = check(a, [x, np.zeros((C, 8), np.float32)])
    assert np.isinf(got[0]).all() and np.array_equal(R.bits(got[2]), R.bits(np.zeros(8, np.float32) - 0.0))
    whole = (I("sum", "in0"), I("mul", "in1", "t0"))
    check(FusedAttrs(shape=(C, 8), body=whole, result="t1", out_dtype=D.FLOAT),
          [y[:40000].reshape(8, 5000), np.ones((C, 8), np.float32)])


def test_sum_of_a_broadcast_register_over_a_wider_shape():
    body = (I("view", "in0", shape=(1, 3, 1)), I("sum", "t0", shape=(1, 3, 1), over=(5, 3, 7)),
            I("mul", "in1", "t1", dtype=D.FLOAT))
    a = FusedAttrs(shape=(5, 3, 7), body=body, result="t2", out_dtype=D.FLOAT)
    check(a, [np.float32([0.1, 0.2, 0.3]), np.ones((5, 3, 7), np.float32)])


def test_fill_and_views_of_a_constant():
    body = (I("fill", value=0.1, dtype=D.FLOAT16, shape=(1, 2, 1)), I("view", "t0", dtype=D.FLOAT16, shape=(2, 1)),
            I("cast", "in0", dtype=D.FLOAT16), I("add", "t2", "t1", dtype=D.FLOAT16))
    a = FusedAttrs(shape=(2, 9), body=body, result="t3", out_dtype=D.FLOAT16)
    check(a, [np.linspace(-3, 3, 18, dtype=np.float32).reshape(2, 9)])


def test_strided_and_large_per_channel_inputs():
    """Channel parameters read through negative and non-unit strides, and 3000 channels (the
    scratch no longer fits on the stack)."""
    rng = np.random.default_rng(3)
    C = 3000
    body = (I("view", "in0", shape=(C, 1)), I("view", "in1", shape=(C, 1)), I("mul", "t0", "t1"),
            I("sub", "in2", "t2"))
    a = FusedAttrs(shape=(C, 33), body=body, result="t3", out_dtype=D.FLOAT)
    w = rng.standard_normal(2 * C).astype(np.float32)
    check(a, [w[::-2], w[1::2], rng.standard_normal((C, 33)).astype(np.float32)])


def test_unsupported_prologue_falls_back_to_numpy_hoisting():
    """An f16 fma rounds from double straight to f16: not rendered, hoisted in numpy."""
    body = (I("fma", "in0", "in0", "in0", dtype=D.FLOAT16), I("view", "t0", dtype=D.FLOAT16, shape=(3, 1)),
            I("mul", "in1", "t1", dtype=D.FLOAT16))
    a = FusedAttrs(shape=(3, 40), body=body, result="t2", out_dtype=D.FLOAT16)
    check(a, [np.float16([1, 2, 3]), np.ones((3, 40), np.float16)], fused=False)


def special_triples(n: int = 400):
    """Per-channel a, b, c: NaN either side or both (different payloads), ±0 both ways, ±Inf,
    ties, then random values whose a·b + c rounds differently in float32 and in double."""
    nan2 = np.uint32(0x7FC12345).view(np.float32)
    a = [np.nan, 1, nan2, -0.0, 0.0, np.inf, -np.inf, 3, np.inf, 1e-45, 0.0]
    b = [1, np.nan, np.nan, 0.0, -0.0, np.inf, 5, 3, 0.0, 1e-45, -0.0]
    c = [1, 2, 3, 0.0, -0.0, -np.inf, 1, -9, 1, 0.0, -0.0]
    rng = np.random.default_rng(5)
    k = n - len(a)
    a = np.concatenate([np.float32(a), rng.standard_normal(k).astype(np.float32)])
    b = np.concatenate([np.float32(b), rng.standard_normal(k).astype(np.float32)])
    c = np.concatenate([np.float32(c), (-a[len(c):] * b[len(c):]).astype(np.float32)])  # cancels
    return a, b, c


@pytest.mark.parametrize("op", ["max", "fma", "eq"])
def test_max_fma_eq_where_in_the_prologue(op):
    """The arch35 kernels' per-channel steps (BatchNormElemt on the 950): numpy's bits — which
    NaN np.maximum returns and its tie rule for ±0, fma in double rounded once, eq picking
    through where."""
    a, b, c = special_triples()
    if op == "fma":  # which of two NaN payloads a product keeps is the compiler's operand order
        b[2] = 2
    C = a.size
    first = (I("max", "in0", "in1") if op == "max" else I("fma", "in0", "in1", "in2") if op == "fma"
             else I("eq", "in0", "in1", dtype=D.BOOL))
    pick = [] if op != "eq" else [I("where", "t0", "in2", "in1")]
    view = I("view", f"t{len(pick)}", shape=(C, 1))
    body = (first, *pick, view, I("mul", "in3", f"t{len(pick) + 1}"))
    a_ = FusedAttrs(shape=(C, 40), body=body, result=f"t{len(pick) + 2}", out_dtype=D.FLOAT)
    with np.errstate(all="ignore"):
        got = check(a_, [a, b, c, np.ones((C, 40), np.float32)])
    if op == "max":  # the first NaN wins; a tie gives the second operand (numpy's rule here)
        assert got[2, 0:1].view(np.uint32)[0] == 0x7FC12345
        assert not np.signbit(got[3, 0]) and np.signbit(got[4, 0])
    if op == "fma":  # exact in double: the product cancels c to the rounding error of a·b
        exact = a[11:].astype(np.float64) * b[11:] + c[11:]
        assert np.array_equal(got[11:, 0], exact.astype(np.float32)) and np.any(got[11:, 0] != 0)


@pytest.mark.parametrize("dt", [D.FLOAT, D.FLOAT16, D.BF16])
def test_sqrt_in_the_prologue(dt):
    """Correctly rounded, then rounded to the register's dtype (the product after it shows a
    missing rounding: numpy's own arithmetic in the dtype is the independent expectation);
    NaN (of -1), -0.0, 0, Inf and subnormals keep numpy's bits."""
    t = NP[dt]
    with np.errstate(all="ignore"):
        special = np.float32([-1, -0.0, 0, np.inf, 1e-45, 2, 3, 1e30, 0.1, 5, 7, 1.3]).astype(t)
        body = (I("sqrt", "in0", dtype=dt), I("view", "t0", dtype=dt, shape=(special.size, 1)),
                I("mul", "in1", "t1", dtype=dt))
        a = FusedAttrs(shape=(special.size, 40), body=body, result="t2", out_dtype=dt)
        scale = np.random.default_rng(9).uniform(1, 4, (special.size, 40)).astype(t)
        got = check(a, [special, scale])
        want = scale * np.sqrt(special).reshape(-1, 1)  # each op rounded to the dtype
    R.assert_bits_equal(got, want, any_nan=True)


def test_new_size_reuses_the_compiled_code():
    a = FusedAttrs(shape=(5, 4, 30), body=bn_body(D.FLOAT), result="t9", out_dtype=D.FLOAT)
    b = FusedAttrs(shape=(2, 4, 70), body=bn_body(D.FLOAT), result="t9", out_dtype=D.FLOAT)
    rng = np.random.default_rng(4)

    def ins(shape):
        return [np.int32([3, 4]), *(rng.standard_normal(4).astype(np.float32) for _ in range(2)),
                rng.standard_normal(shape).astype(np.float32)]
    check(a, ins(a.shape))
    before = build.stats["compiles"]
    check(b, ins(b.shape))
    assert build.stats["compiles"] == before


def test_same_arrays_with_new_values_and_a_different_output():
    """The remembered pointers belong to the array objects: new values in the same arrays are
    read, and another output array is written."""
    rng = np.random.default_rng(5)
    a = FusedAttrs(shape=(3, 4, 50), body=bn_body(D.FLOAT), result="t9", out_dtype=D.FLOAT)
    ins = [np.int32([3, 4]), *(rng.standard_normal(4).astype(np.float32) for _ in range(2)),
           rng.standard_normal((3, 4, 50)).astype(np.float32)]
    out1 = np.empty((3, 4, 50), np.float32)
    native.run_fused_native(a, ins, out1)
    ins[1][:] = rng.standard_normal(4)
    ins[3][:] = rng.standard_normal((3, 4, 50))
    out2 = np.empty((3, 4, 50), np.float32)
    native.run_fused_native(a, ins, out2)
    R.assert_bits_equal(out2, run_fused(a, ins))
    assert not np.array_equal(out1, out2)


@pytest.mark.parametrize("e", [-0.5, 0.5, 2.0, -1.0, 1.0, 0.0, 3.0])
@pytest.mark.parametrize("dt", [D.FLOAT, D.FLOAT16, D.BF16])
def test_pow_by_a_constant_in_the_prologue(dt, e):
    """pow by a one-element constant, as the 950 kernel special-cases it (−0.5: Sqrt then Div;
    the 950's BatchNormStats ends with it): numpy's bits for NaN, ±0, ±Inf, negatives and
    subnormals; another exponent is not rendered (hoisted in numpy, the same bits)."""
    with np.errstate(all="ignore"):
        x = np.float32([np.nan, -0.0, 0.0, np.inf, -np.inf, -2, 1e-45, 3e-39, 0.1, 7, 1e30]).astype(NP[dt])
        C = x.size
        body = (I("fill", value=e, dtype=dt), I("pow", "in0", "t0", dtype=dt),
                I("view", "t1", dtype=dt, shape=(C, 1)), I("mul", "in1", "t2", dtype=dt))
        a = FusedAttrs(shape=(C, 40), body=body, result="t3", out_dtype=dt)
        scale = np.random.default_rng(8).uniform(1, 4, (C, 40)).astype(NP[dt])
        got = check(a, [x, scale], fused=e != 3.0)
        # the kernel's formulas in float32 (float64 for another exponent), rounded to the dtype,
        # then the product in the dtype: a pow left unrounded shows in the product
        x32, one = x.astype(np.float32), np.float32(1)
        power = {-0.5: one / np.sqrt(x32), 0.5: np.sqrt(x32), 2.0: x32 * x32, -1.0: one / x32,
                 1.0: x32, 0.0: np.ones_like(x32)}.get(e)
        if power is None:
            power = (x32.astype(np.float64) ** e).astype(np.float32)
        want = scale * power.astype(NP[dt]).reshape(C, 1)
    R.assert_bits_equal(got, want, any_nan=True)
    if e == -0.5 and dt == D.FLOAT:
        assert np.isinf(got[2]).all() and np.array_equal(got[9], scale[9] * (one / np.sqrt(np.float32(7))))


@pytest.mark.parametrize("dt", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_elemt_on_the_950_runs_its_prologue_in_c(dt, monkeypatch):
    """Ascend950's BatchNormElemt refines 1/sqrt(var + eps) per channel with max, fma, eq and
    where: its direct launch renders that in C (one C call, no numpy hoisting), with numpy's
    bits — zero, Inf and NaN variances included."""
    monkeypatch.setattr(native.NativeBackend, "min_fused_elements", 0)  # a small case, in C
    rng = np.random.default_rng(6)
    C = 12
    x = rng.standard_normal((3, C, 5, 10)).astype(dt)
    w, b, mean = (rng.uniform(0.5, 2, C).astype(dt) for _ in range(3))
    invstd = rng.uniform(0.5, 2, C).astype(dt)
    invstd[:4] = [0, np.inf, np.nan, -0.0]
    got = {}
    for be in ("numpy", "native"):
        out = np.empty_like(x)
        with opgraph.platform("Ascend950"), opgraph.opt_level(2), opgraph.use_backend(be), \
                np.errstate(all="ignore"):
            _, _, ex = aclnnBatchNormElemtGetWorkspaceSize(*map(opgraph.tensor, (x, w, b, mean, invstd)),
                                                           1e-5, opgraph.tensor(out))
            assert aclnnBatchNormElemt(None, 0, ex) == 0
        got[be] = out
    R.assert_bits_equal(got["native"], got["numpy"])
    exe = ex.program.executable(B.get("native"))
    assert exe.launches and [ln.fused for ln, _ in exe.launches] == [True]
    assert any(i.op == "fma" for i in exe.launches[0][0].attrs.body)
