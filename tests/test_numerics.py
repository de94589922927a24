"""Numerics of aclnnBatchNormElemtBackward on the numpy backend: bit-exact against the
independent reference (tests/reference.py) on each platform and opt level, the vendor doc example,
a float64 oracle, a torch autograd oracle, strided inputs/outputs, empty tensors and counters."""
from __future__ import annotations

import numpy as np
import pytest

import opgraph
from opgraph import aclnn

from reference import (BF16, F16, F32, I32, NAMES, Case, article_case, assert_bits_equal, bits,
                       compute, error_scale, grad_input, grad_input_f64, make_case, padded_out,
                       run_op, to_tensors)

CONFIGS = {
    "f32": dict(dtype=F32),
    "f16": dict(dtype=F16),
    "bf16": dict(dtype=BF16),
    "f16-null-weight": dict(dtype=F16, weight=False),
    "f32-null-weight": dict(dtype=F32, weight=False),
    "mixed-f16-bf16-f32": dict(dtype=F32, dtypes={"gradOut": F16, "input": BF16, "invstd": F16}),
    "f16-params-f32": dict(dtype=F16, dtypes={"mean": F32, "invstd": F32, "weight": F32,
                                              "sumDy": F32, "sumDyXmu": F32}),
    "f32-in-f16-out": dict(dtype=F32, out_dtype=F16),
    "f16-in-bf16-out": dict(dtype=F16, out_dtype=BF16),
    "bf16-in-f32-out": dict(dtype=BF16, out_dtype=F32),
    "f16-counter-f16": dict(dtype=F16, counter_dtype=F16, counter_shape=(3, 2)),
    "f32-counter-f32": dict(dtype=F32, counter_dtype=F32, counter_shape=(1,)),
}


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bit_exact_against_reference(name, soc, level):
    case = make_case((2, 3, 4, 5), seed=11, **CONFIGS[name])
    with opgraph.platform(soc):
        got = compute(case)
    assert_bits_equal(got, case.expected(soc))


@pytest.mark.parametrize("soc", ["Ascend910_93", "Ascend910"])
@pytest.mark.parametrize("name", ["f32", "f16", "f16-null-weight", "f32-in-f16-out"])
def test_bit_exact_on_other_platforms(name, soc, level):
    case = make_case((3, 4, 6), seed=12, **CONFIGS[name])
    with opgraph.platform(soc):
        got = compute(case)
    assert_bits_equal(got, case.expected(soc))


@pytest.mark.parametrize("shape", [(4, 3), (1, 1), (3, 1, 5), (2, 2, 1, 2, 1, 2), (1, 2, 1, 1, 1, 1, 1, 3)])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_bit_exact_over_ranks(shape, dtype, level):
    case = make_case(shape, dtype, seed=13)
    assert_bits_equal(compute(case), case.expected())


@pytest.mark.parametrize("dtype", [F16, F32])
def test_platform_kernels_really_differ(dtype):
    """The DAV_2201 and DAV_3510 kernels round differently; each platform matches its own."""
    found = False
    for seed in range(20):
        case = make_case((4, 8, 16), dtype, seed=seed)
        e2201, e3510 = case.expected("Ascend910B"), case.expected("Ascend950")
        if np.array_equal(bits(e2201), bits(e3510)):
            continue
        found = True
        with opgraph.platform("Ascend910B"):
            assert_bits_equal(compute(case), e2201)
        with opgraph.platform("Ascend950"):
            assert_bits_equal(compute(case), e3510)
        break
    assert found, "no case distinguishes the two kernels: the bit-exact tests would be too weak"


def test_fp16_rounds_after_every_step():
    """Native fp16 steps differ from computing in f32 and rounding once; we match the former."""
    case = make_case((4, 8, 16), F16, seed=3)
    once = grad_input(*[None if a is None else a.astype(F32) for a in case.arrays()[:7]],
                      case.counter, F32, "Ascend910B").astype(F16)
    native = case.expected("Ascend910B")
    assert not np.array_equal(bits(once), bits(native))
    assert_bits_equal(compute(case), native)


# --------------------------------------------------------------------------------------------
# the vendor doc's example (reference §5.2)
# --------------------------------------------------------------------------------------------
ARTICLE = [0.0, 0.9, 1.8, 2.7, 3.6, 4.5, 5.4, 6.3]  # 0.9·x, worked out by hand


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950", "Ascend910_93"])
def test_article_example_fp32(soc, level):
    case = article_case(F32)
    with opgraph.platform(soc):
        got = compute(case)
    assert got.shape == (1, 2, 4) and got.dtype == F32
    np.testing.assert_allclose(got.ravel(), ARTICLE, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got.ravel(), [0.8 * v for v in range(8)])  # not a per-channel count


@pytest.mark.parametrize("dtype,tol", [(F16, 4e-3), (BF16, 3e-2)])
def test_article_example_low_precision(dtype, tol, level):
    case = article_case(dtype)
    got = compute(case)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64).ravel(), ARTICLE, rtol=tol, atol=tol)
    assert_bits_equal(got, case.expected())


@pytest.mark.parametrize("counter", [
    np.array([[2, 3], [4, 1]], np.int32),
    np.array([10], np.int32),
    np.array([2.5, 2.5, 5.0], np.float16),
    np.ones((1, 1, 1, 1, 1, 1, 2, 5), np.float32),
], ids=["2x2", "one", "halves-f16", "8d"])
def test_article_example_counter_is_summed_over_all_elements(counter):
    case = article_case(F32).with_(counter=counter)
    got = compute(case)
    np.testing.assert_allclose(got.ravel(), ARTICLE, rtol=1e-6, atol=1e-6)


def test_article_example_null_weight_and_pythonic_api():
    case = article_case(F32)
    x = case.input
    args = [case.gradOut, x, case.mean, case.invstd, None, case.sumDy, case.sumDyXmu, case.counter]
    y = opgraph.ops.batch_norm_elemt_backward(*args)
    assert y.shape == x.shape and y.dtype == F32
    np.testing.assert_allclose(y.ravel(), ARTICLE, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# oracles
# --------------------------------------------------------------------------------------------
EPS = {F32: 2.0 ** -24, F16: 2.0 ** -11, BF16: 2.0 ** -8}


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_float64_oracle(dtype, seed, soc):
    case = make_case((3, 4, 5, 2), dtype, seed=seed, weight=seed != 2)
    with opgraph.platform(soc):
        got = compute(case).astype(np.float64)
    args = case.arrays()
    want = grad_input_f64(*args)
    scale = error_scale(*args)
    # 8 roundings in the compute type, 1 for meanDy's cast, 1 for the final cast
    bound = 12 * EPS[np.dtype(dtype)] * scale + 1e-30
    err = np.abs(got - want)
    assert np.all(err <= bound), f"max error {err.max()} vs bound {bound[np.argmax(err - bound)]}"
    assert np.abs(want).max() > 0.1  # a non-trivial case


def _torch_case(torch, shape, eps=1e-5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 2 + 0.5
    dy = torch.randn(*shape, generator=g, dtype=torch.float64)
    C = shape[1]
    bn = (torch.nn.BatchNorm2d if len(shape) == 4 else torch.nn.BatchNorm1d)(C, eps=eps).double()
    with torch.no_grad():
        bn.weight.copy_(torch.rand(C, generator=g, dtype=torch.float64) + 0.5)
        bn.bias.copy_(torch.randn(C, generator=g, dtype=torch.float64))
    bn.train()
    x.requires_grad_(True)
    bn(x).backward(dy)
    dims = [d for d in range(len(shape)) if d != 1]
    xd = x.detach()
    mean = xd.mean(dim=dims)
    var = xd.var(dim=dims, unbiased=False)
    invstd = 1.0 / torch.sqrt(var + eps)
    bshape = [1, C] + [1] * (len(shape) - 2)
    sum_dy = dy.sum(dim=dims)
    sum_dy_xmu = (dy * (xd - mean.reshape(bshape))).sum(dim=dims)
    n = int(np.prod([shape[d] for d in dims]))
    return xd, dy, mean, invstd, bn.weight.detach(), sum_dy, sum_dy_xmu, n, x.grad


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (16, 5)])
@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_torch_autograd_oracle(shape, soc):
    torch = pytest.importorskip("torch", reason="torch is not installed: autograd oracle skipped")
    xd, dy, mean, invstd, w, sdy, sdyx, n, grad = _torch_case(torch, shape)
    split = [n // 3, n // 3, n - 2 * (n // 3)]  # the count split across three "devices"
    f = lambda t: t.numpy().astype(np.float32)  # noqa: E731
    case = Case(f(dy), f(xd), f(mean), f(invstd), f(w), f(sdy), f(sdyx), np.array(split, np.int32), F32)
    with opgraph.platform(soc):
        got = compute(case).astype(np.float64)
    want = grad.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# --------------------------------------------------------------------------------------------
# strided inputs and outputs
# --------------------------------------------------------------------------------------------
LAYOUTS = {
    "data-permuted": {"gradOut": "perm", "input": "perm"},
    "data-stepped": {"gradOut": "step", "input": "step"},
    "data-offset": {"gradOut": "offset", "input": "offset"},
    "params-stepped": {n: "step" for n in ("mean", "invstd", "weight", "sumDy", "sumDyXmu")},
    "params-offset": {n: "offset" for n in ("mean", "invstd", "weight", "sumDy", "sumDyXmu")},
    "counter-permuted": {"counter": "perm"},
    "counter-stepped": {"counter": "step"},
    "everything": {"gradOut": "perm", "input": "step", "mean": "offset", "invstd": "step",
                   "weight": "offset", "sumDy": "step", "sumDyXmu": "offset", "counter": "step"},
}


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_non_contiguous_inputs(name, dtype, level):
    case = make_case((2, 3, 4, 2), dtype, seed=21, counter_shape=(3, 2))
    layouts = LAYOUTS[name]
    ts = to_tensors(case, layouts, np.random.default_rng(4))
    for n, t in zip(NAMES, ts):
        np.testing.assert_array_equal(t.numpy(), getattr(case, n))  # same values, new layout
        if n in layouts and t.numel > 1 and layouts[n] != "offset":
            assert not t.is_contiguous
    out = np.zeros(case.input.shape, case.out_dtype)
    run_op(ts, opgraph.tensor(out))
    assert_bits_equal(out, case.expected())


def test_inputs_are_not_modified():
    case = make_case((2, 3, 4), F16, seed=2)
    ts = to_tensors(case, {"input": "perm", "mean": "step"})
    before = [t.storage.copy() for t in ts]
    run_op(ts, opgraph.tensor(np.zeros((2, 3, 4), F16)))
    for b, t in zip(before, ts):
        assert b.tobytes() == t.storage.tobytes()


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("dtype,out_dtype", [(F32, F32), (F16, F16), (BF16, BF16), (F32, F16), (F16, BF16)])
def test_strided_output_writes_only_its_view(dtype, out_dtype, soc, level):
    case = make_case((2, 3, 4), dtype, out_dtype=out_dtype, seed=8)
    out, storage, pristine = padded_out((2, 3, 4), out_dtype, offset=5)
    assert not out.is_contiguous
    with opgraph.platform(soc):
        run_op(to_tensors(case), out)
    assert_bits_equal(out.numpy(), case.expected(soc))
    touched = np.zeros(storage.size, bool)
    idx = np.zeros(out.shape, np.int64) + out.offset
    for d, s in enumerate(out.strides):
        shape = [1] * out.ndim
        shape[d] = out.shape[d]
        idx = idx + (np.arange(out.shape[d]) * s).reshape(shape)
    touched[idx.ravel()] = True
    assert touched.sum() == case.input.size
    assert storage[~touched].tobytes() == pristine[~touched].tobytes(), "ViewCopy wrote outside its view"


def test_transposed_and_offset_outputs():
    case = make_case((3, 4), F32, seed=9)
    base = np.full((4, 3), -7, np.float32)
    t = opgraph.tensor(base.T)  # transposed view, no gaps
    run_op(to_tensors(case), t)
    assert_bits_equal(np.ascontiguousarray(base.T), case.expected())
    storage = np.full(20, -7, np.float32)
    t2 = opgraph.Tensor(storage, (3, 4), (4, 1), offset=6)
    run_op(to_tensors(case), t2)
    assert_bits_equal(storage[6:18].reshape(3, 4), case.expected())
    assert (storage[:6] == -7).all() and (storage[18:] == -7).all()


@pytest.mark.parametrize("dtype", [F32, F16])
def test_output_aliasing_an_input(dtype, level):
    """gradInput may be gradOut's own memory, or a transposed view over input's storage."""
    case = make_case((2, 3, 4), dtype, seed=5)
    ts = to_tensors(case)
    run_op(ts, ts[0])
    assert_bits_equal(ts[0].numpy(), case.expected())
    case2 = make_case((3, 3), dtype, seed=6)
    ts2 = to_tensors(case2)
    out = opgraph.Tensor(ts2[1].storage, (3, 3), (1, 3))
    run_op(ts2, out)
    assert_bits_equal(out.numpy(), case2.expected())


def test_pythonic_api_matches_reference_and_fills_strided_out():
    case = make_case((2, 3, 4), F16, seed=4)
    y = opgraph.ops.batch_norm_elemt_backward(*case.arrays())
    assert_bits_equal(y, case.expected())
    big = np.full((2, 3, 8), np.float16(9), np.float16)
    out = big[:, :, ::2]
    res = opgraph.ops.batch_norm_elemt_backward(*case.arrays(), out=out)
    assert res is out
    assert_bits_equal(np.ascontiguousarray(big[:, :, ::2]), case.expected())
    assert (big[:, :, 1::2] == 9).all()


# --------------------------------------------------------------------------------------------
# empty tensors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 3, 0), (0, 3), (1, 2, 0, 3)])
@pytest.mark.parametrize("weight", [True, False])
def test_empty_input_is_a_no_op(shape, weight, soc, level):
    case = make_case(shape, F16, weight=weight)
    storage = np.full(16, 0x3C00, np.uint16).view(np.float16)  # 1.0 everywhere
    out = opgraph.Tensor(storage, shape, (1,) * len(shape), offset=2)
    with opgraph.platform(soc):
        st, ws, ex, st2 = run_op(to_tensors(case), out)
    assert st == 0 and st2 == 0 and ws == 0
    assert len(ex.graph.nodes) == 0
    assert not any(n.op == "SyncBatchNormBackwardElemt" for n in (ex.compiled or ex.graph).nodes)
    assert (storage == 1).all()


def test_empty_input_phase2_without_workspace():
    case = make_case((0, 3, 4), F32)
    st, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
        *to_tensors(case), opgraph.tensor(np.zeros((0, 3, 4), F32)))
    assert (st, ws) == (0, 0)
    assert aclnn.aclnnBatchNormElemtBackward(None, 0, ex) == 0


def test_empty_input_pythonic():
    case = make_case((0, 3, 4), BF16)
    y = opgraph.ops.batch_norm_elemt_backward(*case.arrays())
    assert y.shape == (0, 3, 4) and y.dtype == BF16


# --------------------------------------------------------------------------------------------
# counters
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cdtype", [I32, F16, F32])
@pytest.mark.parametrize("cshape", [(1,), (5,), (2, 2), (3, 1, 2), (1, 1, 1, 1, 1, 1, 2, 2)])
def test_counter_dtypes_and_shapes(cdtype, cshape, level):
    case = make_case((2, 3, 4), F32, counter_dtype=cdtype, counter_shape=cshape, seed=31)
    assert_bits_equal(compute(case), case.expected())


def test_counter_total_not_per_channel():
    """With C = 2 and counter [[2,3],[4,1]] the divisor is 10 for every channel."""
    case = article_case(F32).with_(counter=np.array([[2, 3], [4, 1]], np.int32),
                                   sumDy=np.array([1.0, 2.0], np.float32),
                                   sumDyXmu=np.zeros(2, np.float32))
    got = compute(case)
    x = np.arange(8, dtype=np.float64).reshape(1, 2, 4)
    want = x - np.array([0.1, 0.2]).reshape(1, 2, 1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_repeated_calls_are_deterministic():
    case = make_case((3, 5, 7), F16, seed=17)
    a, b = compute(case), compute(case)
    assert bits(a).tobytes() == bits(b).tobytes()
