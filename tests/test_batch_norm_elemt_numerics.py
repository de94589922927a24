"""aclnnBatchNormElemt's numerics: BatchNormV3's Newton-Raphson rstd and the whole 950 path bit for
bit against an independent float32 model written here, BNInfer bit for bit against its stated
formula, both SoC families against float64 within stated bounds, |invstd|, the variance rebuilt
in invstd's dtype, NaN/Inf, ranks 2-8, strides, levels, the backend kit and the Pythonic API
(the checks and graphs: test_batch_norm_elemt.py)."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import opgraph
from l0ops.bninfer import BatchNormV3
from opgraph import aclnn
from opgraph.aclnn.batch_norm_elemt import (aclnnBatchNormElemt, aclnnBatchNormElemtGetWorkspaceSize,
                                            batch_norm_elemt)
from opgraph.cli import main as cli_main
from opgraph.testing import check_backend
from test_batch_norm_elemt import A950, B910, BF16, F16, F32, INVALID, NAMES, SOCS, make, phase1, run, same_bits, u


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
    # 1e36..3e38: 1/v is near the float32 normal floor there, and the rounding of one step
    # (an fma rather than a multiply and an add) survives the later refinements in ~0.25% of them
    huge = 10.0 ** np.random.default_rng(6).uniform(36, 38.5, 1500)
    var = np.concatenate([10.0 ** rng.uniform(-38, 38, 500), rng.uniform(0, 4, 200), huge,
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
def test_f16_invstd_of_256_or_more_overflows_the_variance_rebuild(soc):
    """The vendor's behaviour, not a bug here: ELT:174-187 squares invstd in its own dtype, so an
    f16 invstd ≥ 256 (a variance below ~1.5e-5, e.g. batch_norm_stats of a near-constant channel)
    gives invstd² = inf, var = 1/inf − f16(eps) = −1.0014e-5, and var + f32(eps) < 0: rsqrt is
    NaN and so is every output of the channel. The same invstd as float32 gives the formula's value."""
    a = {"input": np.float16([[1.0, 1.0], [3.0, 3.0]]), "weight": None, "bias": None,
         "mean": np.float16([2.0, 2.0]), "invstd": np.float16([300.0, 200.0]),
         "output": np.zeros((2, 2), F16)}
    assert F16(300).astype(np.float64) ** 2 > np.finfo(F16).max > F16(200).astype(np.float64) ** 2
    run(a, eps=1e-5, soc=soc)
    assert np.isnan(a["output"][:, 0]).all()
    assert np.allclose(a["output"][:, 1].astype(np.float64), [-200.0, 200.0], rtol=2e-3)
    b = dict(a, invstd=np.float32([300.0, 200.0]), output=np.zeros((2, 2), F16))
    run(b, eps=1e-5, soc=soc)
    assert np.allclose(b["output"].astype(np.float64), [[-300, -200], [300, 200]], rtol=2e-3)


@pytest.mark.parametrize("shape,fmt", [((2, 3, 4, 3), "NHWC"), ((2, 3, 2, 2, 3), "NDHWC")])
def test_950_takes_the_last_dim_of_an_nhwc_input_as_the_channel(shape, fmt, level):
    """Ascend950's BatchNormV3 inference tilings read C from the last dim of NHWC / NDHWC
    (batch_norm_v3_tiling_infer_last_channel_arch35.cpp:199-211; the infer template refuses
    those formats, batch_norm_v3_tiling_infer_arch35.cpp:198-227), while aclnnBatchNormElemt
    checks the [C] parameters against dim 1 (ELT:85-114): with the two dims equal, parameter c
    applies to x[..., c]. 910B keeps dim 1 (BNInfer, prebuilt: nothing says otherwise)."""
    a = make(shape, seed=4)
    want = {}
    for axis, soc in ((len(shape) - 1, A950), (1, B910[0])):
        bs = tuple(n if d == axis else 1 for d, n in enumerate(shape))
        ch = {k: a[k].astype(np.float64).reshape(bs) for k in ("weight", "bias", "mean", "invstd")}
        want[soc] = (a["input"] - ch["mean"]) * ch["invstd"] * ch["weight"] + ch["bias"]
    assert np.abs(want[A950] - want[B910[0]]).max() > 0.1
    for soc in (A950, B910[0]):
        b = make(shape, seed=4)
        run(b, soc=soc, fmt=fmt)
        np.testing.assert_allclose(b["output"], want[soc], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,fmt", [((2, 3, 4, 5), "NHWC"), ((2, 3, 2, 2, 4), "NDHWC")])
def test_950_nhwc_input_whose_last_dim_is_not_c_is_refused(shape, fmt):
    """The last-channel kernel would read [last-dim] parameters from [C] buffers: no vendor check
    stops it (BatchNormV3's infershape copies shapes, its tiling checks only ranks), so what runs
    is undetermined → 561002 naming input, the output untouched."""
    a = make(shape)
    before = a["output"].tobytes()
    st, _, _, msg = phase1(a, soc=A950, fmt=fmt)
    assert st == 561002 and msg.split("): ")[1].startswith("input:") and "out of bounds" in msg
    assert a["output"].tobytes() == before
    run(make(shape), soc=B910[0], fmt=fmt)  # 910B: channel = dim 1, runs


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
