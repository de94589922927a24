"""aclnnBatchNormReduceBackward (family facts §B, sheet §4.5–4.7): the vendor's check table and
order (status, the argument named, outputs untouched), the l0 graph op by op on both SoC
families, and the model the numerics are checked against (the documented summation order one
add at a time, then the kernel's three float32 steps; test_batch_norm_reduce_backward_numerics.py)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import passes
from opgraph.aclnn.batch_norm_reduce_backward import (
    aclnnBatchNormReduceBackward as phase2, aclnnBatchNormReduceBackwardGetWorkspaceSize as phase1)
from sum_model import channel_sums

F32, F16, BF16, I32 = np.float32, np.float16, ml_dtypes.bfloat16, np.int32
INPUTS = ("gradOut", "input", "mean", "invstd", "weight")
MASKS = ("inputG", "weightG", "biasG")
OUTPUTS = ("sumDy", "sumDyXmu", "gradWeight", "gradBias")
ARGS = INPUTS + MASKS + OUTPUTS
NULLPTR, INVALID, INNER_NULLPTR, NO_KERNEL = 161001, 161002, 561103, 561003
SUPPORTED = ("Ascend910B", "Ascend910_93", "Ascend950", "Ascend910")
U = 2.0 ** -24  # unit roundoff of float32


# --- an independent model: the documented order (tests/sum_model.py), one add at a time ---------
def rows(a: np.ndarray) -> np.ndarray:
    """[N, C, ...] → [C, R], the reduced elements of each channel in row-major order."""
    return np.moveaxis(a, 1, 0).reshape(a.shape[1], -1)


def model(dy, x, mean, invstd) -> dict[str, np.ndarray]:
    """Every output in float32: Σdy·x (product in f32), Σdy, then sumDyX − mean·sumDy, ·invstd."""
    dyf, xf = np.asarray(dy).astype(F32), np.asarray(x).astype(F32)
    s_dyx, s_dy = channel_sums(rows(dyf * xf)), channel_sums(rows(dyf))
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
    s_dyx = channel_sums(rows(np.broadcast_to(a["gradOut"], a["input"].shape) * a["input"]))
    s_dy = channel_sums(rows(a["gradOut"]))
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
