"""aclnnBatchNormReduceBackward (family facts §B, sheet §4.5–4.7): the vendor's check table and
order (status, the argument named, outputs untouched), the l0 graph op by op on both SoC
families, numerics against a model written here (the documented summation order one add at a
time, then the kernel's three float32 steps: bits), sums against float64 within the order's
bound, empty/NaN/strided/rank cases, levels, the backend kit, the CLI and the Pythonic API."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import passes
from opgraph.aclnn.batch_norm_reduce_backward import (
    aclnnBatchNormReduceBackward as phase2, aclnnBatchNormReduceBackwardGetWorkspaceSize as phase1,
    batch_norm_backward_reduce)
from opgraph.cli import main
from opgraph.testing import check_backend

F32, F16, BF16, I32 = np.float32, np.float16, ml_dtypes.bfloat16, np.int32
INPUTS = ("gradOut", "input", "mean", "invstd", "weight")
MASKS = ("inputG", "weightG", "biasG")
OUTPUTS = ("sumDy", "sumDyXmu", "gradWeight", "gradBias")
ARGS = INPUTS + MASKS + OUTPUTS
NULLPTR, INVALID, INNER_NULLPTR, NO_KERNEL = 161001, 161002, 561103, 561003
SUPPORTED = ("Ascend910B", "Ascend910_93", "Ascend950", "Ascend910")
U = 2.0 ** -24  # unit roundoff of float32


# --- an independent model: the documented order (l0ops/ordered.py doc), one add at a time -------
def fold(vals: list) -> np.ndarray:
    """Halving tree: with n = ceil(m/2), value j adds value j + n for j < m − n, until one is left."""
    a, m = list(vals), len(vals)
    while m > 1:
        n = (m + 1) // 2
        for j in range(m - n):
            a[j] = a[j] + a[j + n]
        m = n
    return a[0]


def model_sum(rows: np.ndarray) -> np.ndarray:
    """float32 [C, R] → [C]: blocks of 32768; 64 lanes per block (lane j: j, j+64, ...); trees."""
    C, R = rows.shape
    if R == 0:
        return np.zeros(C, F32)
    blocks = []
    for b in range(0, R, 32768):
        blk = rows[:, b:b + 32768]
        lanes = [blk[:, j].copy() for j in range(min(64, blk.shape[1]))]
        for i in range(64, blk.shape[1]):
            lanes[i % 64] = lanes[i % 64] + blk[:, i]
        blocks.append(fold(lanes))
    return fold(blocks)


def rows(a: np.ndarray) -> np.ndarray:
    """[N, C, ...] → [C, R], the reduced elements of each channel in row-major order."""
    return np.moveaxis(a, 1, 0).reshape(a.shape[1], -1)


def model(dy, x, mean, invstd) -> dict[str, np.ndarray]:
    """Every output in float32: Σdy·x (product in f32), Σdy, then sumDyX − mean·sumDy, ·invstd."""
    dyf, xf = np.asarray(dy).astype(F32), np.asarray(x).astype(F32)
    s_dyx, s_dy = model_sum(rows(dyf * xf)), model_sum(rows(dyf))
    xmu = s_dyx - np.asarray(mean).astype(F32) * s_dy
    return {"sumDy": s_dy, "sumDyXmu": xmu, "gradWeight": xmu * np.asarray(invstd).astype(F32),
            "gradBias": s_dy}


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}")


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    """Same dtype and bits; NaNs need only sit at the same places."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want.astype(np.float64))
    assert np.array_equal(np.isnan(got.astype(np.float64)), nan)
    assert np.array_equal(bits(got)[~nan], bits(want)[~nan]), (got, want)


# --- argument helpers -------------------------------------------------------------------------
def sentinel(shape, dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.full(n, 0x5A, np.uint8).view(dtype).reshape(shape)


def make_args(shape=(2, 3, 4), dtype=F32, pdtype=F32, odtype=F32, masks=(True, True, True),
              weight=True, seed=1) -> dict:
    rng = np.random.default_rng(seed)
    C = shape[1]
    a = {"gradOut": rng.standard_normal(shape).astype(dtype),
         "input": (rng.standard_normal(shape) + 0.5).astype(dtype),
         "mean": rng.normal(0.5, 0.1, C).astype(pdtype), "invstd": rng.uniform(0.5, 2, C).astype(pdtype),
         "weight": rng.uniform(0.5, 1.5, C).astype(pdtype) if weight else None}
    a.update(zip(MASKS, masks))
    a.update({n: sentinel((C,), odtype) for n in OUTPUTS})
    return a


def wrap(v):
    return v if v is None or isinstance(v, (bool, int, opgraph.Tensor)) else opgraph.tensor(v)


def call1(a: dict, soc="Ascend910B", level=None):
    with opgraph.platform(soc), opgraph.opt_level(0 if level is None else level):
        st, ws, ex = phase1(*[wrap(a[n]) for n in ARGS])
    return int(st), ws, ex, opgraph.aclnn.aclGetRecentErrMsg()


def run(a: dict, soc="Ascend910B", level=2):
    st, ws, ex, msg = call1(a, soc, level)
    assert st == 0, msg
    with opgraph.platform(soc):
        assert phase2(bytearray(ws) if ws else None, ws, ex) == 0, opgraph.aclnn.aclGetRecentErrMsg()
    return ex


def out_bytes(a: dict) -> list:
    return [None if a[n] is None else (a[n].storage if isinstance(a[n], opgraph.Tensor) else a[n]).tobytes()
            for n in OUTPUTS]


# --- 1–4. the check table, in the vendor's order: NULL, dtype, format, shape -------------------
def up(**kw):
    """A change of the valid arguments: each value, or a function of the old one."""
    return lambda a: a.update({k: v(a[k]) if callable(v) else v for k, v in kw.items()})


NC1 = lambda v: opgraph.tensor(v, format="NC1HWC0")  # noqa: E731  (a private format)
NINE = np.zeros((1, 3, 1, 1, 1, 1, 1, 1, 2), F32)
CHECKS = [  # id, change, status, the argument named first, words in the message[, soc]
    *[(f"null-{n}", up(**{n: None}), NULLPTR, n, ("NULL",)) for n in ("gradOut", "input", "mean", "invstd")],
    *[(f"null-{n}", up(**{n: None}), NULLPTR, n, ("NULL", m)) for n, m in
      (("sumDy", "inputG"), ("sumDyXmu", "inputG"), ("gradWeight", "weightG"), ("gradBias", "biasG"))],
    ("inputs-before-outputs", up(invstd=None, sumDy=None), NULLPTR, "invstd", ()),
    ("outputs-in-list-order", up(gradBias=None, sumDyXmu=None, gradWeight=None), NULLPTR, "sumDyXmu", ()),
    ("null-before-dtype-rank", up(gradOut=NINE.astype(I32), gradWeight=None), NULLPTR, "gradWeight", ()),
    ("mask-not-bool", up(weightG=1), INVALID, "weightG", ("bool",)),
    *[(f"dtype-{n}", up(**{n: lambda v: v.astype(I32)}), INVALID, n, ("INT32",))
      for n in ("gradOut", "input", "mean", "invstd")],
    *[(f"dtype-{n}", up(**{n: np.zeros(3, I32)}), INVALID, n, ("INT32",)) for n in OUTPUTS],
    ("gradOut-dtype-equals-input", up(gradOut=lambda v: v.astype(F16), sumDy=np.zeros(3, I32)),
     INVALID, "gradOut", ("FLOAT16", "FLOAT")),
    ("list-before-equality-910", up(input=lambda v: v.astype(BF16)), INVALID, "input", ("BF16",), "Ascend910"),
    ("equality-910B", up(input=lambda v: v.astype(BF16)), INVALID, "gradOut", ("BF16",)),
    *[(f"bf16-910-{n}", up(**{n: lambda v: v.astype(BF16)}), INVALID, n, ("BF16", "Ascend910"), "Ascend910")
      for n in ("mean", "invstd", "sumDy", "gradBias")],
    ("dtype-before-format-rank", up(mean=lambda v: v.astype(I32), gradOut=NC1(NINE)), INVALID, "mean", ()),
    ("format-gradOut-vs-input", up(gradOut=lambda v: opgraph.tensor(v, format="NCL")), INVALID, "gradOut",
     ("NCL", "ND")),
    ("private-gradOut", up(gradOut=NC1, input=NC1), INVALID, "gradOut", ("NC1HWC0",)),
    *[(f"private-{n}", up(**{n: NC1}), INVALID, n, ("NC1HWC0",)) for n in ("mean", "invstd", "sumDyXmu",
                                                                            "gradWeight")],
    *[(f"rank{len(s)}-{n}", up(**{n: np.zeros(s, F32)}), INVALID, n, ("rank",))
      for n in ("gradOut", "input") for s in ((3,), NINE.shape)],
    ("gradOut-rank-first", up(gradOut=np.zeros(3, F32), input=np.zeros(3, F32)), INVALID, "gradOut", ("rank",)),
    ("zero-channels", up(input=np.zeros((2, 0, 4), F32)), INVALID, "input", ("channel",)),
    *[(f"shape-{n}", up(**{n: sentinel(s, F32)}), INVALID, n, ("[3]",)) for n in OUTPUTS for s in ((4,), (1, 3))],
    *[(f"no-kernel-{soc}", up(), NO_KERNEL, "SyncBatchNormBackwardReduce", (soc,), soc)
      for soc in ("Ascend310P", "Ascend310B")],
    ("checks-before-no-kernel", up(mean=None), NULLPTR, "mean", (), "Ascend310P"),
]


@pytest.mark.parametrize("row", CHECKS, ids=[r[0] for r in CHECKS])
def test_check_table(row):
    """Status, the argument named first, and every output untouched."""
    _, change, status, name, words, *soc = row
    a = make_args()
    change(a)
    before = out_bytes(a)
    st, ws, ex, msg = call1(a, *soc)
    assert st == status and ex is None and ws == 0, msg
    assert msg.split("): ", 1)[1].startswith(name), f"message should name {name} first: {msg!r}"
    assert all(w in msg for w in words), msg
    assert out_bytes(a) == before, "an output was written by a failing call"


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend910_93", "Ascend950"])
def test_bf16_everywhere_is_accepted_on_dav_2201_and_regbase(soc):
    st, _, _, msg = call1(make_args(dtype=BF16, pdtype=BF16, odtype=BF16), soc)
    assert st == 0, msg


@pytest.mark.parametrize("off", range(3))
def test_masked_off_outputs_may_be_null_and_are_neither_checked_nor_written(off):
    masks = tuple(i != off for i in range(3))
    a = make_args(masks=masks)
    skipped = [n for n, m in zip(OUTPUTS, (0, 0, 1, 2)) if m == off]
    a[skipped[0]] = None
    bad = {n: np.full(7, 3, I32) for n in skipped[1:]}  # wrong dtype and shape, private format
    a.update({n: opgraph.tensor(v, format="FRACTAL_NZ") for n, v in bad.items()})
    ex = run(a)
    assert not {v.name for v in ex.graph.inputs} & set(skipped)
    assert all(np.array_equal(v, np.full(7, 3, I32)) for v in bad.values())
    want = model(a["gradOut"], a["input"], a["mean"], a["invstd"])
    for n in set(OUTPUTS) - set(skipped):
        assert_same(a[n], want[n])


def test_weight_is_optional_never_checked_and_unused():
    got = []
    for w in (None, np.ones(3, F32), np.arange(9, dtype=I32), NC1(np.float16([[2.0]]))):
        a = make_args(weight=False)
        a["weight"] = w
        run(a)
        got.append(b"".join(out_bytes(a)))
    assert len(set(got)) == 1


def test_grad_out_only_has_to_broadcast_against_input():
    """Unchecked shapes: Mul broadcasts, so Σdy·x runs over the broadcast product while Σdy sums
    gradOut as given."""
    a = make_args(shape=(2, 3, 4))
    a["gradOut"] = a["gradOut"][:1]
    run(a)
    s_dyx = model_sum(rows(np.broadcast_to(a["gradOut"], a["input"].shape) * a["input"]))
    s_dy = model_sum(rows(a["gradOut"]))
    assert_same(a["sumDy"], s_dy)
    assert_same(a["sumDyXmu"], s_dyx - a["mean"] * s_dy)


@pytest.mark.parametrize("change", [
    up(gradOut=np.zeros((2, 3, 5), F32)),   # does not broadcast: Mul fails
    up(gradOut=np.zeros((3, 4), F32)),      # rank 2: ReduceSum's axis 2 is out of range
    up(mean=np.zeros(4, F32)),              # the kernel's buffers would differ in size
    up(invstd=np.ones((1, 3), F32))])
def test_unchecked_shapes_that_cannot_work_are_561103(change):
    a = make_args()
    change(a)
    before = out_bytes(a)
    st, ws, ex, msg = call1(a)
    assert st == INNER_NULLPTR and ex is None and "l0 op" in msg
    assert out_bytes(a) == before


def test_empty_input_on_a_soc_without_the_kernel_records_nothing():
    st, _, ex, _ = call1(make_args(shape=(0, 3)), "Ascend310P")
    assert st == 0 and not ex.graph.nodes


# --- 5. the l0 graph, op by op ----------------------------------------------------------------
FP16_ALL_MASKS = """\
%0: f16[2,3,4] = Contiguous(%gradOut)
%1: f16[2,3,4] = Contiguous(%input)
%2: f16[3] = Contiguous(%mean)
%3: f16[3] = Contiguous(%invstd)
%4: f16[3] = Contiguous(%weight)
%5: f32[2,3,4] = Cast(%0, to=f32)
%6: f32[2,3,4] = Cast(%1, to=f32)
%7: f32[3] = Cast(%2, to=f32)
%8: f32[3] = Cast(%3, to=f32)
%9: f32[3] = Cast(%4, to=f32)
%10: f32[2,3,4] = Mul(%5, %6)
%11: f32[3] = ReduceSum(%10, axes=[0,2])
%12: f32[3] = ReduceSum(%5, axes=[0,2])
%13: f32[3], %14: f32[3] = SyncBatchNormBackwardReduce(%12, %11, %7, %8)
%15: f16[3] = Cast(%12, to=f16)
%16: f16[3] = ViewCopy(%15, %sumDy)
%17: f16[3] = Cast(%13, to=f16)
%18: f16[3] = ViewCopy(%17, %sumDyXmu)
%19: f16[3] = Cast(%14, to=f16)
%20: f16[3] = ViewCopy(%19, %gradWeight)
%21: f16[3] = Cast(%12, to=f16)
%22: f16[3] = ViewCopy(%21, %gradBias)
return %16, %18, %20, %22"""

BF16_NULL_WEIGHT_NO_WEIGHT_G = """\
%0: f32[3] = Fill(shape=[3], value=1.0)
%1: bf16[2,3,4,5] = Contiguous(%gradOut)
%2: bf16[2,3,4,5] = Contiguous(%input)
%3: f32[3] = Contiguous(%mean)
%4: f32[3] = Contiguous(%invstd)
%5: f32[3] = Contiguous(%0)
%6: f32[2,3,4,5] = Cast(%1, to=f32)
%7: f32[2,3,4,5] = Cast(%2, to=f32)
%8: f32[3] = Cast(%3, to=f32)
%9: f32[3] = Cast(%4, to=f32)
%10: f32[3] = Cast(%5, to=f32)
%11: f32[2,3,4,5] = Mul(%6, %7)
%12: f32[3] = ReduceSum(%11, axes=[0,2,3])
%13: f32[3] = ReduceSum(%6, axes=[0,2,3])
%14: f32[3], %15: f32[3] = SyncBatchNormBackwardReduce(%13, %12, %8, %9)
%16: bf16[3] = Cast(%13, to=bf16)
%17: bf16[3] = ViewCopy(%16, %sumDy)
%18: f32[3] = Cast(%14, to=f32)
%19: f32[3] = ViewCopy(%18, %sumDyXmu)
%20: f16[3] = Cast(%13, to=f16)
%21: f16[3] = ViewCopy(%20, %gradBias)
return %17, %19, %21"""

EMPTY_950 = """\
%0: f32[3] = Fill(shape=[3], value=0.0)
%1: f16[3] = Cast(%0, to=f16)
%2: f16[3] = ViewCopy(%1, %sumDy)
%3: bf16[3] = Cast(%0, to=bf16)
%4: bf16[3] = ViewCopy(%3, %sumDyXmu)
%5: f32[3] = Cast(%0, to=f32)
%6: f32[3] = ViewCopy(%5, %gradWeight)
return %2, %4, %6"""


def body(g) -> str:
    return "\n".join(line.strip() for line in str(g).splitlines()[1:-1])


@pytest.mark.parametrize("soc", SUPPORTED)
def test_graph_fp16_all_masks(soc):
    _, _, ex, _ = call1(make_args(dtype=F16, pdtype=F16, odtype=F16), soc)
    assert body(ex.graph) == FP16_ALL_MASKS


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_graph_bf16_null_weight_mixed_outputs(soc):
    a = make_args(shape=(2, 3, 4, 5), dtype=BF16, weight=False, masks=(True, False, True))
    a["sumDy"], a["gradBias"], a["gradWeight"] = sentinel((3,), BF16), sentinel((3,), F16), None
    _, _, ex, _ = call1(a, soc)
    assert body(ex.graph) == BF16_NULL_WEIGHT_NO_WEIGHT_G


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("masks", [(True, False, False), (False, True, False), (False, False, True),
                                   (False, False, False)])
def test_graph_fp32_per_mask(soc, masks):
    a = make_args(masks=masks)
    for n, m in zip(OUTPUTS, (masks[0], masks[0], masks[1], masks[2])):
        a[n] = a[n] if m else None
    _, _, ex, _ = call1(a, soc)
    ops = [n.op for n in ex.graph.nodes]
    tail = (["Cast", "ViewCopy"] * 2 if masks[0] else []) + (["Cast", "ViewCopy"] if masks[1] else []) \
        + (["Cast", "ViewCopy"] if masks[2] else [])
    assert ops == ["Contiguous"] * 5 + ["Cast"] * 5 + ["Mul", "ReduceSum", "ReduceSum",
                                                      "SyncBatchNormBackwardReduce"] + tail
    copies = [n.inputs[1].name for n in ex.graph.nodes if n.op == "ViewCopy"]
    assert copies == [n for n, m in zip(OUTPUTS, (masks[0], masks[0], masks[1], masks[2])) if m]
    if masks[2]:  # gradBias is a copy of the f32 Σdy, the second ReduceSum
        vc = ex.graph.nodes[-1]
        assert vc.inputs[0].producer.inputs[0].producer is ex.graph.nodes[12]


def test_graph_empty_input_per_soc():
    a = make_args(shape=(2, 3, 0), masks=(True, True, False))
    a["sumDy"], a["sumDyXmu"], a["gradWeight"] = sentinel((3,), F16), sentinel((3,), BF16), sentinel((3,), F32)
    _, _, ex, _ = call1(a, "Ascend950")
    assert body(ex.graph) == EMPTY_950
    for soc in ("Ascend910B", "Ascend910_93", "Ascend910"):
        if soc == "Ascend910":  # no BF16 there
            a["sumDyXmu"] = sentinel((3,), F32)
        st, ws, ex, _ = call1(a, soc)
        assert st == 0 and ws == 0 and not ex.graph.nodes


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_level1_launches_of_the_fp32_graph(soc):
    _, _, ex, _ = call1(make_args(), soc)
    g1 = passes.optimize(ex.graph, 1)
    assert [n.op for n in g1.nodes if not n.opdef.is_free(n)] == \
        ["Mul", "ReduceSum", "ReduceSum", "SyncBatchNormBackwardReduce", "ViewCopy"]
    assert passes.graph_stats(g1).launches == 5
    assert passes.graph_stats(passes.optimize(ex.graph, 0)).launches == 8  # + 2 TensorMoves


def test_level1_launches_what_cann_launches():
    """CANN redirects the first ViewCopy of Σdy (into sumDy) and copies it once more into gradBias."""
    _, _, ex, _ = call1(make_args(), "Ascend910B")
    assert passes.graph_stats(passes.optimize(ex.graph, 1)).launches == 5


# --- 6. numerics: bits against the model, float64 bounds --------------------------------------
@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("dtype,pdtype,odtype", [(F32, F32, F32), (F16, F16, F16), (F16, F32, F32),
                                                 (BF16, BF16, BF16), (BF16, F32, F16)])
def test_bits_match_the_model(soc, dtype, pdtype, odtype):
    a = make_args(shape=(5, 4, 7, 30), dtype=dtype, pdtype=pdtype, odtype=odtype, seed=3)
    run(a, soc)
    want = model(a["gradOut"], a["input"], a["mean"], a["invstd"])
    for n in OUTPUTS:
        assert_same(a[n], want[n].astype(odtype))


@pytest.mark.parametrize("rank", range(2, 9))
def test_ranks_2_to_8(rank):
    shape = (3, 2, 2, 3, 1, 2, 1, 2)[:rank]
    a = make_args(shape=shape, dtype=F16, odtype=F32, seed=rank)
    run(a, "Ascend950" if rank % 2 else "Ascend910B")
    want = model(a["gradOut"], a["input"], a["mean"], a["invstd"])
    for n in OUTPUTS:
        assert_same(a[n], want[n])


def bound_terms(dy, x, mean, invstd):
    """float64 exact values and first-order error bounds of the ordered float32 evaluation.
    An ordered sum of R terms errs by at most b·u·Σ|t| with b = min(R, 32768)/64 + 6 +
    ⌈log2(R/32768)⌉; the product adds u·|dy·x| per term; each later step one u."""
    d, xx = dy.astype(np.float64), x.astype(np.float64)
    C, R = x.shape[1], x.size // x.shape[1]
    b = min(R, 32768) / 64 + 6 + max(0, math.ceil(math.log2(R / 32768)))
    m, s = mean.astype(np.float64), invstd.astype(np.float64)
    s_dy, s_dyx = rows(d).sum(1), rows(d * xx).sum(1)
    e_dy = b * U * rows(np.abs(d)).sum(1)
    e_dyx = (b + 1) * U * rows(np.abs(d * xx)).sum(1)
    xmu = s_dyx - m * s_dy
    e_xmu = e_dyx + np.abs(m) * e_dy + U * np.abs(m * s_dy) + U * (np.abs(xmu) + e_dyx + np.abs(m) * e_dy)
    exact_xmu = rows(d * (xx - m.reshape((1, C) + (1,) * (x.ndim - 2)))).sum(1)
    return {"sumDy": (s_dy, e_dy), "gradBias": (s_dy, e_dy), "sumDyXmu": (exact_xmu, e_xmu),
            "gradWeight": (exact_xmu * s, e_xmu * s + U * np.abs(exact_xmu * s) * 1.01)}


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_sums_against_float64_within_the_order_bound(soc):
    """R = 3·150·150 = 67500 per channel: three blocks of the fixed order."""
    rng = np.random.default_rng(7)
    shape = (3, 2, 150, 150)
    a = make_args(shape=(3, 2, 1), seed=7)
    a["gradOut"] = rng.standard_normal(shape).astype(F32)
    a["input"] = (rng.standard_normal(shape) * 3 + 1).astype(F32)
    run(a, soc)
    for n, (exact, err) in bound_terms(a["gradOut"], a["input"], a["mean"], a["invstd"]).items():
        got = a[n].astype(np.float64)
        assert np.all(np.abs(got - exact) <= err * 1.0001), (n, got - exact, err)
        assert np.all(err < 1e-3 * rows(np.abs(a["gradOut"].astype(np.float64))).sum(1))  # bound is useful


def test_kernel_rounds_mean_times_sum_dy_before_the_subtraction():
    """No fused multiply-add: t = f32(mean·Σdy), then Σdy·x − t (an fma would give −2^-23)."""
    a = make_args(shape=(1, 1, 3))
    a["gradOut"], a["input"] = np.float32([[[1, 1, 1]]]), np.float32([[[1, 1, 1 + 2 ** -22]]])
    a["mean"], a["invstd"] = np.float32([1 + 2 ** -23]), np.float32([3])
    run(a)
    t = F32(a["mean"][0] * F32(3))
    assert a["sumDyXmu"][0] == F32(F32(3 + 2 ** -22) - t) and a["gradWeight"][0] == a["sumDyXmu"][0] * F32(3)


def test_nan_and_inf_stay_in_their_channel():
    a = make_args(shape=(2, 4, 5), seed=4)
    a["gradOut"][1, 0, 2] = np.nan
    a["input"][0, 1, 3] = np.inf
    a["invstd"][2] = np.inf
    a["mean"][3] = -np.inf
    run(a, "Ascend950")
    want = model(a["gradOut"], a["input"], a["mean"], a["invstd"])
    for n in OUTPUTS:
        assert_same(a[n], want[n])
    assert np.isnan(a["sumDy"][0]) and np.isfinite(a["sumDy"][1:]).all()
    assert np.isnan(a["gradWeight"][2]) or np.isinf(a["gradWeight"][2])


@pytest.mark.parametrize("empty", ["input", "gradOut", "mean", "invstd"])
def test_empty_tensor_gives_zeros_on_950_and_nothing_elsewhere(empty):
    a = make_args(masks=(True, False, True))
    a[empty] = np.zeros((2, 3, 0) if empty in ("input", "gradOut") else (0,), F32)
    b = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in a.items()}
    run(a, "Ascend950")
    for n in ("sumDy", "sumDyXmu", "gradBias"):
        assert np.array_equal(bits(a[n]), np.zeros(3, np.uint32))
    assert a["gradWeight"].tobytes() == sentinel((3,), F32).tobytes()  # masked off
    run(b, "Ascend910B")
    assert out_bytes(b) == [sentinel((3,), F32).tobytes()] * 4


def test_strided_inputs_and_outputs_give_the_same_bits():
    a = make_args(shape=(3, 4, 5, 6), dtype=F16, odtype=F16, seed=5)
    run(a)
    b = dict(a)
    b["gradOut"] = np.ascontiguousarray(a["gradOut"].transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    big = np.zeros((3, 4, 5, 12), F16)
    big[..., ::2] = a["input"]
    b["input"] = big[..., ::2]
    b["mean"] = np.repeat(a["mean"], 3)[::3]
    bufs = {}
    for n in OUTPUTS:
        bufs[n] = sentinel((8,), F16)
        b[n] = opgraph.Tensor(bufs[n], (4,), (2,), offset=1)
    for level in (0, 1, 2):
        run(b, "Ascend950", level)
        for n in OUTPUTS:
            assert np.array_equal(bits(bufs[n][1::2]), bits(a[n]))
            assert bufs[n][0::2].tobytes() == sentinel((4,), F16).tobytes()


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_levels_0_1_2_identical_bits(soc, dtype):
    results = []
    for level in (0, 1, 2):
        a = make_args(shape=(2, 5, 3, 7), dtype=dtype, pdtype=dtype, odtype=dtype, weight=False, seed=6)
        run(a, soc, level)
        results.append(b"".join(out_bytes(a)))
    assert results[0] == results[1] == results[2]


def test_a_cached_executor_follows_the_masks():
    a = make_args(masks=(True, False, True))
    run(a)
    b = make_args(masks=(False, True, False))
    run(b)
    want = model(b["gradOut"], b["input"], b["mean"], b["invstd"])
    assert_same(b["gradWeight"], want["gradWeight"])
    assert b["sumDy"].tobytes() == sentinel((3,), F32).tobytes()


def test_backend_kit_numpy():
    report = check_backend("numpy", op_apis=["aclnnBatchNormReduceBackward"],
                           platforms=["Ascend910B", "Ascend950"], shapes=[(2, 3, 4, 4)], levels=(0, 2))
    assert report.ok and report.cases == 2 * 3 * 16 * 2 * 2, str(report)


# --- 7. CLI -----------------------------------------------------------------------------------
def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", [
    ["run", "--platform", "Ascend950", "--dtype", "bfloat16", "--no-weight-g"],
    ["run", "--no-input-g", "--no-bias-g", "--param-dtype", "float16"],
    ["run", "--shape", "2,3,0", "--platform", "Ascend950"],
    ["dump", "--format", "text", "--no-weight", "--level", "1"],
    ["dump", "--format", "text", "--no-weight", "--level", "2"],
    ["dump", "--format", "json"], ["dump", "--format", "dot"], ["dump", "--stats"],
    ["plan"], ["plan", "--level", "1", "--format", "json"]])
def test_cli_commands_work(capsys, argv):
    code, out, err = cli(capsys, argv[0], "aclnnBatchNormReduceBackward", "--shape", "2,3,4", *argv[1:])
    assert code == 0 and not err, err
    if argv[0] == "run":
        errs = [float(line.split()[3]) for line in out.splitlines() if line.startswith("max rel error")]
        assert errs and max(errs) < 1e-2 and "phase 2:       0" in out
    if "--no-input-g" in argv:
        assert "sumDy NULL" in out and "output:        sumDyXmu" not in out
    if argv[:3] == ["dump", "--format", "text"]:
        # CANN launches the ones-Fill of a NULL weight though nothing reads it (level 1 keeps every
        # launch); level 2's dead-code elimination drops it
        assert ("Fill(shape=[3], value=1.0)" in out) == (argv[-1] == "1")


@pytest.mark.parametrize("cmd", [["emit-c"], ["emit-cpp", "-o", "-"], ["run", "--platform", "Ascend310P"]])
def test_cli_commands_work_or_fail_in_one_line(capsys, cmd):
    code, out, err = cli(capsys, cmd[0], "aclnnBatchNormReduceBackward", *cmd[1:])
    if code != 0:
        assert err.count("\n") == 1 and err.startswith("opgraph:"), err
    else:
        assert "aclnnBatchNormReduceBackward" in out


# --- 8. the Pythonic API ----------------------------------------------------------------------
def test_pythonic_values_none_and_dtypes():
    a = make_args(shape=(3, 2, 5), seed=8)
    sd, sx, gw, gb = batch_norm_backward_reduce(a["gradOut"], a["input"], a["mean"], a["invstd"],
                                                None, True, False, True)
    want = model(a["gradOut"], a["input"], a["mean"], a["invstd"])
    assert gw is None
    for got, n in ((sd, "sumDy"), (sx, "sumDyXmu"), (gb, "gradBias")):
        assert_same(got, want[n])
    # torch_npu: float16 outputs only when input and mean are both float16
    for dt, pdt, want_dt in ((F16, F16, F16), (F16, F32, F32), (BF16, BF16, F32), (F32, F16, F32)):
        b = make_args(dtype=dt, pdtype=pdt)
        with opgraph.platform("Ascend950"):
            r = batch_norm_backward_reduce(b["gradOut"], b["input"], b["mean"], b["invstd"],
                                           b["weight"], True, True, True)
        assert [v.dtype for v in r] == [np.dtype(want_dt)] * 4
    assert batch_norm_backward_reduce(a["gradOut"], a["input"], a["mean"], a["invstd"], None,
                                      False, False, False) == (None,) * 4


@pytest.mark.parametrize("change,status,name", [
    (up(input=None, mean=None), NULLPTR, "input"), (up(gradOut=lambda v: v.astype(I32)), INVALID, "gradOut"),
    (up(invstd="x"), INVALID, "invstd")])
def test_pythonic_errors(change, status, name):
    a = make_args()
    change(a)
    with pytest.raises(opgraph.AclnnError) as e:
        batch_norm_backward_reduce(*(a[n] for n in INPUTS), True, True, True)
    assert e.value.status == status and name in str(e.value)


def test_pythonic_empty_input_on_910b_returns_zeros_not_uninitialised_memory():
    """The 910B op_api records nothing for an empty input; the arrays the Pythonic function
    creates must still hold defined values."""
    x = np.zeros((0, 4, 5, 5), np.float32)
    c = np.ones(4, np.float32)
    with opgraph.platform("Ascend910B"):
        for _ in range(3):  # fresh allocations each time: garbage would show up
            sums = opgraph.ops.batch_norm_backward_reduce(x, x, c, c, c, True, True, True)
            assert all(s is not None and s.shape == (4,) and not s.any() for s in sums)
