"""aclnnBatchNormGatherStatsWithCounts: every row of the check table (status, a message naming
the argument, outputs and running stats untouched), the quirks, and the l0 graph op by op on
910B and 950. Numerics, passes, the CLI and the Pythonic function:
test_batch_norm_gather_stats_with_counts_numerics.py."""
from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import aclnn
from opgraph.aclnn.batch_norm_gather_stats_with_counts import (
    aclnnBatchNormGatherStatsWithCounts as run_phase2,
    aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize as phase1)

OP = "aclnnBatchNormGatherStatsWithCounts"
F32, F16, BF16, I32 = np.float32, np.float16, np.dtype(ml_dtypes.bfloat16), np.int32
NAMES = ("input", "mean", "invstd", "runningMean", "runningVar", "momentum", "eps", "counts",
         "meanAll", "invstdAll")
WRITTEN = ("runningMean", "runningVar", "meanAll", "invstdAll")
B910, B950 = "Ascend910B", "Ascend950"
NULLPTR, INVALID, TILING, INNER_NULL, NO_KERNEL = 161001, 161002, 561002, 561103, 561003
U = 2.0 ** -24  # float32 unit roundoff
HALF_ULP = {np.dtype(F32): U, np.dtype(F16): 2.0 ** -11, BF16: 2.0 ** -8}


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_bits(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan_g, nan_w = np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
    assert np.array_equal(nan_g, nan_w), f"{what}: NaN positions differ"
    assert np.array_equal(bits(got)[~nan_g], bits(want)[~nan_w]), f"{what}: {got} != {want}"


def make_args(W=3, C=4, dtype=F32, running=True, seed=0, input_shape=None, **dtypes) -> dict:
    """Valid arguments; outputs (and the running stats' spare bytes) start as sentinel bytes."""
    rng = np.random.default_rng(seed)
    dt = {n: np.dtype(dtypes.get(n, dtype)) for n in NAMES if n not in ("momentum", "eps")}
    a = {
        "mean": rng.standard_normal((W, C)).astype(dt["mean"]),
        "invstd": rng.uniform(0.5, 2.0, (W, C)).astype(dt["invstd"]),
        "runningMean": rng.standard_normal(C).astype(dt["runningMean"]),
        "runningVar": rng.uniform(0.5, 2.0, C).astype(dt["runningVar"]),
        "momentum": 0.1, "eps": 1e-5,
        "counts": rng.integers(1, 17, W).astype(dt["counts"]),
        "meanAll": np.full(C * dt["meanAll"].itemsize, 0x5A, np.uint8).view(dt["meanAll"]),
        "invstdAll": np.full(C * dt["invstdAll"].itemsize, 0x5A, np.uint8).view(dt["invstdAll"]),
    }
    a["input"] = rng.standard_normal(input_shape or (2, C, 5)).astype(dt["input"])  # drawn last
    if not running:
        a["runningMean"] = a["runningVar"] = None
    return a


def tensors(a: dict) -> list:
    return [v if v is None or isinstance(v, (float, int, str, opgraph.Tensor)) else opgraph.tensor(v)
            for v in (a[n] for n in NAMES)]


def written_bytes(a: dict) -> dict:
    return {n: None if a[n] is None else np.asarray(a[n]).tobytes() for n in WRITTEN}


def record(a: dict, soc: str = B910):
    with opgraph.platform(soc):
        st, ws, ex = phase1(*tensors(a))
    return int(st), ws, ex, aclnn.aclGetRecentErrMsg()


def run(a: dict, soc: str = B910, level: "int | None" = None) -> dict:
    """Both phases (must succeed); returns ``a`` with its written arrays updated in place."""
    with opgraph.platform(soc), opgraph.opt_level(opgraph.get_opt_level() if level is None else level):
        st, ws, ex = phase1(*tensors(a))
        assert int(st) == 0, aclnn.aclGetRecentErrMsg()
        assert int(run_phase2(bytearray(ws) if ws else None, ws, ex)) == 0
    return a


_NAME_RE = re.compile(r"(?<![A-Za-z])(" + "|".join(sorted(NAMES, key=len, reverse=True)) + r")(?![A-Za-z])")


def expect_error(a: dict, status: int, name: str, *keywords: str, soc: str = B910) -> str:
    before = written_bytes(a)
    st, ws, ex, msg = record(a, soc)
    assert st == status, f"expected {status}, got {st}: {msg}"
    assert ex is None and ws == 0
    m = _NAME_RE.search(msg)
    assert m and m.group(1) == name, f"message should name {name} first: {msg!r}"
    for k in keywords:
        assert k in msg, f"message should mention {k!r}: {msg!r}"
    assert written_bytes(a) == before, "an output or running stat was written by a failing call"
    return msg


# ---------------------------------------------------------------------------------------------
# the check table
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["input", "mean", "invstd", "counts", "meanAll", "invstdAll"])
def test_null_required_tensor_is_161001(name):
    a = make_args()
    a[name] = None
    expect_error(a, NULLPTR, name, "NULL")


def test_null_order_is_the_vendor_order_and_comes_before_dtype():
    a = make_args()
    a["meanAll"], a["counts"] = None, None
    a["input"] = a["input"].astype(I32)
    expect_error(a, NULLPTR, "counts")


@pytest.mark.parametrize("name", ["input", "mean", "invstd", "runningMean", "runningVar", "counts",
                                  "meanAll", "invstdAll"])
def test_int32_anywhere_is_161002(name):
    a = make_args()
    a[name] = np.zeros(np.shape(a[name]), I32)
    expect_error(a, INVALID, name, "INT32")


@pytest.mark.parametrize("soc", [B910, B950, "Ascend910_93", "Ascend910"])
def test_int32_counts_are_rejected_on_every_soc(soc):
    a = make_args()
    a["counts"] = a["counts"].astype(I32)
    expect_error(a, INVALID, "counts", soc=soc)


def test_dtype_order_follows_the_prototype_with_running_stats_before_counts():
    a = make_args()
    a["counts"], a["runningVar"] = a["counts"].astype(I32), a["runningVar"].astype(np.float64)
    expect_error(a, INVALID, "runningVar")


def test_bf16_only_where_socversion_is_910b_to_910e():
    expect_error(make_args(dtype=BF16), INVALID, "input", "BF16", soc="Ascend910")
    for soc in (B910, "Ascend910_93", B950):
        st, _, _, msg = record(make_args(dtype=BF16), soc)
        assert st == 0, msg


@pytest.mark.parametrize("name", ["input", "mean", "invstd", "counts"])
def test_private_format_is_161002(name):
    a = make_args()
    a[name] = opgraph.tensor(a[name], format="NC1HWC0")
    expect_error(a, INVALID, name, "NC1HWC0")


def test_output_formats_are_not_checked():
    a = make_args()
    a["meanAll"] = opgraph.tensor(np.zeros(4, F32), format="NC1HWC0")
    st, _, _, msg = record(a)
    assert st == 0, msg


def test_dtype_before_format_before_shape():
    a = make_args()
    a["counts"] = opgraph.tensor(a["counts"], format="NC1HWC0")
    a["meanAll"] = np.zeros(5, F32)
    expect_error(a, INVALID, "counts", "NC1HWC0")
    a["invstdAll"] = np.zeros(4, I32)
    expect_error(a, INVALID, "invstdAll", "INT32")


SHAPE_ROWS = [  # (mutate(a), the argument named, a word of the rule) in the vendor's order
    (lambda a: a.update(input=np.zeros((1,) * 9, F32)), "input", "greater than 8"),
    (lambda a: a.update(input=np.zeros(4, F32)), "input", "less than 2"),
    (lambda a: a.update(mean=np.zeros(12, F32)), "mean", "rank 1"),
    (lambda a: a.update(mean=np.zeros((3, 4, 1), F32)), "mean", "rank 3"),
    (lambda a: a.update(invstd=np.ones(12, F32)), "invstd", "rank 1"),
    (lambda a: a.update(invstd=np.ones((4, 4), F32)), "invstd", "first dim"),
    (lambda a: a.update(counts=np.ones(2, F32)), "counts", "first dim"),
    (lambda a: a.update(counts=np.float32(3)), "counts", "rank 0"),
    (lambda a: a.update(mean=np.zeros((3, 5), F32)), "mean", "second dim"),
    (lambda a: a.update(invstd=np.ones((3, 3), F32)), "invstd", "second dim"),
    (lambda a: a.update(runningMean=np.zeros(5, F32)), "runningMean", "[C]"),
    (lambda a: a.update(runningMean=np.zeros((1, 4), F32)), "runningMean", "[C]"),
    (lambda a: a.update(runningVar=np.ones(3, F32)), "runningVar", "[C]"),
    (lambda a: a.update(counts=np.ones((3, 1), F32)), "counts", "rank 2"),
    (lambda a: a.update(meanAll=np.zeros(5, F32)), "meanAll", "[C]"),
    (lambda a: a.update(invstdAll=np.zeros((1, 4), F32)), "invstdAll", "[C]"),
]


@pytest.mark.parametrize("mutate,name,word", SHAPE_ROWS, ids=[f"{r[1]}-{r[2]}" for r in SHAPE_ROWS])
@pytest.mark.parametrize("soc", [B910, B950])
def test_shape_rows_are_161002(mutate, name, word, soc):
    a = make_args()
    mutate(a)
    expect_error(a, INVALID, name, word, soc=soc)


def test_shape_check_order_quirks():
    # counts' first dim is compared before mean's channel dim, its rank only after the running stats
    a = make_args()
    a["counts"], a["mean"] = np.ones(4, F32), np.zeros((3, 5), F32)
    expect_error(a, INVALID, "counts", "first dim")
    a = make_args()
    a["counts"], a["runningVar"] = np.ones((3, 2), F32), np.ones(5, F32)
    expect_error(a, INVALID, "runningVar")


@pytest.mark.parametrize("soc", [B910, B950, "Ascend310P"])
def test_empty_mean_fills_zero_and_nan_and_leaves_running_stats(soc):
    a = make_args(W=0)
    before = written_bytes(a)
    run(a, soc)
    assert np.array_equal(a["meanAll"], np.zeros(4, F32))
    assert np.isnan(a["invstdAll"]).all()
    assert (before["runningMean"], before["runningVar"]) == (a["runningMean"].tobytes(),
                                                             a["runningVar"].tobytes())


def test_empty_path_fills_in_the_destination_dtypes_and_comes_after_the_checks():
    a = make_args(W=0, meanAll=F16, invstdAll=BF16)
    run(a, B950)
    assert a["meanAll"].dtype == F16 and not a["meanAll"].any() and np.isnan(a["invstdAll"].astype(F32)).all()
    a = make_args(W=0)
    a["meanAll"] = np.zeros(3, F32)
    expect_error(a, INVALID, "meanAll")


def test_zero_channels_is_the_empty_path():
    a = make_args(C=0, input_shape=(2, 0, 3))
    run(a)
    assert a["meanAll"].shape == (0,)


@pytest.mark.parametrize("soc", [B910, B950])
def test_empty_input_with_nonempty_mean_is_computed(soc):
    a, b = make_args(input_shape=(0, 4, 2)), make_args()
    run(a, soc), run(b, soc)
    for n in WRITTEN:
        assert_bits(a[n], b[n], n)


@pytest.mark.parametrize("soc", ["Ascend310P", "Ascend310B"])
def test_socs_without_kernels_are_561003_after_the_checks(soc):
    a = make_args()
    st, _, _, msg = record(a, soc)
    assert st == NO_KERNEL and soc in msg
    a["counts"] = a["counts"].astype(I32)
    expect_error(a, INVALID, "counts", soc=soc)


@pytest.mark.parametrize("soc", [B910, B950])
def test_running_mean_without_running_var_is_a_clear_161001_not_a_crash(soc):
    a = make_args()
    a["runningVar"] = None
    expect_error(a, NULLPTR, "runningVar", "runningMean", soc=soc)


@pytest.mark.parametrize("soc", [B910, B950])
def test_running_var_without_running_mean_is_left_untouched(soc):
    a = make_args()
    a["runningMean"] = None
    rv = a["runningVar"].copy()
    run(a, soc)
    assert np.array_equal(bits(a["runningVar"]), bits(rv))
    b = run(make_args(running=False), soc)  # the running stats do not change meanAll/invstdAll
    for n in ("meanAll", "invstdAll"):
        assert_bits(a[n], b[n], n)


def test_950_copies_running_stats_without_a_cast_561103_but_910b_casts():
    a = make_args(runningMean=F16, runningVar=F16)
    expect_error(a, INNER_NULL, "runningMean", "ViewCopy", soc=B950)
    a = make_args(runningVar=F16)
    expect_error(a, INNER_NULL, "runningVar", "ViewCopy", soc=B950)
    a = make_args(runningMean=F16, runningVar=BF16, counts=F16, meanAll=BF16)
    run(a, B910)
    assert a["runningMean"].dtype == F16 and a["meanAll"].dtype == BF16


TILING_ROWS = [  # args that the 950 fused tiling rejects; the vendor only logs it
    (dict(invstd=F16), {}, "invstd"),
    (dict(input=F16, running=False), {}, "input"),
    (dict(runningVar=F16), dict(runningMean=None), "runningVar"),
    ({}, dict(momentum=1.5), "momentum"),
    ({}, dict(momentum=-0.25), "momentum"),
    ({}, dict(eps=0.0), "eps"),
    ({}, dict(eps=-1e-3), "eps"),
]


@pytest.mark.parametrize("kw,update,name", TILING_ROWS,
                         ids=[r[2] + str(i) for i, r in enumerate(TILING_ROWS)])
def test_950_fused_tiling_rejections_are_561002_and_fine_on_910b(kw, update, name):
    a = make_args(**kw)
    a.update(update)
    expect_error(a, TILING, name, "tiling", soc=B950)
    a = make_args(**kw)
    a.update(update)
    run(a, B910)
    assert np.isfinite(a["meanAll"]).all()


def test_950_tiling_uses_the_float_attrs_and_lets_nan_pass():
    for m in (1.0 + 1e-9, math.nan, 0.0, 1.0):  # (float)1.000000001 == 1.0; NaN compares false
        a = make_args()
        a["momentum"] = m
        st, _, _, msg = record(a, B950)
        assert st == 0, msg


def test_950_definite_failures_win_over_the_hidden_tiling_one():
    a = make_args(runningMean=F16)
    a["momentum"] = 2.0
    expect_error(a, INNER_NULL, "runningMean", soc=B950)
    a = make_args()
    a["runningVar"], a["eps"] = None, -1.0
    expect_error(a, NULLPTR, "runningVar", soc=B950)


def test_python_level_argument_kinds():
    a = make_args()
    a["momentum"] = "0.1"
    expect_error(a, INVALID, "momentum")
    a = make_args()
    a["input"] = "abc"
    expect_error(a, INVALID, "input")


# ---------------------------------------------------------------------------------------------
# the l0 graph, op by op (level 0 = as recorded); #k is node k's output, %name a user tensor
# ---------------------------------------------------------------------------------------------
def listing(graph) -> list[str]:
    ref = {}
    for i, n in enumerate(graph.nodes):
        for k, o in enumerate(n.outputs):
            ref[id(o)] = f"#{i}" + (f".{k}" if len(n.outputs) > 1 else "")
    return [f"{n.op}({','.join(ref.get(id(v), '%' + v.name) for v in n.inputs)}) "
            + ",".join(str(o.type) for o in n.outputs) for n in graph.nodes]


def recorded(a: dict, soc: str):
    st, _, ex, msg = record(a, soc)
    assert st == 0, msg
    return ex.graph


RUNNING_PREP_910B = ["Contiguous(%runningMean) f32[4]", "Cast(#0) f32[4]", "UnsqueezeNd(#1) f32[1,4]",
                     "ReFormat(#2) f32[1,4]",
                     "Contiguous(%runningVar) f32[4]", "Cast(#4) f32[4]", "UnsqueezeNd(#5) f32[1,4]",
                     "ReFormat(#6) f32[1,4]"]


def chain_910b(dt: str, k: int) -> list[str]:
    """The gather chain from node k on (mean, invstd, counts of dtype ``dt``; W = 3, C = 4)."""
    return [f"Contiguous(%mean) {dt}[3,4]", f"Cast(#{k}) f32[3,4]",
            f"Contiguous(%invstd) {dt}[3,4]", f"Cast(#{k + 2}) f32[3,4]",
            f"Contiguous(%counts) {dt}[3]", f"Cast(#{k + 4}) f32[3]",
            f"UnsqueezeNd(#{k + 5}) f32[3,1]", f"BroadcastTo(#{k + 6}) f32[3,4]",
            f"ReduceSum(#{k + 7}) f32[1,4]", f"BroadcastTo(#{k + 8}) f32[3,4]",
            f"ReduceMeanWithCount(#{k + 1},#{k + 7},#{k + 9}) f32[1,4]",
            f"BroadcastTo(#{k + 10}) f32[3,4]"]


def test_graph_910b_fp32_with_running_stats():
    g = recorded(make_args(), B910)
    assert listing(g) == RUNNING_PREP_910B + chain_910b("f32", 8) + [
        "SyncBatchNormGatherStatsWithCounts(#9,#11,#15,#19,#16,#7) f32[4],f32[1,4]",
        "SyncBNTrainingUpdate(#18,#3) f32[1,4]",
        "SqueezeNd(#20.1) f32[4]", "ViewCopy(#22,%runningVar) f32[4]",       # runningVar first,
        "SqueezeNd(#21) f32[4]", "ViewCopy(#24,%runningMean) f32[4]",        # then runningMean,
        "SqueezeNd(#18) f32[4]", "ViewCopy(#26,%meanAll) f32[4]",
        "SqueezeNd(#20.0) f32[4]", "ViewCopy(#28,%invstdAll) f32[4]"]
    gather, update = g.nodes[20], g.nodes[21]
    assert gather.attrs.momentum == float(F32(0.1)) and gather.attrs.epsilon == float(F32(1e-5))
    assert update.attrs.momentum == float(F32(0.1))
    assert [n.attrs.dims for n in g.nodes if n.op == "SqueezeNd"] == [(0,)] * 4
    assert g.nodes[14].attrs.dims == (-1,) and g.nodes[16].attrs.axes == (0,) and g.nodes[16].attrs.keepdims


def test_graph_910b_half_stats_null_running_stats_and_other_output_dtypes():
    a = make_args(dtype=F16, running=False, meanAll=BF16, invstdAll=F32)
    g = recorded(a, B910)
    assert listing(g) == ["Fill() f32[1,4]", "ReFormat(#0) f32[1,4]",     # runningMean: zeros
                          "Fill() f32[1,4]", "ReFormat(#2) f32[1,4]",     # runningVar: zeros (not ones)
                          ] + chain_910b("f16", 4) + [
        "SyncBatchNormGatherStatsWithCounts(#5,#7,#11,#15,#12,#3) f32[4],f32[1,4]",
        "Cast(#14) bf16[1,4]",                                            # meanAll's Cast; invstdAll: none
        "SqueezeNd(#17) bf16[4]", "ViewCopy(#18,%meanAll) bf16[4]",
        "SqueezeNd(#16.0) f32[4]", "ViewCopy(#20,%invstdAll) f32[4]"]
    assert g.nodes[0].attrs.value == 0.0 and g.nodes[0].attrs.dtype.name == "FLOAT"


def test_graph_910b_running_var_only_and_half_running_stats():
    a = make_args(runningVar=F16)
    a["runningMean"] = None
    g = recorded(a, B910)
    assert listing(g)[:6] == ["Fill() f32[1,4]", "ReFormat(#0) f32[1,4]",
                              "Contiguous(%runningVar) f16[4]", "Cast(#2) f32[4]",
                              "UnsqueezeNd(#3) f32[1,4]", "ReFormat(#4) f32[1,4]"]
    assert [n.op for n in g.nodes[-5:]] == ["SyncBatchNormGatherStatsWithCounts", "SqueezeNd",
                                            "ViewCopy", "SqueezeNd", "ViewCopy"]
    a = make_args(runningMean=F16, runningVar=BF16)
    tail = listing(recorded(a, B910))[21:27]
    assert tail == ["SyncBNTrainingUpdate(#18,#3) f32[1,4]", "Cast(#21) f16[1,4]", "Cast(#20.1) bf16[1,4]",
                    "SqueezeNd(#23) bf16[4]", "ViewCopy(#24,%runningVar) bf16[4]",
                    "SqueezeNd(#22) f16[4]"]


def test_graph_950_fp32_with_running_stats():
    g = recorded(make_args(), B950)
    assert listing(g) == [
        "Contiguous(%runningMean) f32[4]", "UnsqueezeNd(#0) f32[1,4]", "ReFormat(#1) f32[1,4]",
        "Contiguous(%runningVar) f32[4]", "UnsqueezeNd(#3) f32[1,4]", "ReFormat(#4) f32[1,4]",
        "Contiguous(%mean) f32[3,4]", "Contiguous(%invstd) f32[3,4]", "Contiguous(%counts) f32[3]",
        "Cast(#8) f32[3]", "Contiguous(#2) f32[1,4]", "Contiguous(#5) f32[1,4]",
        "SyncBatchNormGatherStatsFused(#6,#7,#9,#10,#11) f32[1,4],f32[1,4],f32[1,4],f32[1,4]",
        "SqueezeNd(#12.0) f32[4]", "ViewCopy(#13,%meanAll) f32[4]",          # meanAll first,
        "SqueezeNd(#12.1) f32[4]", "ViewCopy(#15,%invstdAll) f32[4]",
        "SqueezeNd(#12.2) f32[4]", "ViewCopy(#17,%runningMean) f32[4]",     # running stats last
        "SqueezeNd(#12.3) f32[4]", "ViewCopy(#19,%runningVar) f32[4]"]
    fused = g.nodes[12].attrs
    assert (fused.momentum, fused.eps, fused.cores) == (float(F32(0.1)), float(F32(1e-5)), 64)


@pytest.mark.parametrize("dt,short", [(F16, "f16"), (BF16, "bf16")])
def test_graph_950_half_null_running_stats_fill_in_input_dtype(dt, short):
    a = make_args(dtype=dt, running=False, meanAll=F32)
    g = recorded(a, B950)
    assert listing(g) == [
        f"Fill() {short}[1,4]", f"ReFormat(#0) {short}[1,4]",
        f"Fill() {short}[1,4]", f"ReFormat(#2) {short}[1,4]",
        f"Contiguous(%mean) {short}[3,4]", f"Contiguous(%invstd) {short}[3,4]",
        f"Contiguous(%counts) {short}[3]",
        "Cast(#6) f32[3]", f"Contiguous(#1) {short}[1,4]", f"Contiguous(#3) {short}[1,4]",
        "SyncBatchNormGatherStatsFused(#4,#5,#7,#8,#9) " + ",".join([f"{short}[1,4]"] * 4),
        "Cast(#10.0) f32[1,4]", "SqueezeNd(#11) f32[4]", "ViewCopy(#12,%meanAll) f32[4]",
        f"SqueezeNd(#10.1) {short}[4]", f"ViewCopy(#14,%invstdAll) {short}[4]"]
