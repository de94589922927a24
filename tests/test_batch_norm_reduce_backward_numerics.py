"""aclnnBatchNormReduceBackward's numerics, CLI and Pythonic API: bits against the model in
test_batch_norm_reduce_backward.py (the documented summation order one add at a time, then the
kernel's three float32 steps), ranks 2-8, sums against float64 within the order's bound, NaN/Inf,
empty and strided tensors, levels, a cached executor, the backend kit."""
from __future__ import annotations

import math

import numpy as np
import pytest

import opgraph
from opgraph.aclnn.batch_norm_reduce_backward import batch_norm_backward_reduce
from opgraph.cli import main
from opgraph.testing import check_backend
from test_batch_norm_reduce_backward import (BF16, F16, F32, I32, INPUTS, INVALID, NULLPTR, OUTPUTS, U,
                                             assert_same, bits, make_args, model, out_bytes, rows,
                                             run, sentinel, up)


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
