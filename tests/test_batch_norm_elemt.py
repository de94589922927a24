"""aclnnBatchNormElemt and its kernels BNInfer (910B) / BatchNormV3 inference (950): the vendor's
check table row by row (status, a message naming the argument, the output untouched), the l0
graph op by op on both SoC families, the numerics (BatchNormV3's Newton-Raphson rstd and the
whole 950 path bit for bit against an independent float32 model written here; BNInfer bit for bit
against its stated formula and both SoCs against float64 within stated bounds), the quirks
(var rebuilt in invstd's dtype, |invstd|, 561103 for another output dtype), ranks 2-8, empty
tensors, NaN/Inf, strides, levels, the backend kit and the CLI."""
from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import opgraph
from l0ops.bninfer import BatchNormV3
from opgraph import aclnn, passes
from opgraph.aclnn.batch_norm_elemt import (aclnnBatchNormElemt, aclnnBatchNormElemtGetWorkspaceSize,
                                            batch_norm_elemt)
from opgraph.cli import main as cli_main
from opgraph.core.dtypes import DataType
from opgraph.testing import check_backend

F32, F16, BF16, I32 = np.float32, np.float16, np.dtype(ml_dtypes.bfloat16), np.int32
INVALID, INNER_NULLPTR, NO_KERNEL = 161002, 561103, 561003
B910, A950 = ("Ascend910B", "Ascend910_93"), "Ascend950"
SOCS = ("Ascend910B", "Ascend910_93", "Ascend950")
NAMES = ("input", "weight", "bias", "mean", "invstd", "output")
SENTINEL = 0x5A


def make(shape=(2, 3, 4, 5), dtype=F32, sdtype=None, weight=True, bias=True, out_dtype=None, seed=0):
    rng = np.random.default_rng(seed)
    C, sd = shape[1], sdtype or dtype
    out = np.full(int(np.prod(shape)) * np.dtype(out_dtype or dtype).itemsize, SENTINEL, np.uint8)
    return {"input": (rng.standard_normal(shape) * 2 + 0.3).astype(dtype),
            "weight": rng.uniform(0.5, 1.5, C).astype(dtype) if weight else None,
            "bias": rng.normal(0, 0.5, C).astype(dtype) if bias else None,
            "mean": rng.normal(0.3, 0.5, C).astype(sd), "invstd": rng.uniform(0.5, 2, C).astype(sd),
            "output": out.view(out_dtype or dtype).reshape(shape)}


def tens(a, fmt="ND"):
    return a if a is None or isinstance(a, opgraph.Tensor) else opgraph.tensor(a, format=fmt)


def phase1(a, eps=1e-5, soc="Ascend910B", fmt="ND"):
    with opgraph.platform(soc):
        st, ws, ex = aclnnBatchNormElemtGetWorkspaceSize(
            *[tens(a[n], fmt if n in ("input", "output") else "ND") for n in NAMES[:5]], eps,
            tens(a["output"], fmt))
    return int(st), ws, ex, aclnn.aclGetRecentErrMsg()


def run(a, eps=1e-5, soc="Ascend910B", fmt="ND"):
    st, ws, ex, msg = phase1(a, eps, soc, fmt)
    assert st == 0, msg
    with opgraph.platform(soc):
        assert aclnnBatchNormElemt(bytearray(ws) if ws else None, ws, ex) == 0
    return ex


def expect_error(a, status, name, *words, soc="Ascend910B", fmt="ND", eps=1e-5):
    out = a["output"]
    before = None if out is None else np.asarray(out).tobytes()
    st, ws, ex, msg = phase1(a, eps, soc, fmt)
    assert st == status, f"expected {status}, got {st}: {msg}"
    assert ex is None and ws == 0
    body = msg.split("): ", 1)[1]
    assert body.split(":")[0] == name if name.isidentifier() else body.startswith(name), msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert out is None or np.asarray(out).tobytes() == before, "the output was written"


def u(a):
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.itemsize])


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    nan = np.isnan(a.astype(np.float64)) & np.isnan(b.astype(np.float64))
    return a.dtype == b.dtype and a.shape == b.shape and bool(((u(a) == u(b)) | nan).all())


# check table (ELT: NULL → 161002, dtype, format, shape; empty; ViewCopy; kernel gate)
@pytest.mark.parametrize("name", ["input", "mean", "invstd", "output"])
def test_null_is_161002_not_the_documented_161001(name):
    a = make()
    a[name] = None
    expect_error(a, INVALID, name, "NULL")


def test_nulls_in_argument_order_before_dtype():
    a = make(dtype=F16)
    a["input"] = a["input"].astype(np.float64)
    a["mean"], a["output"] = None, None
    expect_error(a, INVALID, "mean")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.float64, I32])
def test_dtype_outside_the_list(name, bad):
    a = make()
    a[name] = np.zeros_like(a[name], bad)
    expect_error(a, INVALID, name, np.dtype(bad).name.upper() if bad is I32 else "DOUBLE")


def test_dtype_checked_in_argument_order():
    a = make()
    a["bias"], a["output"] = a["bias"].astype(I32), a["output"].astype(np.float64)
    expect_error(a, INVALID, "bias")


@pytest.mark.parametrize("name", NAMES)
def test_bf16_rejected_on_ascend910_accepted_on_bf16_socs(name):
    a = make(dtype=F16)
    a[name] = a[name].astype(BF16)
    expect_error(a, INVALID, name, "BF16", soc="Ascend910")
    for soc in SOCS:  # input and output of different dtypes pass the checks, fail at ViewCopy
        st, _, _, msg = phase1(make(dtype=F16) | {name: a[name]}, soc=soc)
        assert st == (INNER_NULLPTR if name in ("input", "output") else 0), msg


def test_format_rows():
    a = make()
    st, _, _, msg = phase1(a, fmt="NHWC")  # any plain format, channel stays dim 1
    assert st == 0, msg
    with opgraph.platform("Ascend910B"):
        st, _, _ = aclnnBatchNormElemtGetWorkspaceSize(*[tens(a[n]) for n in NAMES[:5]], 1e-5,
                                                       tens(a["output"], "NCHW"))
    assert st == INVALID and aclnn.aclGetRecentErrMsg().split("): ")[1].startswith("output:")
    expect_error(make(), INVALID, "input", "private", fmt="NC1HWC0")


@pytest.mark.parametrize("name,shape,word", [
    ("input", (2,) * 9, "greater than 8"), ("input", (4,), "less than 2"),
    ("output", (2, 3, 4, 5, 1, 1, 1, 1, 1), "greater than 8"), ("output", (120,), "less than 2")])
def test_ranks_input_first_then_output(name, shape, word):
    a = make()
    a[name] = np.zeros(shape, F32)
    expect_error(a, INVALID, name, word)


def test_output_shape_then_channel_zero_then_channel_params():
    a = make()
    a["output"] = np.zeros((2, 3, 4, 6), F32)
    expect_error(a, INVALID, "output", "must equal input's")
    a = make()
    a["input"] = a["output"] = np.zeros((2, 0, 4), F32)
    expect_error(a, INVALID, "input", "channel dim")
    a = make()
    a["input"], a["output"], a["weight"] = np.zeros((2, 0, 4), F32), np.zeros((2, 0, 5), F32), None
    expect_error(a, INVALID, "output", "must equal")  # output shape before C == 0


@pytest.mark.parametrize("name", ["weight", "bias", "mean", "invstd"])
def test_channel_params_must_be_1d_of_size_c(name):
    a = make()
    a[name] = a[name].reshape(1, 3)
    expect_error(a, INVALID, name, "1-D")
    a = make()
    a[name] = np.ones(4, F32)
    expect_error(a, INVALID, name, "[C] = [3]")


def test_all_rank_checks_come_before_size_checks():
    a = make()
    a["weight"], a["invstd"] = np.ones(5, F32), np.ones((3, 1), F32)
    expect_error(a, INVALID, "invstd", "1-D")


def test_empty_input_succeeds_with_no_kernel_and_leaves_output_untouched():
    for soc in SOCS + ("Ascend910",):
        a = make((0, 3, 4), out_dtype=F16)  # another output dtype is not caught when empty
        ex = run(a, soc=soc)
        assert ex.graph.nodes == [] and ex.workspace_size == 0


def test_output_dtype_other_than_input_passes_checks_and_fails_at_viewcopy():
    for soc in SOCS:
        a = make(out_dtype=F16)
        a["output"] = np.full((2, 3, 4, 5), 7, F16)
        expect_error(a, INNER_NULLPTR, "an l0 op returned NULL", "ViewCopy", soc=soc)


@pytest.mark.parametrize("soc", ["Ascend310P", "Ascend310B"])
def test_socs_without_the_kernel_fail_after_the_checks(soc):
    expect_error(make(), NO_KERNEL, "BNInfer has no kernel on " + soc, soc=soc)
    a = make(dtype=BF16)
    expect_error(a, INVALID, "input", "BF16", soc=soc)


def test_ascend910_models_ranks_2_to_4_and_refuses_the_transpose_path():
    run(make((2, 3, 4, 5)), soc="Ascend910")
    run(make((2, 3)), soc="Ascend910")
    expect_error(make((2, 3, 2, 2, 2)), NO_KERNEL, "input", "Transpose", soc="Ascend910")


def test_python_level_bad_arguments_are_161002():
    with opgraph.platform("Ascend910B"):
        a = make()
        st, _, ex = aclnnBatchNormElemtGetWorkspaceSize(*[tens(a[n]) for n in NAMES[:5]], "1e-5",
                                                        tens(a["output"]))
    assert st == INVALID and ex is None and "eps" in aclnn.aclGetRecentErrMsg()


# the l0 graph, op by op
def ops(ex):
    return [n.op for n in ex.graph.nodes]


PREFIX = ["Contiguous", "Contiguous", "Mul", "OnesLike", "Div", "ConvertToTensor", "Sub",
          "Contiguous", "Contiguous", "Contiguous"]
RESIZE_1D = ["Contiguous", "Cast", "UnsqueezeNd", "ReFormat"]
REGBASE = ["Contiguous", "Cast", "Contiguous", "Cast", "Contiguous", "Contiguous", "Cast",
           "Contiguous", "Cast", "BatchNormV3", "Cast"]


@pytest.mark.parametrize("soc", B910)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_910b_graph(soc, dtype):
    with opgraph.opt_level(0):
        ex = run(make(dtype=dtype), eps=0.1, soc=soc)
    assert ops(ex) == PREFIX + RESIZE_1D * 4 + ["BNInfer", "ViewCopy"]
    g = ex.graph.nodes
    d = DataType.FLOAT if dtype is F32 else DataType.FLOAT16 if dtype is F16 else DataType.BF16
    assert g[1].inputs[0].name == "invstd" and g[2].inputs == [g[1].outputs[0]] * 2
    assert g[5].attrs.value == float(F32(0.1)) and g[5].attrs.dtype == d and g[5].outputs[0].shape == ()
    assert [v.dtype for v in g[6].outputs] == [d]  # the variance lives in invstd's dtype
    assert [g[k].inputs[0].name for k in (7, 8, 9)] == ["weight", "bias", "mean"]
    for k in range(4):
        cast, unsq, ref = g[11 + 4 * k], g[12 + 4 * k], g[13 + 4 * k]
        assert cast.attrs.to == DataType.FLOAT and unsq.attrs.dims == (0, 2, 3)
        assert str(ref.outputs[0].type) == "f32[1,3,1,1]@NCHW"
    assert g[26].inputs[0] is g[0].outputs[0] and g[26].inputs[4] is g[25].outputs[0]
    assert g[22].inputs[0] is g[6].outputs[0]  # the rebuilt variance → ResizeFrom1D → BNInfer
    assert g[26].attrs.eps == float(F32(0.1)) and g[26].outputs[0].dtype == d


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_950_graph(dtype):
    with opgraph.opt_level(0):
        ex = run(make(dtype=dtype), eps=0.1, soc=A950)
    assert ops(ex) == PREFIX + REGBASE + ["ViewCopy"]
    bn = ex.graph.nodes[19]
    assert bn.attrs.eps == float(F32(0.1)) and bn.attrs.momentum == 0.0 and not bn.attrs.training
    assert [v.shape for v in bn.inputs[1:]] == [(3,)] * 4  # no ResizeFrom1D on 950


def test_null_weight_and_bias_are_float_fills_before_the_variance():
    for soc in (B910[0], A950):
        with opgraph.opt_level(0):
            ex = run(make(dtype=F16, weight=False, bias=False), soc=soc)
        fills = ex.graph.nodes[1:3]
        assert [(n.op, n.attrs.value, n.attrs.dtype, n.attrs.shape) for n in fills] == \
            [("Fill", 1.0, DataType.FLOAT, (3,)), ("Fill", 0.0, DataType.FLOAT, (3,))]
        assert ops(ex)[3:5] == ["Contiguous", "Mul"]


@pytest.mark.parametrize("case,weight,wb,run_t", [
    (dict(dtype=F16), None, F16, F16),
    (dict(dtype=F16, weight=False), None, F32, F32),              # the FLOAT fill forces FLOAT
    (dict(dtype=F16, sdtype=F32), None, F16, F32),
    (dict(dtype=F32, sdtype=F16), None, F32, F32),
    (dict(dtype=BF16), None, BF16, BF16),
    (dict(dtype=BF16), F16, F32, F32),                            # PromoteType(f16, bf16) = f32
])
def test_950_promotion_of_weight_bias_and_running_stats(case, weight, wb, run_t):
    a = make(**case)
    if weight is not None:
        a["weight"] = a["weight"].astype(weight)
    with opgraph.opt_level(0):
        ex = run(a, soc=A950)
    bn = next(n for n in ex.graph.nodes if n.op == "BatchNormV3")
    assert [v.dtype.np for v in bn.inputs[1:]] == [np.dtype(wb)] * 2 + [np.dtype(run_t)] * 2
    assert ex.graph.nodes[-2].attrs.to.np == np.dtype(case["dtype"])  # Cast(y → input dtype)


@pytest.mark.parametrize("shape,x_shape,dims", [((2, 3), (2, 3, 1, 1), (0, 2, 3)),
                                                ((2, 3, 4), (2, 3, 4, 1), (0, 2, 3)),
                                                ((2, 3, 2, 2, 2), (2, 3, 2, 2, 2), (0, 2, 3, 4)),
                                                ((2, 3, 2, 1, 2, 3, 1, 2), (2, 3, 2, 1, 12), (0, 2, 3, 4))])
def test_ranks_are_viewed_as_4d_or_5d_and_back(shape, x_shape, dims):
    for soc in (B910[0], A950):
        with opgraph.opt_level(0):
            ex = run(make(shape), soc=soc)
        g = ex.graph.nodes
        bn = next(n for n in g if n.op in ("BNInfer", "BatchNormV3"))
        assert bn.inputs[0].shape == x_shape
        fmt = "NCDHW" if len(shape) > 5 else "NCHW" if len(shape) < 4 else "ND"
        assert bn.inputs[0].type.format.name == fmt
        if soc in B910:
            assert {n.attrs.dims for n in g if n.op == "UnsqueezeNd"} == {dims}
        back = ["Reshape", "ReFormat"] if len(shape) not in (4, 5) else [bn.op if soc in B910 else "Cast"]
        assert ops(ex)[-1 - len(back):] == back + ["ViewCopy"]
        assert ("Reshape" in ops(ex)) == (len(shape) not in (4, 5))
        assert g[-1].inputs[0].shape == shape


@pytest.mark.parametrize("soc", [B910[0], A950])
def test_level1_launches_what_cann_launches(soc):
    for weight, want in ((True, 5), (False, 7)):
        with opgraph.opt_level(0):
            ex = run(make(weight=weight, bias=weight), soc=soc)
        g1 = passes.optimize(ex.graph, 1)
        kernel = "BatchNormV3" if soc == A950 else "BNInfer"
        launched = [n.op for n in g1.nodes if not n.opdef.is_free(n)]
        assert sorted(launched) == sorted(["Fill"] * (want - 5) + ["Mul", "OnesLike", "Div", "Sub", kernel])
        assert passes.graph_stats(g1).launches == want
        assert next(n for n in g1.nodes if n.op == "ViewCopy").attrs.redirect
    with opgraph.opt_level(0):
        ex = run(make(dtype=F16, sdtype=F32), soc=soc)
    casts = [n for n in passes.optimize(ex.graph, 1).nodes if n.op == "Cast"]
    assert len(casts) == (0 if soc == A950 else 2)  # 950: w/b stay f16, mean/var f32; 910B: w/b → f32


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 2, 2, 2)])
@pytest.mark.parametrize("soc", [B910[0], A950])
def test_level2_is_one_fused_kernel_storing_into_the_output(shape, soc):
    for out in (None, np.zeros(shape[:-1] + (2 * shape[-1],), F32)[..., ::2]):
        a = make(shape, weight=False)
        if out is not None:
            a["output"] = out
        with opgraph.opt_level(2):
            ex = run(a, soc=soc)
        nodes = ex.compiled.nodes
        assert [n.op for n in nodes] == ["FusedElementwise"] and nodes[0].attrs.store
        assert nodes[0].inputs[-1].name == "output" and ex.workspace_size == 0


# numerics: independent float32 models written here
def round_f32(fr: Fraction) -> np.float32:
    """``fr`` rounded to float32, to nearest, ties to even (checked against the neighbours)."""
    f = F32(float(fr))
    if not np.isfinite(f):
        return f
    near = [f, np.nextafter(f, F32(np.inf)), np.nextafter(f, F32(-np.inf))]
    return min(near, key=lambda c: (abs(Fraction(float(c)) - fr), int(u(c)) & 1))


def fma32(a, b, c) -> np.float32:
    """a·b + c with one rounding to float32 (exact rational arithmetic)."""
    a, b, c = F32(a), F32(b), F32(c)
    exact = None
    if np.isfinite(a) and np.isfinite(b) and np.isfinite(c):
        exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if exact is None or exact == 0:  # IEEE specials and signed zeros: float64 is exact here
        return F32(np.float64(a) * np.float64(b) + np.float64(c))
    return round_f32(exact)


def nr_rstd(var, eps) -> np.float32:
    """ComputeRstdNewtonRaphsonReg step by step, in float32 scalars."""
    with np.errstate(all="ignore"):
        v = np.maximum(F32(var) + F32(eps), F32(-99.99))
        r = F32(1) / v
        y = np.sqrt(r)
        t = (v * F32(-0.5)) * y
        rstd = y * fma32(t, y, F32(1.5))
        s = fma32(v * F32(-1), r, F32(1))
        r = fma32(rstd * F32(-1), rstd, r)
        s = fma32(v, r, s) * rstd
        rstd = fma32(s, F32(0.5), rstd)
    return F32(0) if v == np.inf else F32(np.inf) if v == 0 else rstd


def v3_rstd(var, eps):
    """BatchNormV3's rstd as y with x − mean = 1, w = 1, b = 0 (both steps exact)."""
    C = len(var)
    x = np.ones((1, C, 1, 1), F32)
    ones, zeros = np.ones(C, F32), np.zeros(C, F32)
    with np.errstate(all="ignore"):
        y = BatchNormV3.compute([x, ones, zeros, zeros, F32(var)], BatchNormV3.make_attrs(eps=eps))
    return y[0].ravel()


def test_batchnormv3_newton_raphson_rstd_bits():
    rng = np.random.default_rng(5)
    var = np.concatenate([10.0 ** rng.uniform(-38, 38, 500), rng.uniform(0, 4, 200),
                          [0, -1e-5, 1e-45, 3e38, 3.4028235e38, np.inf, -1, -200, np.nan]]).astype(F32)
    for eps in (0.0, 1e-5):
        got = v3_rstd(var, eps)
        want = np.array([nr_rstd(v, eps) for v in var], F32)
        assert same_bits(got, want)
    finite = (var > 1e-30) & (var < 1e30)  # the method is within 1 ulp of 1/sqrt in float64
    exact = (1 / np.sqrt(var[finite].astype(np.float64) + F32(1e-5))).astype(F32)
    assert np.abs(u(got[finite]).astype(np.int64) - u(exact).astype(np.int64)).max() <= 1


def rnd(x, dtype):
    """One IEEE rounding of a float64 result to ``dtype`` (exact ops on narrower floats)."""
    return np.asarray(x, np.float64).astype(dtype)


def model_var(invstd, eps):
    """var = 1/(invstd·invstd) − eps, every step rounded to invstd's dtype."""
    d = invstd.dtype
    with np.errstate(all="ignore"):
        sq = rnd(invstd.astype(np.float64) ** 2, d)
        var = rnd(1 / sq.astype(np.float64), d)
        return rnd(var.astype(np.float64) - F32(eps).astype(d).astype(np.float64), d)


def model_y(a, eps, soc):
    """The whole op in float32 steps: 950 = Newton-Raphson rstd, ((x − m)·w)·rstd + b; 910B =
    BNInfer's stated order, rstd = 1/sqrt(var + eps), ((x − m)·rstd)·w + b."""
    x = a["input"]
    C, bs = x.shape[1], (1, x.shape[1]) + (1,) * (x.ndim - 2)
    f = lambda k, d: (a[k] if a[k] is not None else np.full(C, d, F32)).astype(F32).reshape(bs)  # noqa: E731
    w, b, m = f("weight", 1), f("bias", 0), f("mean", 0)
    var = model_var(a["invstd"], eps).astype(F32)
    with np.errstate(all="ignore"):
        if soc == A950:
            rstd = np.array([nr_rstd(v, eps) for v in var], F32).reshape(bs)
            y = ((x.astype(F32) - m) * w) * rstd + b
        else:
            rstd = (F32(1) / np.sqrt(var + F32(eps))).reshape(bs)
            y = ((x.astype(F32) - m) * rstd) * w + b
    return y.astype(x.dtype)


CASES = [dict(dtype=F32), dict(dtype=F16), dict(dtype=BF16), dict(dtype=F16, sdtype=F32),
         dict(dtype=BF16, weight=False, bias=False), dict(dtype=F32, sdtype=BF16, bias=False)]


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_bits_against_the_independent_model(soc, case, level):
    a = make((3, 4, 5, 6), seed=3, **case)
    run(a, eps=0.05, soc=soc)
    assert same_bits(a["output"], model_y(a, 0.05, soc))


BOUNDS = {F32: 2.0 ** -20, F16: 2.0 ** -8, BF16: 2.0 ** -6}  # × (|x − m|·|invstd|·|w| + |b|)


@pytest.mark.parametrize("soc", [B910[0], A950])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_against_float64_within_the_stated_bound(soc, dtype):
    """var in invstd's dtype (3 roundings), rstd, 4 float32 steps and the final rounding: the
    error stays below BOUNDS[dtype] times the magnitude of the terms."""
    a = make((4, 8, 6, 7), dtype=dtype, seed=9)
    run(a, soc=soc)
    f = {k: a[k].astype(np.float64) for k in NAMES}
    bs = (1, 8, 1, 1)
    ch = {k: f[k].reshape(bs) for k in ("weight", "bias", "mean", "invstd")}
    want = (f["input"] - ch["mean"]) * ch["invstd"] * ch["weight"] + ch["bias"]
    scale = np.abs(f["input"] - ch["mean"]) * ch["invstd"] * ch["weight"] + np.abs(ch["bias"])
    assert np.all(np.abs(f["output"] - want) <= BOUNDS[dtype] * scale)


@pytest.mark.parametrize("soc", SOCS)
def test_negative_invstd_acts_as_its_absolute_value(soc):
    a = make(dtype=F16)
    b = make(dtype=F16) | {"invstd": -a["invstd"]}
    run(a, soc=soc)
    run(b, soc=soc)
    assert same_bits(a["output"], b["output"])
    assert not same_bits(a["output"], np.zeros_like(a["output"]))


def test_variance_is_rebuilt_in_invstd_dtype_with_eps_rounded_to_it():
    """f16 invstd 3 with float32 data, eps 0.1: 1/9 and 0.1 are rounded to f16 before
    rsqrt(var + eps), so the effective invstd is 3.0000367 (a float32 rebuild gives 3)."""
    a = {"input": np.ones((1, 1, 1, 1), F32), "weight": np.ones(1, F32), "bias": np.zeros(1, F32),
         "mean": np.zeros(1, F32), "invstd": np.full(1, 3, F16), "output": np.zeros((1, 1, 1, 1), F32)}
    var16 = (F16(1) / F16(9)) - F16(0.1)  # f16 arithmetic rounds once per step
    var32 = (F32(1) / F32(9)) - F32(0.1)
    for soc in (B910[0], A950):
        run(a, eps=0.1, soc=soc)
        rsqrt = (lambda v: F32(1) / np.sqrt(F32(v) + F32(0.1))) if soc != A950 else \
            (lambda v: nr_rstd(v, 0.1))
        got = a["output"].ravel()[0]
        assert u(got) == u(rsqrt(var16)) and got != rsqrt(var32) and abs(got - 3.0000367) < 1e-6


@pytest.mark.parametrize("soc", [B910[0], A950])
def test_nan_and_inf(soc):
    a = make((2, 3, 2, 2))
    a["input"][0, 0, 0, 0], a["input"][1, 2, 1, 1] = np.nan, np.inf
    a["invstd"][:] = [0.0, np.inf, 1.0]  # var = inf → rstd 0; var = −eps → v = 0 → rstd inf
    a["mean"][:] = [0.0, 0.25, 0.0]
    a["input"][0, 1, 0, 0] = 0.25  # x − m = 0 with rstd inf → NaN
    run(a, soc=soc)
    y = a["output"]
    assert np.isnan(y[0, 0, 0, 0]) and np.isinf(y[1, 2, 1, 1])
    finite = np.isfinite(a["input"][:, 0])
    assert np.array_equal(y[:, 0][finite], np.broadcast_to(a["bias"][0], y[:, 0].shape)[finite])
    c1 = a["input"][:, 1] - F32(0.25)
    assert np.isnan(y[0, 1, 0, 0]) and np.all(np.isinf(y[:, 1][c1 != 0]))
    assert np.all(np.sign(y[:, 1][c1 != 0]) == np.sign(c1[c1 != 0] * a["weight"][1]))


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 2, 3), (1, 3, 2, 1, 2), (2, 3, 1, 2, 3, 2),
                                   (1, 3, 2, 1, 1, 2, 2), (1, 3, 1, 2, 1, 1, 2, 2)])
def test_ranks_2_to_8(shape):
    for soc in (B910[0], A950):
        a = make(shape, dtype=F16, seed=len(shape))
        run(a, soc=soc)
        assert same_bits(a["output"], model_y(a, 1e-5, soc))


@pytest.mark.parametrize("soc", [B910[0], A950])
def test_strided_inputs_and_outputs_equal_the_contiguous_result(soc, level):
    a = make((2, 3, 4, 5), dtype=F16, seed=4)
    run(a, soc=soc)
    b = dict(a)
    b["input"] = np.ascontiguousarray(a["input"].transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    b["mean"] = np.repeat(a["mean"], 2)[::2]
    b["invstd"] = np.repeat(a["invstd"], 3)[1::3]
    buf = np.full((2, 3, 4, 10), 9, F16)
    b["output"] = buf[..., ::2]
    run(b, soc=soc)
    assert same_bits(b["output"], a["output"]) and np.all(buf[..., 1::2] == 9)


@pytest.mark.parametrize("soc", [B910[0], A950])
@pytest.mark.parametrize("case", [dict(dtype=F32), dict(dtype=F16, weight=False),
                                  dict(dtype=BF16, sdtype=F32), dict(shape=(2, 3, 5)),
                                  dict(shape=(2, 3, 1, 2, 2, 2), dtype=F16)], ids=str)
def test_levels_give_identical_bits(soc, case):
    outs = []
    for lv in (0, 1, 2):
        a = make(seed=8, **case)
        with opgraph.opt_level(lv):
            run(a, soc=soc)
        outs.append(a["output"])
    assert same_bits(outs[0], outs[1]) and same_bits(outs[0], outs[2])


def test_backend_kit_numpy():
    report = check_backend("numpy", op_apis=["aclnnBatchNormElemt"])
    assert report.ok and report.cases > 0, str(report)


# Pythonic API and CLI
def test_pythonic_api():
    a = make((2, 3, 4), dtype=F16)
    y = batch_norm_elemt(a["input"], a["weight"], None, a["mean"], a["invstd"], 1e-5)
    assert y.dtype == F16 and same_bits(y, model_y(a | {"bias": None}, 1e-5, B910[0]))
    buf = np.zeros((2, 3, 8), F16)
    got = batch_norm_elemt(a["input"], a["weight"], None, a["mean"], a["invstd"], 1e-5, out=buf[..., ::2])
    assert got.base is buf and same_bits(got, y) and np.all(buf[..., 1::2] == 0)
    with pytest.raises(opgraph.AclnnError) as e:
        batch_norm_elemt(a["input"], a["weight"], None, None, a["invstd"], 1e-5, out=buf[..., ::2])
    assert e.value.status == INVALID and "mean" in str(e.value) and same_bits(buf[..., ::2], y)
    with pytest.raises(opgraph.AclnnError) as e:
        batch_norm_elemt(None, None, None, a["mean"], a["invstd"], 1e-5)
    assert e.value.status == INVALID and "input" in str(e.value)


@pytest.mark.parametrize("cmd", ["run", "dump", "plan", "emit-c", "emit-cpp"])
def test_cli_commands_work_or_fail_in_one_line(cmd, capsys):
    argv = [cmd, "aclnnBatchNormElemt", "--shape", "2,3,4,5", "--dtype", "float16", "--no-bias"]
    if cmd == "emit-cpp":
        argv += ["-o", "/dev/null"]
    code = cli_main(argv)
    out, err = capsys.readouterr()
    if code == 0:
        assert out
        if cmd == "run":
            assert float(out.split("max rel error: ")[1].split()[0]) < 2.0 ** -9
        if cmd == "dump":
            assert "ConvertToTensor" in out and "BNInfer" in out
    else:
        assert err.count("\n") == 1 and err.startswith("opgraph: "), err
    code = cli_main(["dump", "aclnnBatchNormElemt", "--platform", "Ascend950", "--eps", "0.5"])
    out, _ = capsys.readouterr()
    assert code == 0 and "BatchNormV3" in out and "value=0.5" in out


@pytest.mark.parametrize("shape", [(2, 3, 4, 5, 6, 7, 8), (2, 3, 2, 3, 4, 5, 6, 7)])
@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_ranks_7_and_8_at_level_2_run_in_chunks_or_whole_bit_equal_to_level_0(shape, backend):
    """The 910B folds the trailing dims into one (ResizeFromND): the fused body views its input
    into a lower-rank iteration space larger than one chunk, which must still run."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32)
    c = [(rng.random(3) + 0.5).astype(np.float32) for _ in range(4)]
    got = {}
    for level in (0, 2):
        out = np.zeros_like(x)
        with opgraph.platform("Ascend910B"), opgraph.opt_level(level), opgraph.use_backend(backend):
            st, ws, ex = aclnnBatchNormElemtGetWorkspaceSize(*map(opgraph.tensor, (x, *c)), 1e-5, opgraph.tensor(out))
            assert st == 0 and aclnnBatchNormElemt(bytearray(ws) if ws else None, ws, ex) == 0, aclnn.aclGetRecentErrMsg()
        got[level] = out
    assert np.array_equal(got[0].view(np.uint32), got[2].view(np.uint32))
    ch = lambda v: v.reshape(1, 3, *[1] * (len(shape) - 2)).astype(np.float64)
    want = (x - ch(c[2])) * ch(c[3]) * ch(c[0]) + ch(c[1])  # (x - mean) * invstd * weight + bias
    assert np.allclose(got[2], want, rtol=1e-5, atol=1e-5)
