"""The l0 ops the SyncBatchNorm family adds: the fixed summation order (bits against an
independent loop model, error against float64), broadcasting arithmetic (bits against native
numpy arithmetic in the dtype), Pow's special cases, reductions (against float64 formulas) and
views."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import l0ops
from l0ops.ordered import ordered_sum
from opgraph.core.dtypes import DataType, Format
from opgraph.core.ir import Graph, TensorType
from opgraph.core.opdef import L0Error
from sum_model import loop_sum

F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("n", [1, 2, 3, 63, 64, 65, 200, 4097, 32768 + 130, 70001])
def test_ordered_sum_bits_match_the_loop_model(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 10 ** rng.uniform(-3, 3, n)).astype(F32)
    got = ordered_sum(x, (0,))
    want = loop_sum([F32(v) for v in x])
    assert got.dtype == F32 and got.view(np.uint32) == np.asarray(want, F32).view(np.uint32)


def test_ordered_sum_is_independent_of_layout_and_of_the_other_dims():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3, 7, 11)).astype(F32)
    a = ordered_sum(x, (0, 2, 3))
    b = ordered_sum(np.asfortranarray(x), (0, 2, 3))          # another memory layout
    c = np.stack([ordered_sum(x[:, k], (0, 1, 2)) for k in range(3)])  # channel by channel
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.array_equal(a.view(np.uint32), c.view(np.uint32))


def test_ordered_sum_error_against_float64_within_the_documented_bound():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 100_000)).astype(F32) + F32(3)
    got = ordered_sum(x, (1,)).astype(np.float64)
    exact = x.astype(np.float64).sum(axis=1)
    bound = (32768 / 64 + 6 + math.ceil(math.log2(100_000 / 32768))) * 2.0 ** -24 \
        * np.abs(x.astype(np.float64)).sum(axis=1)
    assert np.all(np.abs(got - exact) <= bound)


@pytest.mark.parametrize("op,fn", [("Mul", np.multiply), ("Add", np.add), ("Sub", np.subtract),
                                   ("Div", np.divide)])
@pytest.mark.parametrize("dt", [np.float16, F32, BF16])
def test_arithmetic_bits_equal_native_arithmetic_in_the_dtype(op, fn, dt):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 4)).astype(dt)
    b = (rng.standard_normal((1, 4)) + 3).astype(dt)  # broadcast
    got = l0ops.get_op(op).compute([a, b], l0ops.get_op(op).make_attrs())[0]
    if dt == BF16:  # no native bf16 arithmetic in numpy: exact float64 result, rounded once
        want = fn(a.astype(np.float64), b.astype(np.float64)).astype(dt)
    else:
        want = fn(a, b)
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint16 if dt != F32 else np.uint32),
                                                      want.view(np.uint16 if dt != F32 else np.uint32))


def test_mul_and_add_promote_half_with_float32_but_sub_and_div_refuse_mixed_dtypes():
    g = Graph()
    h = g.add_input("h", TensorType((3,), DataType.FLOAT16))
    f = g.add_input("f", TensorType((3,), DataType.FLOAT))
    assert l0ops.Mul(g, h, f).dtype == DataType.FLOAT and l0ops.Add(g, f, h).dtype == DataType.FLOAT
    with pytest.raises(L0Error, match="differ"):
        l0ops.Sub(g, h, f)
    with pytest.raises(L0Error, match="do not broadcast"):
        l0ops.Mul(g, h, g.add_input("w", TensorType((4,), DataType.FLOAT16)))


@pytest.mark.parametrize("e", [-0.5, 0.5, 2.0, -1.0, 1.0, 0.0, 3.0])
def test_pow_special_cases(e):
    x = np.float32([0.25, 2.0, 9.0, 1e-3])
    got = l0ops.Pow.compute([x, np.float32(e)], l0ops.Pow.make_attrs())[0]
    want = {-0.5: F32(1) / np.sqrt(x), 0.5: np.sqrt(x), 2.0: x * x, -1.0: F32(1) / x, 1.0: x,
            0.0: np.ones_like(x)}.get(e, (x.astype(np.float64) ** e).astype(F32))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_reductions_against_float64_formulas():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, 3, 5, 7)) * 2 + 1).astype(F32)
    axes = (0, 2, 3)
    x64 = x.astype(np.float64)
    n = x.size // 3
    mean64, var64 = x64.mean(axis=axes), x64.var(axis=axes)
    var, mean = l0ops.ReduceVar.compute([x], l0ops.ReduceVar.make_attrs(axes=axes))
    assert np.allclose(mean, mean64, rtol=1e-6, atol=1e-6) and np.allclose(var, var64, rtol=1e-5)
    m = l0ops.ReduceMean.compute([x], l0ops.ReduceMean.make_attrs(axes=axes))[0]
    assert np.allclose(m, mean64, rtol=1e-6, atol=1e-6)
    mb = np.broadcast_to(m.reshape(1, 3, 1, 1), x.shape)
    inv = l0ops.ReduceStdWithMean.compute([x, mb], l0ops.ReduceStdWithMean.make_attrs(
        axes=axes, eps=1e-5))[0]
    assert np.allclose(inv, 1 / np.sqrt(var64 + 1e-5), rtol=1e-5)
    w = np.abs(rng.standard_normal((4, 3))).astype(F32) + 1
    cnt = np.broadcast_to(F32([[3], [1], [4], [2]]), (4, 3))
    cs = np.broadcast_to(cnt.sum(0, keepdims=True), (4, 3))
    got = l0ops.ReduceMeanWithCount.compute([w, cnt, cs], l0ops.ReduceMeanWithCount.make_attrs(
        axes=(0,), keepdims=True))[0]
    want = (w.astype(np.float64) * cnt).sum(0, keepdims=True) / cs[:1]
    assert got.shape == (1, 3) and np.allclose(got, want, rtol=1e-6)
    assert n == 210


def test_views():
    g = Graph()
    x = g.add_input("x", TensorType((2, 3, 1, 1), DataType.FLOAT))
    assert l0ops.Reshape(g, x, shape=(2, -1)).shape == (2, 3)
    assert l0ops.Reshape(g, x, shape=(6,)).type.format == Format.ND
    assert l0ops.SqueezeNd(g, x, dims=(0, 2)).shape == (2, 3, 1)  # dim 0 has size 2: stays
    assert l0ops.ReFormat(g, x, format="NCHW").type.format == Format.NCHW
    with pytest.raises(L0Error, match="needs rank 5"):
        l0ops.ReFormat(g, x, format="NCDHW")
    with pytest.raises(L0Error, match="cannot be viewed"):
        l0ops.Reshape(g, x, shape=(4,))
    assert all(l0ops.get_op(op).is_free(None) for op in ("Reshape", "SqueezeNd", "ReFormat"))


@pytest.mark.parametrize("shape", [(7, 5000), (3, 64 * 9), (1, 32768 * 2 + 70), (2, 32768 * 3 + 7)])
def test_ordered_sum_rows_bits_match_the_loop_model(shape):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 10 ** rng.uniform(-4, 4, shape)).astype(F32)
    x[0, :3] = -0.0
    got = ordered_sum(x, (1,))
    for k in range(shape[0]):
        want = loop_sum([F32(v) for v in x[k]])
        assert got[k].view(np.uint32) == np.asarray(want, F32).view(np.uint32)


@pytest.mark.parametrize("shape, axis", [((2,), 0), ((2, 5), 0), ((5, 2), 1), ((3, 2, 4), 1)])
@pytest.mark.parametrize("dtype", [F32, np.float16, BF16])
def test_ordered_sum_of_pairs_bits_match_the_loop_model(shape, axis, dtype):
    """Two elements per sum (a sum over the ranks of a two-rank gather, say): one tree step."""
    rng = np.random.default_rng(len(shape) + shape[0])
    x = (rng.standard_normal(shape) * 10 ** rng.uniform(-3, 3, shape)).astype(dtype)
    x.reshape(-1)[:2] = -0.0
    got = ordered_sum(x, (axis,))
    moved = np.moveaxis(x, axis, -1).reshape(-1, 2)
    want = np.array([loop_sum([F32(v) for v in pair]) for pair in moved], F32)
    assert got.dtype == F32 and got.shape == tuple(np.delete(shape, axis))
    assert np.array_equal(got.reshape(-1).view(np.uint32), want.view(np.uint32))


def test_ordered_sum_of_negative_zeros_is_negative_zero():
    assert np.signbit(ordered_sum(np.full(200, -0.0, F32), (0,)))
