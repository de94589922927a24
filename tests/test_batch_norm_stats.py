"""aclnnBatchNormStats (ops-math math/reduce_std_with_mean): the check table, the level-0 graph
per SoC, numerics against implementations written here, levels, the backend kit and the CLI.

Expected values never come from opgraph: bit tests re-derive each SoC's float32 op order with
plain numpy on data whose sums are exact in any order (so the kernels' unpublished summation
order cannot matter); everything else is bounded against a float64 formula, bounds stated.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import aclnn
from opgraph.aclnn.batch_norm_stats import (aclnnBatchNormStats, aclnnBatchNormStatsGetWorkspaceSize,
                                            batch_norm_stats)
from opgraph.cli import main
from opgraph.passes import graph_stats, optimize
from opgraph.testing import check_backend

F16, F32, BF16 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
NULLPTR, INVALID, NO_KERNEL = 161001, 161002, 561003
SUPPORTED = ("Ascend910B", "Ascend910_93", "Ascend950", "Ascend910")
MEMBASE = ("Ascend910B", "Ascend910_93", "Ascend910")  # IsRegBase() false: ReduceStdWithMean path
U = 2.0 ** -24  # float32 unit roundoff
SENTINEL = 0x5A


# --- harness ---------------------------------------------------------------------------------
def sentinel(n: int) -> np.ndarray:
    return np.full(4 * n, SENTINEL, np.uint8).view(np.float32)


def wrap(a):
    return a if a is None or isinstance(a, opgraph.Tensor) else opgraph.tensor(a)


def phase1(x, mean, invstd, eps=1e-5, soc="Ascend910B", level=0):
    with opgraph.platform(soc), opgraph.opt_level(level):
        st, ws, ex = aclnnBatchNormStatsGetWorkspaceSize(wrap(x), eps, wrap(mean), wrap(invstd))
    return int(st), ws, ex, aclnn.aclGetRecentErrMsg()


def stats(x, eps=1e-5, soc="Ascend910B", level=0, mean=None, invstd=None):
    """Both phases; returns the (mean, invstd) arrays written."""
    C = x.shape[1]
    mean = np.zeros(C, np.float32) if mean is None else mean
    invstd = np.zeros(C, np.float32) if invstd is None else invstd
    st, ws, ex, msg = phase1(x, mean, invstd, eps, soc, level)
    assert st == 0, msg
    assert int(aclnnBatchNormStats(bytearray(ws) if ws else None, ws, ex)) == 0
    return mean, invstd


def channel_axes(x) -> tuple[int, ...]:
    return tuple(d for d in range(x.ndim) if d != 1)


def ref64(x, eps):
    """float64: mean = Σx/n, invstd = 1/sqrt(Σ(x − mean)²/n + eps) over every dim but 1."""
    x = np.asarray(x).astype(np.float64)
    ax = channel_axes(x)
    with np.errstate(invalid="ignore"):  # inf − inf in the NaN/Inf test
        mean = x.mean(axis=ax, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=ax)
    return mean.reshape(-1), 1.0 / np.sqrt(var + eps)


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


# --- 1. the check table ----------------------------------------------------------------------
def good(shape=(2, 3, 4)):
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    return {"x": x, "mean": sentinel(shape[1]), "invstd": sentinel(shape[1])}


def named(msg: str) -> str:
    """The argument a message names: 'ACLNN_ERR_... (code): <name>: <rule>'."""
    return msg.split(": ", 2)[1]


def outputs_bytes(args) -> list:
    return [None if args[k] is None else wrap(args[k]).storage.tobytes() for k in ("mean", "invstd")]


def expect_error(args, status, name, *words, soc="Ascend910B"):
    before = outputs_bytes(args)
    st, ws, ex, msg = phase1(args["x"], args["mean"], args["invstd"], args.get("eps", 1e-5), soc)
    assert st == status, msg
    assert ex is None and ws == 0
    assert named(msg) == name, f"message should name {name} first: {msg!r}"
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert outputs_bytes(args) == before, "an output was written by a failing call"


def with_(**kw):
    a = good()
    a.update(kw)
    return a


PRIVATE = "NC1HWC0"
CHECK_TABLE = [  # (case, args, status, named argument, words in the message)
    ("null input", with_(x=None), NULLPTR, "input", ("NULL",)),
    ("null mean", with_(mean=None), NULLPTR, "mean", ("NULL",)),
    ("null invstd", with_(invstd=None), NULLPTR, "invstd", ("NULL",)),
    ("null before dtype", with_(x=np.zeros((2, 3), np.int32), invstd=None), NULLPTR, "invstd", ()),
    ("input int32", with_(x=np.zeros((2, 3), np.int32)), INVALID, "input", ("INT32",)),
    ("input bf16 not regbase", with_(x=np.zeros((2, 3), BF16)), INVALID, "input", ("BF16",)),
    ("input float64", with_(x=np.zeros((2, 3), np.float64)), INVALID, "input", ("DOUBLE",)),
    ("mean f16", with_(mean=np.zeros(3, F16)), INVALID, "mean", ("FLOAT16",)),
    ("invstd bf16", with_(invstd=np.zeros(3, BF16)), INVALID, "invstd", ("BF16",)),
    ("dtype before format", with_(x=opgraph.tensor(np.zeros((2, 3), np.float32), PRIVATE),
                                  mean=np.zeros(3, F16)), INVALID, "mean", ("FLOAT16",)),
    ("input private", with_(x=opgraph.tensor(np.zeros((2, 3, 4, 4), np.float32), PRIVATE)),
     INVALID, "input", (PRIVATE,)),
    ("mean private", with_(mean=opgraph.tensor(np.zeros(3, np.float32), PRIVATE)), INVALID, "mean", (PRIVATE,)),
    ("invstd private", with_(invstd=opgraph.tensor(np.zeros(3, np.float32), PRIVATE)),
     INVALID, "invstd", (PRIVATE,)),
    ("format before shape", with_(x=np.zeros(3, np.float32),
                                  invstd=opgraph.tensor(np.zeros(3, np.float32), PRIVATE)),
     INVALID, "invstd", (PRIVATE,)),
    ("input rank 9", with_(x=np.zeros((1, 3) + (1,) * 7, np.float32)), INVALID, "input", ("greater than 8",)),
    ("input rank 1", with_(x=np.zeros(3, np.float32)), INVALID, "input", ("less than 2",)),
    ("input rank 0", with_(x=np.float32(1)), INVALID, "input", ("less than 2",)),
    ("input rank before mean rank", with_(x=np.zeros(3, np.float32), mean=np.zeros((1, 3), np.float32)),
     INVALID, "input", ("less than 2",)),
    ("mean rank 2", with_(mean=np.zeros((1, 3), np.float32)), INVALID, "mean", ("1-D",)),
    ("invstd rank 0", with_(invstd=np.float32(0)), INVALID, "invstd", ("1-D",)),
    ("mean rank before channel 0", with_(x=np.zeros((2, 0, 4), np.float32), mean=np.zeros((0, 1), np.float32)),
     INVALID, "mean", ("1-D",)),
    ("channel 0", with_(x=np.zeros((2, 0, 4), np.float32), mean=np.zeros(0, np.float32),
                        invstd=np.zeros(0, np.float32)), INVALID, "input", ("dim 1",)),
    ("channel 0 before mean shape", with_(x=np.zeros((2, 0, 4), np.float32)), INVALID, "input", ("dim 1",)),
    ("mean not [C]", with_(mean=np.zeros(4, np.float32)), INVALID, "mean", ("[3]",)),
    ("invstd not [C]", with_(invstd=np.zeros(2, np.float32)), INVALID, "invstd", ("[3]",)),
    ("eps not a number", with_(eps="1e-5"), INVALID, "eps", ()),
]


@pytest.mark.parametrize("case, args, status, name, words", CHECK_TABLE, ids=[c[0] for c in CHECK_TABLE])
def test_check_table(case, args, status, name, words):
    expect_error(args, status, name, *words)


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend910_93", "Ascend910"])
def test_bf16_input_only_on_regbase(soc):
    args = with_(x=np.zeros((2, 3), BF16))
    expect_error(args, INVALID, "input", "BF16", soc=soc)
    assert phase1(args["x"], args["mean"], args["invstd"], soc="Ascend950")[0] == 0


@pytest.mark.parametrize("soc", ["Ascend310P", "Ascend310B"])
def test_soc_without_kernels_is_561003_after_the_checks(soc):
    expect_error(with_(mean=np.zeros(3, F16)), INVALID, "mean", soc=soc)  # checks come first
    st, _, ex, msg = phase1(good()["x"], np.zeros(3, np.float32), np.zeros(3, np.float32), soc=soc)
    assert st == NO_KERNEL and ex is None and soc in msg and "ReduceStdWithMean" in msg
    # the empty-input path records only Fill kernels, which every SoC has: it succeeds
    mean, invstd = stats(np.zeros((0, 3), np.float32), soc=soc)
    assert (mean == 0).all() and np.isnan(invstd).all()


def test_read_only_output_is_refused_untouched():
    mean = np.zeros(3, np.float32)
    mean.flags.writeable = False
    st, _, ex, msg = phase1(good()["x"], mean, np.zeros(3, np.float32))
    assert st == INVALID and ex is None and named(msg) == "mean"


# --- 2. the level-0 graph, op by op ------------------------------------------------------------
MEMBASE_F32 = """\
  %0: f32[2,3,4,4] = Contiguous(%input)
  %1: f32[2,3,4,4] = Cast(%0, to=f32)
  %2: f32[2,3,4,4] = ReFormat(%1, format=ND)
  %3: f32[3] = ReduceMean(%2, axes=[0,2,3])
  %4: f32[3] = ViewCopy(%3, %mean)
  %5: f32[1,3,1,1] = UnsqueezeNd(%3, dims=[0,2,3])
  %6: f32[2,3,4,4] = BroadcastTo(%5, shape=[2,3,4,4])
  %7: f32[3] = ReduceStdWithMean(%2, %6, axes=[0,2,3], eps=0.25)
  %8: f32[3] = ViewCopy(%7, %invstd)"""
REGBASE_F32 = """\
  %0: f32[2,3,4,4] = Contiguous(%input)
  %1: f32[2,3,4,4] = Cast(%0, to=f32)
  %2: f32[2,3,4,4] = ReFormat(%1, format=ND)
  %3: f32[3], %4: f32[3] = ReduceVar(%2, axes=[0,2,3])
  %5: f32[] = ConvertToTensor(value=0.25, dtype=f32)
  %6: f32[3] = Add(%3, %5)
  %7: f32[] = ConvertToTensor(value=-0.5, dtype=f32)
  %8: f32[3] = Pow(%6, %7)
  %9: f32[3] = ViewCopy(%8, %invstd)
  %10: f32[3] = ViewCopy(%4, %mean)"""


def body(g) -> str:
    return "\n".join(str(g).splitlines()[1:-2])


def record(x, eps=0.25, soc="Ascend910B"):
    st, _, ex, msg = phase1(x, np.zeros(x.shape[1], np.float32), np.zeros(x.shape[1], np.float32), eps, soc)
    assert st == 0, msg
    return ex.graph


@pytest.mark.parametrize("soc", MEMBASE)
@pytest.mark.parametrize("dtype", [F32, F16])
def test_membase_graph(soc, dtype):
    g = record(np.zeros((2, 3, 4, 4), dtype), soc=soc)
    d = "f16" if dtype == F16 else "f32"
    want = MEMBASE_F32.replace("%0: f32", f"%0: {d}")
    assert body(g) == want
    assert [v.name for v in g.outputs] == ["4", "8"]  # mean copied first, then invstd
    rs = g.nodes[7].attrs
    assert (rs.correction, rs.keepdims, rs.invert) == (0, False, True)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_regbase_graph_copies_invstd_then_mean(dtype):
    g = record(np.zeros((2, 3, 4, 4), dtype), soc="Ascend950")
    d = {F32: "f32", F16: "f16", BF16: "bf16"}[dtype]
    assert body(g) == REGBASE_F32.replace("%0: f32", f"%0: {d}")
    var = g.nodes[3].attrs
    assert (var.correction, var.keepdims) == (0, False)


def test_eps_reaches_the_kernels_as_a_float():
    e = 0.1  # not a float32: the C++ casts the double to float
    x = np.zeros((2, 3), np.float32)
    assert record(x, e).nodes[-2].attrs.eps == float(np.float32(e)) != e
    consts = [n for n in record(x, e, "Ascend950").nodes if n.op == "ConvertToTensor"]
    assert [c.attrs.value for c in consts] == [float(np.float32(e)), -0.5]


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("rank", range(2, 9))
def test_axes_are_every_dim_but_1(soc, rank):
    shape = (2, 3) + (2,) * (rank - 2)
    g = record(np.zeros(shape, np.float32), soc=soc)
    axes = (0,) + tuple(range(2, rank))
    reduce = g.nodes[3]
    assert reduce.attrs.axes == axes and reduce.outputs[0].type.shape == (3,)
    if soc == "Ascend910B":
        assert g.nodes[5].attrs.dims == axes and g.nodes[5].outputs[0].type.shape == (1, 3) + (1,) * (rank - 2)
        assert g.nodes[6].attrs.shape == shape


def test_plain_format_input_is_reformatted_to_nd():
    g = record(opgraph.tensor(np.zeros((2, 3, 4, 4), np.float16), "NCHW"))
    assert str(g.nodes[1].outputs[0].type) == "f32[2,3,4,4]@NCHW"
    assert str(g.nodes[2]) == "%2: f32[2,3,4,4] = ReFormat(%1, format=ND)"


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_empty_input_fills_mean_0_then_invstd_nan(soc):
    g = record(np.zeros((2, 3, 0), np.float32), soc=soc)
    assert body(g) == """\
  %0: f32[3] = Fill(shape=[3], value=0.0)
  %1: f32[3] = ReFormat(%0, format=ND)
  %2: f32[3] = ViewCopy(%1, %mean)
  %3: f32[3] = Fill(shape=[3], value=nan)
  %4: f32[3] = ReFormat(%3, format=ND)
  %5: f32[3] = ViewCopy(%4, %invstd)"""


# --- 3. numerics ---------------------------------------------------------------------------------
def exact_case(C=48, seed=3) -> np.ndarray:
    """Integers in [-8, 8] with n = 32 elements per channel: every mean, x − mean (multiples of
    1/32) and (x − mean)²/32 (multiples of 2^-15, |·| ≤ 8) is a float32, and so is every partial
    sum (≤ 256 in steps of 2^-15: 23 bits) — the result cannot depend on the summation order."""
    return np.random.default_rng(seed).integers(-8, 9, (4, C, 2, 4)).astype(np.float32)


def exact_terms(x, scale_first: bool) -> tuple[np.ndarray, np.ndarray]:
    """(mean, var) in float32: mean = Σx·f32(1/n); var = Σ f32(f32(d·f32(1/n))·d) (950
    ReduceVar) or Σ f32(f32(d·d)·f32(1/n)) (910B ReduceStdWithMean); d = x − mean."""
    ax, n = channel_axes(x), x.size // x.shape[1]
    inv_n = np.float32(1.0 / n)
    s = x.astype(np.float64).sum(axis=ax)
    assert (s == s.astype(np.float32)).all()
    mean = s.astype(np.float32) * inv_n
    d = x - mean.reshape(1, -1, 1, 1)
    terms = (d * inv_n) * d if scale_first else (d * d) * inv_n
    var = terms.astype(np.float64).sum(axis=ax)
    assert (var == var.astype(np.float32)).all(), "the exact-sum premise broke"
    return mean, var.astype(np.float32)


@pytest.mark.parametrize("soc", SUPPORTED)
@pytest.mark.parametrize("eps", [1e-5, 0.1, 1.0 / 3.0, 0.0])
def test_bits_per_soc_order(soc, eps):
    """910B/910_93/910: sqrt(1/(var + eps)) (ReduceStdWithMean: reciprocal first); 950:
    1/sqrt(var + eps) (Add, then Pow(−0.5) = Sqrt then Div) — each step one float32 rounding."""
    x = exact_case()
    regbase = soc == "Ascend950"
    mean, var = exact_terms(x, scale_first=regbase)
    v = var + np.float32(eps)
    want = np.float32(1) / np.sqrt(v) if regbase else np.sqrt(np.float32(1) / v)
    got_mean, got_inv = stats(x, eps, soc)
    assert np.array_equal(bits(got_mean), bits(mean)) and np.array_equal(bits(got_inv), bits(want))


def test_the_two_families_differ_in_the_last_bit():
    x = exact_case()
    m1, i1 = stats(x, 0.1, "Ascend910B")
    m2, i2 = stats(x, 0.1, "Ascend950")
    assert np.array_equal(bits(m1), bits(m2))
    diff = np.abs(bits(i1).astype(np.int64) - bits(i2).astype(np.int64))
    assert diff.max() == 1 and (diff == 1).sum() >= 3  # sqrt(1/v) vs 1/sqrt(v): ±1 ulp


def bound(x) -> tuple[float, np.ndarray]:
    """Stated first-order bounds for n = elements per channel, R = min(n, 32768): |Δmean| ≤
    (R/64 + 10)·u·mean|x| (the fixed-order float32 sum, then × f32(1/n)); relative Δinvstd ≤
    (R/64 + 16 + 4·|mean|/std)·u (the variance sum, the rounded mean inside d, eps, the
    sqrt/reciprocal pair)."""
    x64 = x.astype(np.float64)
    ax, n = channel_axes(x), x.size // x.shape[1]
    g = min(n, 32768) / 64
    m, inv = ref64(x, 0.0)
    return (g + 10) * U * float(np.abs(x64).mean(axis=ax).max()), (g + 16 + 4 * np.abs(m) * inv) * U


def random_case(shape, dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    C = shape[1]
    b = (1, C) + (1,) * (len(shape) - 2)
    x = rng.standard_normal(shape) * rng.uniform(0.5, 2.0, C).reshape(b) + rng.normal(0, 1, C).reshape(b)
    return x.astype(dtype)


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("rank", range(2, 9))
def test_ranks_2_to_8_against_float64(soc, rank):
    shape = (5, 3) + (3, 2, 2, 1, 2, 3)[: rank - 2]
    for dtype in ([F32, F16, BF16] if soc == "Ascend950" else [F32, F16]):
        x = random_case(shape, dtype, rank)
        mean, invstd = stats(x, 1e-5, soc)
        m64, i64 = ref64(x, 1e-5)
        tol_mean, tol_inv = bound(x)
        assert mean.dtype == invstd.dtype == F32 and mean.shape == invstd.shape == (3,)
        assert np.abs(mean - m64).max() <= tol_mean
        assert (np.abs(invstd / i64 - 1) <= tol_inv).all()


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("shape", [(2, 3, 128, 160), (1000, 4)])  # 40960 > one 32768 block; 2-D
def test_large_reductions_against_float64(soc, shape):
    x = random_case(shape, F32, 7)
    mean, invstd = stats(x, 1e-3, soc)
    m64, i64 = ref64(x, 1e-3)
    tol_mean, tol_inv = bound(x)
    assert np.abs(mean - m64).max() <= tol_mean and (np.abs(invstd / i64 - 1) <= tol_inv).all()


@pytest.mark.parametrize("soc", SUPPORTED)
@pytest.mark.parametrize("shape", [(0, 3), (2, 3, 0), (0, 3, 0, 4)])
def test_empty_input_gives_zero_and_nan(soc, shape, level):
    mean, invstd = sentinel(3), sentinel(3)
    stats(np.zeros(shape, np.float16), 1e-5, soc, level, mean, invstd)
    assert np.array_equal(bits(mean), np.zeros(3, np.uint32)) and np.isnan(invstd).all()


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_nan_and_inf(soc):
    x = np.ones((4, 5, 3), np.float32) * np.arange(12, dtype=np.float32).reshape(4, 1, 3)
    x[1, 0, 2] = np.nan
    x[2, 1, 0] = np.inf
    x[0, 2, 1], x[3, 2, 2] = np.inf, -np.inf
    x[3, 3, 1] = -np.inf
    mean, invstd = stats(x, 1e-5, soc)
    m64, i64 = ref64(x, 1e-5)
    assert np.array_equal(np.isnan(mean), np.isnan(m64)) and np.array_equal(np.isnan(invstd), np.isnan(i64))
    assert mean[1] == np.inf and mean[3] == -np.inf and np.isnan(mean[[0, 2]]).all()
    assert np.isnan(invstd[:4]).all()
    assert abs(mean[4] - m64[4]) <= 8 * U * 6 and abs(invstd[4] / i64[4] - 1) <= 20 * U


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_eps_extremes(soc):
    x = np.full((3, 2), 5.0, np.float32)  # var = 0
    assert (stats(x, 0.0, soc)[1] == np.inf).all()       # 1/sqrt(0)
    assert np.isnan(stats(x, -1.0, soc)[1]).all()         # sqrt of a negative
    assert (stats(x, 1e300, soc)[1] == 0).all()           # (float)1e300 = inf
    assert (stats(x, 4.0, soc)[1] == 0.5).all()


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_non_contiguous_input_and_outputs(soc):
    base = random_case((3, 4, 5, 6), F32, 11)
    x = base[:, :, ::2, 1:]                               # strided view, offset 1
    assert not wrap(x).is_contiguous
    want_mean, want_inv = stats(np.ascontiguousarray(x), 1e-5, soc)
    mean_buf, inv_buf = sentinel(12), sentinel(8)
    mean, invstd = mean_buf[::3], inv_buf[1::2]
    stats(x, 1e-5, soc, mean=mean, invstd=invstd)
    assert np.array_equal(bits(mean), bits(want_mean)) and np.array_equal(bits(invstd), bits(want_inv))
    untouched = np.delete(mean_buf, np.arange(0, 12, 3)), inv_buf[0::2]
    assert all((bits(u) == 0x5A5A5A5A).all() for u in untouched)
    g = record(x, soc=soc)
    assert g.nodes[0].op == "Contiguous" and not g.nodes[0].opdef.is_free(g.nodes[0])


# --- 4. levels, launches, the backend kit, the Pythonic API, the CLI -----------------------------
@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_levels_0_1_2_identical_bits(soc, dtype):
    x = random_case((4, 5, 6, 7), dtype, 5)
    runs = [stats(x, 1e-5, soc, level) for level in (0, 1, 2)]
    for got in runs[1:]:
        assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(got, runs[0]))


def launched(x, soc) -> list[str]:
    g = optimize(record(x, soc=soc), 1)
    assert graph_stats(g).launches == len([n for n in g.nodes if not n.opdef.is_free(n)])
    return [n.op for n in g.nodes if not n.opdef.is_free(n)]


def test_level1_launches_fp32():
    """CANN launches ReduceMean, BroadcastTo, ReduceStdWithMean (910B) and ReduceVar, Add, Pow
    (950); the 0-d eps/exponent host tensors launch nothing. The 910B mean is redirected into
    ``mean`` though UnsqueezeNd reads it too, as CANN does."""
    x = np.zeros((2, 3, 4, 4), np.float32)
    assert launched(x, "Ascend910B") == ["ReduceMean", "BroadcastTo", "ReduceStdWithMean"]
    assert launched(x, "Ascend950") == ["ReduceVar", "Add", "Pow"]


def test_level1_launches_fp16_add_the_cast():
    x = np.zeros((2, 3, 4, 4), np.float16)
    assert launched(x, "Ascend910B") == ["Cast", "ReduceMean", "BroadcastTo", "ReduceStdWithMean"]
    assert launched(x, "Ascend950") == ["Cast", "ReduceVar", "Add", "Pow"]


def test_backend_kit_numpy():
    report = check_backend("numpy", op_apis=["aclnnBatchNormStats"])
    assert report.cases >= 4 * 2 * 3 * 2 and not report.failures, report


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_pythonic_batch_norm_stats(soc):
    x = random_case((6, 4, 5), F16, 2)
    with opgraph.platform(soc):
        mean, invstd = batch_norm_stats(x, 1e-5)
    assert mean.dtype == invstd.dtype == F32 and mean.shape == invstd.shape == (4,)
    m64, i64 = ref64(x, 1e-5)
    tol_mean, tol_inv = bound(x)
    assert np.abs(mean - m64).max() <= tol_mean and (np.abs(invstd / i64 - 1) <= tol_inv).all()


@pytest.mark.parametrize("bad, status, name", [
    (None, NULLPTR, "input"), (np.zeros(3, np.float16), INVALID, "input"),
    (np.zeros((2, 3), BF16), INVALID, "input"), ("abc", INVALID, "input")])
def test_pythonic_errors(bad, status, name):
    with pytest.raises(opgraph.AclnnError) as e:
        batch_norm_stats(bad, 1e-5)
    assert int(e.value.status) == status and named(str(e.value)) == name


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


CLI = [(cmd, dtype, soc)
       for cmd in ("run", "dump", "plan", "emit-c", "emit-cpp") for dtype in ("float32", "float16")
       for soc in ("Ascend910B", "Ascend950")]


@pytest.mark.parametrize("cmd, dtype, platform", CLI)
def test_cli_works_or_says_one_line(capsys, tmp_path, cmd, dtype, platform):
    """run, dump and plan work; emit-c (nothing fused on 910B) and emit-cpp may refuse in one line."""
    extra = ["-o", str(tmp_path / "prog.cpp")] if cmd == "emit-cpp" else []
    code, out, err = run_cli(capsys, cmd, "aclnnBatchNormStats", "--dtype", dtype, "--platform",
                             platform, "--eps", "0.001", *extra)
    if cmd in ("run", "dump", "plan"):
        assert code == 0, err
    if code != 0:
        assert err.startswith("opgraph: ") and err.count("\n") == 1 and "Traceback" not in err, err
    if cmd == "run":
        errs = [float(v.split()[0]) for v in out.split("max rel error: ")[1:]]
        assert len(errs) == 2 and max(errs) < 1e-6
    if cmd == "plan":
        assert "aclnnBatchNormStats(input, double 0.001, mean, invstd)" in out


def test_cli_empty_shape_runs(capsys):
    code, out, err = run_cli(capsys, "run", "aclnnBatchNormStats", "--shape", "0,3,4", "--dtype", "float16")
    assert code == 0, err
    assert "nan" in out.lower()
