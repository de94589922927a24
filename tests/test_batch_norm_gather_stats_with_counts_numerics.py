"""aclnnBatchNormGatherStatsWithCounts: numerics (950: bits against a step-by-step float32 model
of the fused kernel written here, both its common and first-axis templates; 910B, whose kernels
are prebuilt: bounds against float64), IEEE specials, input ranks, strided layouts, passes, the
backend kit, the CLI and the Pythonic function."""
from __future__ import annotations

import collections
import re

import numpy as np
import pytest

import opgraph
from opgraph import AclnnError
from opgraph.aclnn.batch_norm_gather_stats_with_counts import batch_norm_gather_stats_with_counts
from opgraph.cli import main
from opgraph.passes import graph_stats, optimize
from opgraph.testing import check_backend

from test_batch_norm_gather_stats_with_counts import (B910, B950, BF16, F16, F32, HALF_ULP, I32, INVALID,
                                                      OP, U, WRITTEN, assert_bits, bits, make_args,
                                                      recorded, run)

# ---------------------------------------------------------------------------------------------
# numerics, 950: bits against the fused kernel's steps, written out here in float32
# ---------------------------------------------------------------------------------------------
def sequential(rows) -> np.ndarray:
    """acc = 0; acc += row, for each row in order (every add rounds to float32)."""
    acc = np.zeros(rows[0].shape, F32)
    for r in rows:
        acc = acc + r
    return acc


def kernel_sum(terms: np.ndarray, cores: int = 64) -> np.ndarray:
    """The fused kernel's sum over ranks: sequential; with W > 255 and W > C (the first-axis
    templates) per block of ceil(W/cores) consecutive rows, then the block sums in order."""
    W, C = terms.shape
    if W > 255 and W > C:
        step = -(-W // cores)
        return sequential([sequential(list(terms[b:b + step])) for b in range(0, W, step)])
    return sequential(list(terms))


def fused_model(a: dict, add=kernel_sum) -> dict:
    """Step by step as ops-nn sync_batch_norm_gather_stats_fused's kernel: float32 throughout,
    results rounded to mean's dtype (round to nearest even)."""
    mean, inv, cnt = (np.asarray(a[n]).astype(F32) for n in ("mean", "invstd", "counts"))
    rm, rv = (np.asarray(a[n]).astype(F32) for n in ("runningMean", "runningVar"))
    with np.errstate(all="ignore"):  # IEEE specials are expected here
        return _fused_model(mean, inv, cnt, rm, rv, F32(a["momentum"]), F32(a["eps"]), add,
                            np.asarray(a["mean"]).dtype)


def _fused_model(mean, inv, cnt, rm, rv, m, eps, add, dt) -> dict:
    W = mean.shape[0]
    cs = F32(0)
    for c in cnt:  # whole-number counts: exact in any order
        cs = F32(cs + c)
    mean_terms = np.stack([(mean[n] * cnt[n]) / cs for n in range(W)])
    mean_all = add(mean_terms)
    var_terms = []
    for n in range(W):
        r = F32(1) / inv[n]
        v = r * r + (-eps)
        d = mean[n] - mean_all
        var_terms.append((d * d + v) * cnt[n])
    vs = add(np.stack(var_terms))
    one_m = F32(1) - m
    out = {"meanAll": mean_all,
           "invstdAll": F32(1) / np.sqrt(vs / cs + eps),
           "runningMean": rm * one_m + mean_all * m,
           "runningVar": (vs / (cs - F32(1))) * m + rv * one_m}
    return {k: v.astype(dt) for k, v in out.items()}


@pytest.mark.parametrize("dt", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("W,C", [(2, 5), (3, 4), (5, 3), (8, 16), (300, 300)])
def test_950_bits_equal_the_kernel_model_common_template(W, C, dt):
    a = run(make_args(W=W, C=C, dtype=dt, seed=W * 7 + C), B950)
    want = fused_model(make_args(W=W, C=C, dtype=dt, seed=W * 7 + C))
    for n in WRITTEN:
        assert_bits(a[n], want[n], n)


@pytest.mark.parametrize("W,C,dt", [(299, 298, F32), (300, 7, F32), (1000, 3, F32), (600, 2, BF16)])
def test_950_bits_equal_the_kernel_model_first_axis_template(W, C, dt):
    args = make_args(W=W, C=C, dtype=dt, seed=W)
    a = run(make_args(W=W, C=C, dtype=dt, seed=W), B950)
    want = fused_model(args)
    for n in WRITTEN:
        assert_bits(a[n], want[n], n)
    if dt == F32:  # the block order matters here: a plain sequential sum gives other bits
        plain = fused_model(args, add=lambda t: sequential(list(t)))
        assert any(not np.array_equal(bits(plain[n]), bits(want[n])) for n in WRITTEN)


def test_950_common_template_up_to_w_equal_c_is_one_sequential_sum():
    args = make_args(W=300, C=300, seed=3)
    a = run(make_args(W=300, C=300, seed=3), B950)
    plain = fused_model(args, add=lambda t: sequential(list(t)))
    for n in WRITTEN:
        assert_bits(a[n], plain[n], n)


# ---------------------------------------------------------------------------------------------
# numerics, 910B (prebuilt kernels: formulas, no public order): bounds against float64
# ---------------------------------------------------------------------------------------------
def f64_reference(a: dict) -> dict:
    """Chan's per-rank combination (torch's CUDA kernel), sequentially in float64."""
    mean, inv, cnt = (np.asarray(a[n]).astype(np.float64) for n in ("mean", "invstd", "counts"))
    eps, m = a["eps"], a["momentum"]
    n, avg, var_n = 0.0, np.zeros(mean.shape[1]), np.zeros(mean.shape[1])
    for j in range(mean.shape[0]):
        v = ((1 / inv[j]) ** 2 - eps) * cnt[j]
        factor = 1 / (n + cnt[j])
        var_n += v + (avg - mean[j]) ** 2 * n * cnt[j] * factor
        avg = n * factor * avg + cnt[j] * factor * mean[j]
        n += cnt[j]
    out = {"meanAll": avg, "invstdAll": 1 / np.sqrt(var_n / n + eps), "var_n": var_n, "n": n}
    if a.get("runningMean") is not None:
        out["runningMean"] = (1 - m) * a["runningMean"].astype(np.float64) + m * avg
        out["runningVar"] = (1 - m) * a["runningVar"].astype(np.float64) + m * var_n / (n - 1)
    return out


def check_910b_bounds(a: dict, got: dict) -> None:
    """First-order float32 bounds with all variance terms positive: |Δ| ≤ ((2W + 16)·u +
    half an ulp of the output dtype)·S, S the magnitude the result is built from."""
    ref = f64_reference(a)
    mean, cnt = np.asarray(a["mean"]).astype(np.float64), np.asarray(a["counts"]).astype(np.float64)
    W, m = mean.shape[0], a["momentum"]
    mean_scale = (np.abs(mean) * cnt[:, None]).sum(axis=0) / ref["n"]
    scale = {"meanAll": mean_scale, "invstdAll": np.abs(ref["invstdAll"])}
    if "runningMean" in ref:
        rm, rv = (np.abs(a[n].astype(np.float64)) for n in ("runningMean", "runningVar"))
        scale["runningMean"] = rm + m * mean_scale
        scale["runningVar"] = rv + m * ref["var_n"] / (ref["n"] - 1)
    for name, s in scale.items():
        out = np.asarray(got[name])
        tol = ((2 * W + 16) * U + HALF_ULP[out.dtype]) * s
        err = np.abs(out.astype(np.float64) - ref[name])
        assert np.all(err <= tol), f"{name}: error {err.max():.3g} above bound {tol.min():.3g}"


@pytest.mark.parametrize("W", [2, 3, 5, 8, 64])
@pytest.mark.parametrize("dt", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_910b_within_float32_bounds_of_float64(W, dt):
    a = make_args(W=W, C=6, dtype=dt, seed=W)
    check_910b_bounds(a, run(make_args(W=W, C=6, dtype=dt, seed=W), B910))


@pytest.mark.parametrize("soc", [B910, B950])
def test_both_socs_within_bounds_of_torchs_float64_combination(soc):
    a = make_args(W=6, C=5, seed=11)
    check_910b_bounds(a, run(make_args(W=6, C=5, seed=11), soc))


def test_910b_running_mean_update_is_mean_m_plus_rm_minus_rm_m():
    a = run(make_args(W=4, C=64, seed=5), B910)
    rm0 = make_args(W=4, C=64, seed=5)["runningMean"]
    m, mean_all = F32(0.1), a["meanAll"]
    assert_bits(a["runningMean"], mean_all * m + (rm0 - rm0 * m), "runningMean")  # SyncBNTrainingUpdate


# ---------------------------------------------------------------------------------------------
# specials, input ranks, layouts
# ---------------------------------------------------------------------------------------------
def with_specials(a: dict) -> dict:
    a["mean"][1, 0] = np.nan                # NaN mean → channel 0 NaN
    a["invstd"][0, 1] = np.inf              # 1/inf = 0 → a variance term of −eps
    a["invstd"][2, 2] = 0                   # 1/0 = inf → var inf → invstd 0
    a["mean"][0, 3] = np.float32(3e38)      # mean·count overflows → inf
    return a


def test_950_specials_bits_equal_the_model():
    a = run(with_specials(make_args(W=3, C=5, seed=2)), B950)
    want = fused_model(with_specials(make_args(W=3, C=5, seed=2)))
    for n in WRITTEN:
        assert_bits(a[n], want[n], n)
    assert np.isnan(a["meanAll"][0]) and a["invstdAll"][2] == 0 and np.isfinite(a["invstdAll"][1])


def test_910b_specials_where_the_formula_puts_them():
    a = run(with_specials(make_args(W=3, C=5, seed=2)), B910)
    assert np.isnan(a["meanAll"][0]) and np.isnan(a["invstdAll"][0]) and np.isnan(a["runningVar"][0])
    assert a["invstdAll"][2] == 0 and a["runningVar"][2] == np.inf and np.isinf(a["meanAll"][3])
    assert np.isfinite(a["meanAll"][[1, 2, 4]]).all() and np.isfinite(a["invstdAll"][[1, 4]]).all()


@pytest.mark.parametrize("soc", [B910, B950])
def test_no_guard_for_counts_summing_to_one_or_zero(soc):
    a = make_args(W=1)
    a["counts"][:] = 1
    run(a, soc)
    assert np.isposinf(a["runningVar"]).all() and np.isfinite(a["invstdAll"]).all()
    a = make_args(W=2)
    a["counts"][:] = 0
    run(a, soc)
    assert all(np.isnan(a[n]).all() for n in WRITTEN)


@pytest.mark.parametrize("soc", [B910, B950])
@pytest.mark.parametrize("counts", [[0.5, 1.5], [0.0, 3.0], [-1.0, 3.0], [2.75, 0.25]])
def test_counts_are_float_weights_never_truncated(soc, counts):
    """The vendor casts counts to float32 and weights by them as they are (GSC:245-268: Cast,
    BroadcastTo, ReduceSum, ReduceMeanWithCount; the fused kernel multiplies by the float
    count): a zero count drops its row, a fraction or a negative count weighs in as such.
    torch's CUDA combination adds counts into an integer n instead, so it differs here."""
    a = make_args(W=2, C=1)
    a["mean"][:] = [[0.0], [2.0]]
    a["invstd"][:] = [[1.0], [0.5]]
    a["counts"][:] = counts
    rm, rv, m, eps = a["runningMean"].astype(float), a["runningVar"].astype(float), a["momentum"], a["eps"]
    run(a, soc)
    c = np.float64(counts)
    n, var_j = c.sum(), 1 / np.float64([1.0, 0.5]) ** 2 - eps
    mean_all = (c * [0.0, 2.0]).sum() / n
    vs = (c * (var_j + (np.float64([0.0, 2.0]) - mean_all) ** 2)).sum()
    want = {"meanAll": mean_all, "invstdAll": 1 / np.sqrt(vs / n + eps),
            "runningMean": rm * (1 - m) + mean_all * m, "runningVar": rv * (1 - m) + vs / (n - 1) * m}
    for k, v in want.items():
        np.testing.assert_allclose(a[k].astype(np.float64), v, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("rank", range(2, 9))
@pytest.mark.parametrize("soc", [B910, B950])
def test_input_rank_2_to_8_only_gives_c(rank, soc):
    shape = (2, 4) + (1, 3, 1, 2, 1, 1)[: rank - 2]
    a, b = run(make_args(input_shape=shape), soc), run(make_args(), soc)
    for n in WRITTEN:
        assert_bits(a[n], b[n], n)


def strided_copy(x: np.ndarray, fill=0x5A) -> tuple[np.ndarray, np.ndarray]:
    """``x``'s values in a view with stride 2 over a sentinel buffer; returns (view, buffer)."""
    buf = np.full(x.size * 2 * x.itemsize, fill, np.uint8).view(x.dtype)
    view = buf[::2].reshape(x.shape) if x.ndim == 1 else buf.reshape(x.shape[0], -1)[:, ::2]
    view[...] = x
    return view, buf


@pytest.mark.parametrize("soc", [B910, B950])
@pytest.mark.parametrize("dt", [F32, F16], ids=["f32", "f16"])
def test_noncontiguous_inputs_in_out_and_outputs_give_the_same_bits(soc, dt):
    want = run(make_args(W=4, C=6, dtype=dt, seed=9), soc)
    a = make_args(W=4, C=6, dtype=dt, seed=9)
    a["mean"] = np.asfortranarray(a["mean"])                      # column-major
    a["invstd"] = np.ascontiguousarray(a["invstd"].T).T           # transposed view
    a["counts"], _ = strided_copy(a["counts"])
    bufs = {}
    for n in WRITTEN:
        a[n], bufs[n] = strided_copy(a[n])
    run(a, soc)
    for n in WRITTEN:
        assert_bits(a[n], want[n], n)
        assert (bufs[n].view(np.uint8).reshape(-1, bufs[n].itemsize)[1::2] == 0x5A).all(), n


# ---------------------------------------------------------------------------------------------
# passes, the backend kit, the CLI
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("soc", [B910, B950])
@pytest.mark.parametrize("dt", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("running", [True, False], ids=["running", "no-running"])
def test_levels_0_1_2_give_identical_bits(soc, dt, running):
    outs = [run(make_args(W=5, C=7, dtype=dt, running=running, seed=4), soc, level) for level in (0, 1, 2)]
    for n in WRITTEN:
        if outs[0][n] is not None:
            assert_bits(outs[1][n], outs[0][n], f"{n} level 1")
            assert_bits(outs[2][n], outs[0][n], f"{n} level 2")


# the kernels CANN launches for the fp32 graph with running stats (910B: BroadcastTo of counts,
# of countSum and of meanAll; 950: the fused kernel only; every ViewCopy is an address redirect)
CANN_KERNELS = {B910: {"BroadcastTo": 3, "ReduceSum": 1, "ReduceMeanWithCount": 1,
                       "SyncBatchNormGatherStatsWithCounts": 1, "SyncBNTrainingUpdate": 1},
                B950: {"SyncBatchNormGatherStatsFused": 1}}


@pytest.mark.parametrize("soc", [B910, B950])
def test_level1_launches_the_cann_kernels(soc):
    g1 = optimize(recorded(make_args(), soc), 1)
    launched = collections.Counter(n.op for n in g1.nodes if not n.opdef.is_free(n))
    # level 1 does not yet redirect a ViewCopy whose source is a SqueezeNd view of a kernel's
    # output (CANN does: the view is still a contiguous workspace tensor), so up to 4 remain
    copies = launched.pop("ViewCopy", 0)
    assert dict(launched) == CANN_KERNELS[soc] and copies <= 4
    assert graph_stats(g1).launches == sum(CANN_KERNELS[soc].values()) + copies


def test_numpy_backend_passes_the_kit():
    report = check_backend("numpy", op_apis=[OP], platforms=[B910, B950])
    assert report.ok, str(report)
    assert report.cases == 2 * 3 * 2 * 3 * 2 * 2  # socs x dtypes x flags x levels x layouts x shapes


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("soc", [B910, B950])
@pytest.mark.parametrize("cmd", ["run", "dump", "plan", "emit-c", "emit-cpp"])
def test_cli_commands_work_or_fail_in_one_line(capsys, tmp_path, cmd, soc):
    argv = [cmd, OP, "--platform", soc, "--ranks", "4", "--shape", "2,3,5"]
    if cmd in ("emit-c", "emit-cpp"):
        argv += ["-o", str(tmp_path / "out")]
    code, out, err = cli(capsys, *argv)
    if code == 0:
        assert out or (tmp_path / "out").exists()
    else:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("opgraph: "), err


@pytest.mark.parametrize("soc", [B910, B950])
def test_cli_run_compares_every_written_tensor_with_float64(capsys, soc):
    code, out, _ = cli(capsys, "run", OP, "--platform", soc, "--ranks", "5")
    assert code == 0
    errs = [float(x) for x in re.findall(r"max rel error: (\S+)", out)]
    assert len(errs) == 4 and max(errs) < 1e-5, out
    code, out, _ = cli(capsys, "run", OP, "--platform", soc, "--no-running-stats", "--ranks", "0")
    assert code == 0 and "output:        invstdAll" in out and "output:        runningMean" not in out


def test_cli_dump_shows_the_fused_kernel_on_950_only(capsys):
    _, out910, _ = cli(capsys, "dump", OP, "--format", "text")
    _, out950, _ = cli(capsys, "dump", OP, "--platform", B950, "--format", "text")
    assert "SyncBatchNormGatherStatsWithCounts(" in out910 and "Fused" not in out910
    assert "SyncBatchNormGatherStatsFused(" in out950 and "ReduceMeanWithCount" not in out950


# ---------------------------------------------------------------------------------------------
# the Pythonic function (torch.batch_norm_gather_stats_with_counts)
# ---------------------------------------------------------------------------------------------
def pythonic_args(seed=0, **kw):
    a = make_args(W=4, C=5, seed=seed, **kw)
    return [a["input"], a["mean"], a["invstd"], a["runningMean"], a["runningVar"], 0.1, 1e-5,
            a["counts"]], a


@pytest.mark.parametrize("soc", [B910, B950])
def test_pythonic_matches_torchs_float64_combination_and_updates_in_place(soc):
    args, a = pythonic_args()
    ref = f64_reference({**a, "runningMean": a["runningMean"].copy(), "runningVar": a["runningVar"].copy()})
    rm, rv = args[3], args[4]
    with opgraph.platform(soc):
        mean, invstd = batch_norm_gather_stats_with_counts(*args)
    assert mean.shape == invstd.shape == (5,) and mean.dtype == invstd.dtype == F32
    got = {"meanAll": mean, "invstdAll": invstd, "runningMean": rm, "runningVar": rv}
    check_910b_bounds(pythonic_args()[1], got)
    assert np.allclose(rv, ref["runningVar"], rtol=1e-5) and args[3] is rm


def test_pythonic_outputs_follow_mean_and_invstd_dtypes():
    args, _ = pythonic_args(mean=F16, invstd=BF16)
    mean, invstd = batch_norm_gather_stats_with_counts(*args)
    assert mean.dtype == F16 and invstd.dtype == BF16


def test_pythonic_bad_input_raises_and_writes_nothing():
    args, _ = pythonic_args()
    args[7] = args[7].astype(I32)
    rm, rv = args[3].copy(), args[4].copy()
    with pytest.raises(AclnnError) as e:
        batch_norm_gather_stats_with_counts(*args)
    assert e.value.status == INVALID and "counts" in str(e.value)
    assert np.array_equal(args[3], rm) and np.array_equal(args[4], rv)
    args, _ = pythonic_args()
    args[4] = None
    with pytest.raises(AclnnError, match="runningVar"):
        batch_norm_gather_stats_with_counts(*args)
    with pytest.raises(AclnnError, match="input: must not be NULL"):
        batch_norm_gather_stats_with_counts(None, *args[1:])


def test_pythonic_refuses_running_stats_it_could_not_update_in_place():
    args, _ = pythonic_args()
    args[3] = args[3].tolist()  # a list would be copied: the update would be lost
    with pytest.raises(AclnnError, match="runningMean"):
        batch_norm_gather_stats_with_counts(*args)


def test_pythonic_running_var_alone_is_left_unchanged_as_on_the_npu():
    args, _ = pythonic_args()
    args[3] = None
    rv = args[4].copy()
    batch_norm_gather_stats_with_counts(*args)
    assert np.array_equal(args[4], rv)
