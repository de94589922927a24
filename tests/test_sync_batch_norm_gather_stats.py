"""aclnnSyncBatchNormGatherStats (syncbn-family.md §6): the vendor's check table and order, the
empty cases, the l0 graph on both SoC families, the SyncBatchNormGatherStats kernel's bits
against an independent model written here (950: the arch35 source and AscendC ReduceSum<RA>
fold orders; 910B: the experimental kernel), IEEE specials, strided tensors, launch counts,
levels, the backend kit, the CLI and the Pythonic function."""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import aclnn, passes
from opgraph.cli import main
from opgraph.core.dtypes import PRIVATE_FORMATS
from opgraph.core.dtypes import DataType as D
from opgraph.core.opdef import L0Error, get_op
from opgraph.core.types import TensorType
from opgraph.testing import check_backend
from l0ops.sync_bn_gather_stats import SyncBatchNormGatherStats, plan_950
from opgraph.aclnn.sync_batch_norm_gather_stats import (aclnnSyncBatchNormGatherStats,
                                                        aclnnSyncBatchNormGatherStatsGetWorkspaceSize,
                                                        reference, sync_batch_norm_gather_stats)

OP = "aclnnSyncBatchNormGatherStats"
F32, F16, BF16, I32 = np.float32, np.float16, ml_dtypes.bfloat16, np.int32
TENSORS = ("totalSum", "totalSquareSum", "sampleCount", "mean", "variance", "batchMean", "batchInvstd")
ORDER = TENSORS[:5] + ("momentum", "eps") + TENSORS[5:]
WRITTEN = ("mean", "variance", "batchMean", "batchInvstd")
NULLPTR, INVALID, NO_KERNEL = 161001, 161002, 561003
f32 = np.float32


# --- arguments ----------------------------------------------------------------------------------
def valid(n=3, c=4, dtype=F32, count=I32, batch=None, seed=0, momentum=0.1, eps=1e-5) -> dict:
    rng = np.random.default_rng(seed)
    cnt = rng.integers(1, 20, n)
    mu = rng.normal(0, 1, (n, c))
    return dict(totalSum=(cnt[:, None] * mu).astype(dtype),
                totalSquareSum=(cnt[:, None] * (mu * mu + rng.uniform(0.5, 2, (n, c)))).astype(dtype),
                sampleCount=cnt.astype(count), mean=rng.normal(0, 0.5, c).astype(dtype),
                variance=rng.uniform(0.5, 1.5, c).astype(dtype),
                batchMean=np.full(c, 7, batch or dtype), batchInvstd=np.full(c, 7, batch or dtype),
                momentum=momentum, eps=eps)


def fresh(a: dict) -> dict:
    return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in a.items()}


def wrap(v):
    return opgraph.tensor(v) if isinstance(v, np.ndarray) else v


def phase1(args: dict, soc="Ascend910B"):
    with opgraph.platform(soc):
        st, ws, ex = aclnnSyncBatchNormGatherStatsGetWorkspaceSize(*[wrap(args[k]) for k in ORDER])
    return int(st), ws, ex, aclnn.aclGetRecentErrMsg()


def run(args: dict, soc="Ascend910B", level=2) -> dict:
    with opgraph.platform(soc), opgraph.opt_level(level):
        st, ws, ex, msg = phase1(args, soc)
        assert st == 0, msg
        assert int(aclnnSyncBatchNormGatherStats(bytearray(ws) if ws else None, ws, ex)) == 0
    return {k: np.asarray(args[k]) for k in WRITTEN}


def snapshot(args: dict) -> dict:
    return {k: (args[k].storage if isinstance(args[k], opgraph.Tensor) else args[k]).tobytes()
            for k in WRITTEN if args[k] is not None}


_NAME = re.compile(r"(?<![A-Za-z])(" + "|".join(sorted(TENSORS, key=len, reverse=True)) + r")(?![A-Za-z])")


def expect_error(args: dict, status: int, name: str, soc="Ascend910B", *words: str) -> str:
    before = snapshot(args)
    st, ws, ex, msg = phase1(args, soc)
    assert st == status, msg
    assert ex is None and ws == 0
    found = _NAME.search(msg)
    assert found and found.group(1) == name, f"message should name {name} first: {msg!r}"
    for w in words:
        assert w in msg, msg
    assert snapshot(args) == before, "a failing call wrote an output or a running statistic"
    return msg


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}")


def assert_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    same = (bits(got) == bits(want)) | (np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64)))
    assert same.all(), f"{got} != {want}"


# --- the check table ----------------------------------------------------------------------------
def change(**kw):
    """A mutation of valid() arguments: each name gets f(old value), or the value given."""
    return lambda a: a.update({k: f(a[k]) if callable(f) else f for k, f in kw.items()})


def to(dtype):
    return lambda x: x.astype(dtype)


def fmt(name):
    return lambda x: opgraph.tensor(x, format=name)


def resized(*shape):
    return lambda x: np.resize(x, shape)


BAD_DTYPES = dict(totalSum=I32, totalSquareSum=np.float64, sampleCount=np.int64, mean=np.int8,
                  variance=np.uint8, batchMean=I32, batchInvstd=np.float64)
EQUALITIES = [("totalSquareSum", (2, 4), "N = 3"), ("totalSquareSum", (3, 5), "C = 4"),
              ("sampleCount", (4,), "N = 3"), ("mean", (5,), "C = 4"), ("variance", (3,), "C = 4"),
              ("batchMean", (1,), "C = 4"), ("batchInvstd", (8,), "C = 4")]
CHECKS = {  # id: (mutation of valid(), status, the argument named first, words in the message)
    **{f"null-{n}": (change(**{n: None}), NULLPTR, n, "NULL") for n in TENSORS},
    **{f"dtype-{n}": (change(**{n: to(d)}), INVALID, n, "not supported") for n, d in BAD_DTYPES.items()},
    **{f"bf16-{n}": (change(**{n: to(BF16)}), INVALID, n, "BF16") for n in TENSORS},  # 910B
    **{f"group-{n}": (change(**{n: to(F16)}), INVALID, n, "must equal")
       for n in ("totalSquareSum", "mean", "variance", "batchInvstd")},
    **{f"private-{n}-{f}": (change(**{n: fmt(f)}), INVALID, n, f)
       for n in TENSORS[:5] for f in ("NC1HWC0", "FRACTAL_NZ")},
    **{f"rank-{n}": (change(**{n: (lambda x: x[..., None]) if n != "totalSum" else (lambda x: x.ravel())}),
                     INVALID, n, "rank") for n in TENSORS},
    **{f"{w[0]}-{n}": (change(**{n: resized(*shape)}), INVALID, n, w) for n, shape, w in EQUALITIES},
    "null-before-dtype": (change(totalSum=to(np.int64), batchInvstd=None), NULLPTR, "batchInvstd", "NULL"),
    "dtype-before-format": (change(totalSum=lambda x: opgraph.tensor(x[:, :, None], format="NC1HWC0"),
                                   batchInvstd=to(I32)), INVALID, "batchInvstd", "dtype"),
    "format-before-shape": (change(sampleCount=fmt("FRACTAL_NZ"), mean=lambda x: x[:2]), INVALID,
                            "sampleCount", "private"),
    "equalities-in-order": (change(batchInvstd=resized(2), sampleCount=resized(2)), INVALID,
                            "sampleCount", "N = 3"),
}


@pytest.mark.parametrize("case", CHECKS)
def test_check_table_and_order(case):
    mutate, status, name, *words = CHECKS[case]
    args = valid()
    mutate(args)
    expect_error(args, status, name, "Ascend910B", *words)


@pytest.mark.parametrize("name", TENSORS)
def test_bf16_passes_the_dtype_lists_on_950(name):
    args = valid()
    args[name] = args[name].astype(BF16)
    if name == "sampleCount":
        run(args, "Ascend950")
    else:  # supported there, but it no longer matches its dtype group (named: the later one)
        partner = {"totalSum": "totalSquareSum", "batchMean": "batchInvstd"}.get(name, name)
        assert "not supported" not in expect_error(args, INVALID, partner, "Ascend950", "must equal")


@pytest.mark.parametrize("mutate", [change(), change(sampleCount=to(F32)), change(sampleCount=to(F16)),
                                    change(batchMean=to(F16), batchInvstd=to(F16))])
def test_accepted_dtype_mixes(mutate):
    args = valid()
    mutate(args)
    assert all(np.isfinite(v).all() for v in run(args).values())
    assert run(valid(dtype=BF16), "Ascend950")["batchMean"].dtype == BF16


@pytest.mark.parametrize("f", sorted(f.name for f in PRIVATE_FORMATS))
def test_private_format_is_not_checked_on_batch_outputs(f):
    args = valid()  # CheckFormat looks at the five inputs only
    args["batchMean"] = opgraph.tensor(args["batchMean"], format=f)
    assert phase1(args)[0] == 0


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_no_ranks_is_161002_after_the_other_checks(soc):
    args = valid(n=0)
    expect_error(args, INVALID, "totalSum", soc, "dim 0")
    args["batchMean"] = None
    expect_error(args, NULLPTR, "batchMean", soc)


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950", "Ascend910"])
def test_no_channels_succeeds_and_launches_nothing(soc):
    args = valid(c=0)
    st, ws, ex, msg = phase1(args, soc)
    assert st == 0 and ws == 0 and ex.graph.nodes == [], msg
    assert int(aclnnSyncBatchNormGatherStats(None, 0, ex)) == 0


@pytest.mark.parametrize("soc", ["Ascend910", "Ascend310P", "Ascend310B"])
def test_soc_without_the_kernel_is_561003_after_the_checks(soc):
    args = valid()
    before = snapshot(args)
    st, ws, ex, msg = phase1(args, soc)
    assert st == NO_KERNEL and ex is None and "SyncBatchNormGatherStats" in msg and soc in msg
    assert snapshot(args) == before
    args["mean"] = args["mean"].astype(I32)
    expect_error(args, INVALID, "mean", soc)


def test_phase1_writes_nothing_and_phase2_updates_in_place():
    args = valid()
    before = snapshot(args)
    st, ws, ex, msg = phase1(args)
    assert st == 0 and snapshot(args) == before
    aclnnSyncBatchNormGatherStats(bytearray(ws) if ws else None, ws, ex)
    assert all(snapshot(args)[k] != before[k] for k in WRITTEN)


# --- the graph ----------------------------------------------------------------------------------
def listing(ex) -> list[str]:
    return [f"{n.op}:{','.join(str(o.type) for o in n.outputs)}" for n in ex.graph.nodes]


@pytest.mark.parametrize("soc,arch", [("Ascend910B", 2201), ("Ascend910_93", 2201), ("Ascend950", 3510)])
@pytest.mark.parametrize("dtype,t", [(F32, "f32"), (F16, "f16"), (BF16, "bf16")])
def test_graph_op_by_op(soc, arch, dtype, t):
    if dtype is BF16 and arch != 3510:
        return
    st, _, ex, msg = phase1(valid(n=3, c=4, dtype=dtype), soc)
    assert st == 0, msg
    v = f"{t}[4]"
    assert listing(ex) == [f"Contiguous:{t}[3,4]", f"Contiguous:{t}[3,4]", "Contiguous:s32[3]",
                           "Cast:s32[3]", f"Contiguous:{v}", f"Contiguous:{v}",
                           f"SyncBatchNormGatherStats:{v},{v},{v},{v}",
                           f"Cast:{v}", f"ViewCopy:{v}", f"Cast:{v}", f"ViewCopy:{v}",
                           f"Cast:{v}", f"ViewCopy:{v}", f"Cast:{v}", f"ViewCopy:{v}"]
    nodes = ex.graph.nodes
    kern = nodes[6]
    assert [i.name for i in kern.inputs] == [nodes[k].outputs[0].name for k in (0, 1, 3, 4, 5)]
    assert kern.attrs.arch == arch and kern.attrs.momentum == float(f32(0.1))
    assert kern.attrs.eps == float(f32(1e-5))
    if arch == 3510:
        assert (kern.attrs.cores, kern.attrs.ub_size) == (64, 245760)
    written = [n.inputs[1].name for n in nodes if n.op == "ViewCopy"]
    assert written == ["batchMean", "batchInvstd", "mean", "variance"]
    assert [n.inputs[0] for n in nodes[7::2]] == list(kern.outputs)


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_graph_real_casts_for_float_counts_and_other_batch_dtypes(soc):
    st, _, ex, _ = phase1(valid(count=F16, batch=F16), soc)
    casts = [(str(n.inputs[0].type), n.attrs.to.short) for n in ex.graph.nodes if n.op == "Cast"]
    assert casts == [("f16[3]", "s32"), ("f32[4]", "f16"), ("f32[4]", "f16"), ("f32[4]", "f32"),
                     ("f32[4]", "f32")]


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("count,batch,launches", [(I32, None, 1), (F32, None, 2), (I32, F16, 3)])
def test_level1_launch_counts(soc, count, batch, launches):
    st, _, ex, _ = phase1(valid(count=count, batch=batch), soc)
    stats = [passes.graph_stats(passes.optimize(ex.graph, n)).launches for n in (0, 1)]
    assert stats == [launches + 4, launches]  # level 0 also copies into the four user tensors


# --- numerics: an independent model -------------------------------------------------------------
def fold_tree(rows: int, grouped: bool):
    """Index tree of AscendC ReduceSum<RA>: tail rows onto the largest power of two, then halves
    (grouped: consecutive 16-row groups first)."""
    m = 1 << (rows.bit_length() - 1)
    items = [(r, m + r) if m + r < rows else r for r in range(m)]

    def halves(xs):
        while len(xs) > 1:
            h = len(xs) // 2
            xs = [(xs[i], xs[i + h]) for i in range(h)]
        return xs[0]
    while grouped and len(items) >= 16:
        items = [halves(items[g:g + 16]) for g in range(0, len(items), 16)]
    return halves(items)


def evaluate(tree, x: np.ndarray) -> np.ndarray:
    if isinstance(tree, tuple):
        return (evaluate(tree[0], x) + evaluate(tree[1], x)).astype(f32)
    return x[tree]


def sequential(x: np.ndarray) -> np.ndarray:
    acc = np.zeros(x.shape[1], f32)
    for row in x:
        acc = (acc + row).astype(f32)
    return acc


def model(a: dict, arch: int, sums) -> list[np.ndarray]:
    """The kernel's per-channel steps (syncbn-family.md §6.6) on sums S, Q given by ``sums``."""
    x = {k: np.asarray(a[k]).astype(f32) for k in ("totalSum", "totalSquareSum", "mean", "variance")}
    m, eps = f32(a["momentum"]), f32(a["eps"])
    cnt = np.trunc(np.asarray(a["sampleCount"]).astype(np.float64)).astype(np.int64)
    with np.errstate(all="ignore"):
        if arch == 3510:
            n = f32(int(cnt.sum()))
            reci, k = f32(1) / n, n / (n - f32(1)) * m
        else:
            n = f32(0)
            for c in cnt:
                n = f32(n + f32(c))
            reci = f32(0) if n == 0 else f32(1) / n
            k = n / (n - f32(1)) * m if n > 1 else m
        s, q = sums(x["totalSum"]), sums(x["totalSquareSum"])
        bm = s * reci
        var = q * reci - bm * bm
        out = [bm, f32(1) / np.sqrt(var + eps), x["mean"] * (f32(1) - m) + bm * m,
               var * k + x["variance"] * (f32(1) - m)]
    dt = np.asarray(a["totalSum"]).dtype
    return [o.astype(f32).astype(dt) for o in out]


def wide(n, c, seed, dtype=F32) -> dict:
    """Arguments whose sums depend on the order of the additions."""
    a = valid(n, c, dtype, seed=seed)
    rng = np.random.default_rng(seed + 100)
    a["totalSum"] = (rng.standard_normal((n, c)) * 10.0 ** rng.uniform(-3, 3, (n, c))).astype(dtype)
    top = 3 if dtype is F16 else 5  # float16 tops out at 65504
    a["totalSquareSum"] = (rng.uniform(0, 1, (n, c)) * 10.0 ** rng.uniform(-3, top, (n, c))).astype(dtype)
    return a


def check(a: dict, soc: str, sums) -> None:
    arch = 3510 if soc == "Ascend950" else 2201
    want = model(a, arch, sums)
    got = run(a, soc)
    for name, w in zip(("batchMean", "batchInvstd", "mean", "variance"), want):
        assert_bits(got[name], w)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("n,c", [(1, 5), (2, 3), (3, 7), (5, 16), (17, 40), (31, 9)])
def test_950_bits_below_32_ranks(dtype, n, c):
    check(wide(n, c, n * 7 + c, dtype), "Ascend950", lambda x: evaluate(fold_tree(len(x), False), x))


def test_950_three_ranks_add_the_tail_row_first():
    assert fold_tree(3, False) == ((0, 2), 1)

    def args():
        a = valid(n=3, c=1)
        a["totalSum"] = np.float32([[1e8], [1.0], [-1e8]])
        a["sampleCount"] = np.int32([1, 1, 1])
        return a
    assert run(args(), "Ascend950")["batchMean"][0] == f32(1) / f32(3)  # (1e8 − 1e8) + 1
    assert run(args(), "Ascend910B")["batchMean"][0] == 0  # (1e8 + 1) − 1e8, row by row


def test_950_wide_tiles_halve_64_ranks():
    assert set(plan_950(64, 8, 4, 64, 245760).widths) == {8}  # 8 floats per tile: halving path
    a = wide(64, 8, 3)
    check(a, "Ascend950", lambda x: evaluate(fold_tree(64, False), x))


def test_950_tiles_of_48_floats_fold_16_row_groups():
    plan = plan_950(64, 1536, 4, 64, 245760)  # C over 32 cores: 48 columns (192 bytes) per tile
    assert plan.n_factor is None and set(plan.widths) == {48}
    a = wide(64, 1536, 5)
    grouped, halved = (evaluate(fold_tree(64, g), a["totalSum"]) for g in (True, False))
    assert (bits(grouped) != bits(halved)).any()  # the data tells the two orders apart
    check(a, "Ascend950", lambda x: evaluate(fold_tree(64, True), x))


def halves_of(parts: list) -> np.ndarray:
    """The kernel's binary cache over a power-of-two count: (p0 + p1) + (p2 + p3) ..."""
    if len(parts) == 1:
        return parts[0]
    h = len(parts) // 2
    return (halves_of(parts[:h]) + halves_of(parts[h:])).astype(f32)


@pytest.mark.parametrize("n,blocking", [(500, (128, 2, 1, 116)), (1000, (128, 4, 3, 104))])
def test_950_beyond_the_ub_folds_row_blocks_pairwise(n, blocking):
    # > 465 float32 rows do not fit one UB tile: blocks of 128 rows, the last ones folded onto
    # the first (by hand from the arch35 tiling for C = 8 on 64 cores and 240 KiB of UB)
    plan = plan_950(n, 8, 4, 64, 245760)
    assert (plan.n_factor, plan.basic, plan.folds, plan.tail) == blocking
    nf, basic, folds, tail = blocking

    def sums(x):
        parts = []
        for b in range(basic):
            blk = x[b * nf:(b + 1) * nf].copy()
            extra = nf if b < folds else (tail if b == folds else 0)
            blk[:extra] = blk[:extra] + x[(b + basic) * nf:(b + basic) * nf + extra]
            parts.append(evaluate(fold_tree(nf, False), blk))
        return halves_of(parts)
    check(wide(n, 8, 11), "Ascend950", sums)


def test_950_full_load_limits():
    nf = {(n, size): plan_950(n, 8, size, 64, 245760).n_factor
          for n, size in ((465, 4), (466, 4), (235, 2), (236, 2))}
    assert nf == {(465, 4): None, (466, 4): 128, (235, 2): None, (236, 2): 64}


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend910_93"])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("n,c", [(1, 3), (4, 9), (40, 33)])
def test_910b_bits_sequential_sums(soc, dtype, n, c):
    check(wide(n, c, n + c, dtype), soc, sequential)


def test_counts_exact_int64_on_950_float_on_910b():
    a = valid(n=3, c=2)
    a["sampleCount"] = np.int32([1 << 24, 1, 1])  # 2**24 + 2 is a float32; 2**24 + 1 is not
    check(fresh(a), "Ascend950", lambda x: evaluate(fold_tree(3, False), x))
    check(fresh(a), "Ascend910B", sequential)
    b950, b910 = run(fresh(a), "Ascend950")["batchMean"], run(fresh(a), "Ascend910B")["batchMean"]
    assert (bits(b950) != bits(b910)).all()


def test_float_counts_are_truncated_to_int32():
    a, b = valid(n=2, c=3), valid(n=2, c=3)
    a["sampleCount"] = np.float32([2.9, 3.99])
    b["sampleCount"] = np.int32([2, 3])
    for soc in ("Ascend910B", "Ascend950"):
        assert all((bits(x) == bits(y)).all() for x, y in zip(run(fresh(a), soc).values(),
                                                               run(fresh(b), soc).values()))


@pytest.mark.parametrize("dtype", [F32, F16])
def test_close_to_the_float64_formula(dtype):
    a = valid(n=16, c=32, dtype=dtype, seed=9)
    want = reference(a)
    for soc in ("Ascend910B", "Ascend950"):
        got = run(valid(n=16, c=32, dtype=dtype, seed=9), soc)
        tol = 2e-5 if dtype is F32 else 4e-3
        for k in WRITTEN:
            np.testing.assert_allclose(got[k].astype(np.float64), want[k], rtol=tol, atol=tol)


# --- IEEE specials and Σcount ≤ 1 ---------------------------------------------------------------
@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_nan_and_inf_stay_in_their_channel(soc):
    a = valid(n=3, c=4)
    a["totalSum"][1, 2] = np.nan
    a["totalSquareSum"][0, 0] = np.inf
    out = run(a, soc)
    assert all(np.isnan(out[k][2]) for k in WRITTEN)
    assert out["batchInvstd"][0] == 0 and out["variance"][0] == np.inf
    assert all(np.isfinite(out[k][[1, 3]]).all() for k in WRITTEN)


@pytest.mark.parametrize("counts", [[0, 0], [1, 0], [0, 1]])
@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_at_most_one_sample_guarded_on_910b_only(counts, soc):
    a = valid(n=2, c=3, momentum=0.5, eps=0.25)
    a["sampleCount"] = np.int32(counts)
    rv = a["variance"].copy()
    check(a, soc, sequential)  # two rows: every order is the same
    out = {k: np.asarray(a[k]) for k in WRITTEN}
    if soc == "Ascend950":  # 1/0 or k = n/(n − 1) = inf: nothing finite in the variance update
        assert not np.isfinite(out["variance"]).any()
    elif sum(counts) == 0:  # reci = 0: mean 0, var 0, invstd 1/sqrt(eps), rv·(1 − m)
        assert (out["batchMean"] == 0).all() and (out["batchInvstd"] == 2).all()
        assert_bits(out["variance"], rv * f32(0.5))
    else:
        assert np.isfinite(out["variance"]).all()


# --- layouts, levels, backends --------------------------------------------------------------------
def strided(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    buf = np.full(a.size * 2, -3, a.dtype)
    view = buf[::2]
    view[...] = a
    return view, buf


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_non_contiguous_inputs_and_outputs(soc):
    base = valid(n=5, c=6, seed=4)
    want = run(fresh(base), soc)
    a = dict(base)
    a["totalSum"] = np.ascontiguousarray(base["totalSum"].T).T  # a transposed view
    a["totalSquareSum"] = np.ascontiguousarray(base["totalSquareSum"].T).T
    a["sampleCount"] = np.repeat(base["sampleCount"], 2)[::2]
    bufs = {}
    for k in WRITTEN:
        a[k], bufs[k] = strided(base[k])
    st, _, ex, _ = phase1(a, soc)
    assert passes.graph_stats(passes.optimize(ex.graph, 1)).launches == 10  # 5 copies in, 4 out
    got = run(a, soc)
    for k in WRITTEN:
        assert_bits(got[k], want[k])
        assert (bufs[k][1::2] == -3).all(), f"{k}: wrote outside its view"


@pytest.mark.parametrize("soc,dtype", [("Ascend910B", F16), ("Ascend950", BF16), ("Ascend950", F32)])
def test_levels_give_identical_bits(soc, dtype):
    outs = [run(wide(40, 48, 1, dtype), soc, level) for level in (0, 1, 2)]
    for k in WRITTEN:
        assert_bits(outs[1][k], outs[0][k])
        assert_bits(outs[2][k], outs[0][k])


def test_backend_kit_numpy():
    report = check_backend("numpy", op_apis=[OP])
    assert report.ok and report.cases == 84, str(report)


# --- the l0 op ------------------------------------------------------------------------------------
def test_l0_op_rejects_what_the_kernel_cannot_take():
    op, t = get_op("SyncBatchNormGatherStats"), TensorType
    attrs = {a: op.make_attrs(momentum=0.1, eps=0.0, arch=a) for a in (2201, 3510, 1001)}
    good = [t((2, 3), D.FLOAT), t((2, 3), D.FLOAT), t((2,), D.INT32), t((3,), D.FLOAT), t((3,), D.FLOAT)]
    assert [str(x) for x in op.infer_types(good, attrs[2201])] == ["f32[3]"] * 4
    for k, bad in ((2, t((2,), D.FLOAT)), (3, t((4,), D.FLOAT)), (0, t((0, 3), D.FLOAT))):
        with pytest.raises(L0Error):
            op.infer_types(good[:k] + [bad] + good[k + 1:], attrs[2201])
    bf = [x.with_(dtype=D.BF16) if x.dtype == D.FLOAT else x for x in good]
    with pytest.raises(L0Error, match="f32, f16"):
        op.infer_types(bf, attrs[2201])
    assert len(op.infer_types(bf, attrs[3510])) == 4
    with pytest.raises(L0Error, match="DAV_1001"):
        op.infer_types(good, attrs[1001])
    kinds = {f.archs: f.kind for f in SyncBatchNormGatherStats.fidelity}
    assert kinds == {(3510,): "bit-faithful", (2201,): "formula"}


# --- CLI and Pythonic API ------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["run", OP, "--shape", "3,5"], ["dump", OP, "--format", "json"], ["dump", OP, "--stats"],
    ["run", OP, "--platform", "Ascend950", "--dtype", "bfloat16", "--count-dtype", "float32"],
    ["plan", OP], ["emit-c", OP], ["emit-cpp", OP]])
def test_cli_commands_work_or_fail_in_one_line(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    if code:
        assert len(err.strip().splitlines()) == 1 and err.startswith("opgraph:"), err
    else:
        assert out and not err
    if argv[0] in ("run", "dump", "plan"):
        assert code == 0, err


@pytest.mark.parametrize("argv", [["run", OP, "--shape", "2,3,4"], ["run", OP, "--shape", "0,4"],
                                  ["run", OP, "--dtype", "bfloat16"],
                                  ["run", OP, "--platform", "Ascend910"]])
def test_cli_bad_cases_are_one_line(capsys, argv):
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("opgraph:"), err


def test_pythonic_updates_running_stats_and_returns_batch_stats():
    a = valid(n=4, c=3, dtype=F16, seed=2)
    rm, rv = a["mean"].copy(), a["variance"].copy()
    want = run(fresh(a), "Ascend910B")
    bm, bi = sync_batch_norm_gather_stats(a["totalSum"], a["totalSquareSum"], a["sampleCount"], rm, rv,
                                          a["momentum"], a["eps"])
    for got, k in ((bm, "batchMean"), (bi, "batchInvstd"), (rm, "mean"), (rv, "variance")):
        assert_bits(got, want[k])


def test_pythonic_raises_and_writes_nothing():
    a = valid()
    rm, rv = a["mean"].copy(), a["variance"].copy()
    with pytest.raises(opgraph.AclnnError, match="sampleCount") as e:
        sync_batch_norm_gather_stats(a["totalSum"], a["totalSquareSum"], a["sampleCount"][:2], rm, rv,
                                     0.1, 1e-5)
    assert e.value.status == INVALID
    assert (bits(rm) == bits(a["mean"])).all() and (bits(rv) == bits(a["variance"])).all()
    with pytest.raises(opgraph.AclnnError, match="mean"):  # a list cannot be updated in place
        sync_batch_norm_gather_stats(a["totalSum"], a["totalSquareSum"], a["sampleCount"],
                                     a["mean"].tolist(), rv, 0.1, 1e-5)
    assert (bits(rv) == bits(a["variance"])).all()
