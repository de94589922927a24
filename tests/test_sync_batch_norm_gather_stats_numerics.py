"""aclnnSyncBatchNormGatherStats' numerics: the kernel's bits against an independent model written
here (950: the arch35 source and AscendC ReduceSum<RA> fold orders; 910B: the experimental
kernel), counts, the float64 formula, IEEE specials and Σcount ≤ 1, strided tensors, levels,
the backend kit, the CLI and the Pythonic function (the checks and the graph:
test_sync_batch_norm_gather_stats.py)."""
from __future__ import annotations

import numpy as np
import pytest

import opgraph
from l0ops.sync_bn_gather_stats import SyncBatchNormGatherStats, plan_950
from opgraph import passes
from opgraph.aclnn.sync_batch_norm_gather_stats import reference, sync_batch_norm_gather_stats
from opgraph.cli import main
from opgraph.core.dtypes import DataType as D
from opgraph.core.opdef import L0Error, get_op
from opgraph.core.types import TensorType
from opgraph.testing import check_backend
from test_sync_batch_norm_gather_stats import (BF16, F16, F32, INVALID, OP, WRITTEN, assert_bits, bits, f32,
                                               fresh, phase1, run, valid)


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


def test_float_counts_beyond_int32_saturate():
    """Cast(float → INT32) saturates (AscendC Cast: integer overflow saturates by default;
    ops-math Cast float→int32 is CAST_ROUND_MODE_TRUNC, math/cast/op_kernel/arch35/cast_struct.h)
    and maps NaN to 0 (aclnnCast doc): 3e9 and +inf count as 2**31 − 1, −inf as −2**31; they
    used to wrap to −2**31."""
    for big, whole in ((3e9, 2**31 - 1), (np.inf, 2**31 - 1), (-np.inf, -2**31), (np.nan, 0)):
        a, b = valid(n=2, c=3), valid(n=2, c=3)
        a["sampleCount"] = np.float32([big, 5.0])
        b["sampleCount"] = np.int32([whole, 5])
        for soc in ("Ascend910B", "Ascend950"):
            got, want = run(fresh(a), soc), run(fresh(b), soc)
            assert all((bits(got[k]) == bits(want[k])).all() for k in WRITTEN)


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
