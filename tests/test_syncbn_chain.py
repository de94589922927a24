"""The five SyncBatchNorm op_apis chained on one process over simulated ranks
(``examples/syncbn_step_one_process.py``: batch_norm_stats per rank -> stacked "all-gather" ->
batch_norm_gather_stats_with_counts -> batch_norm_elemt -> batch_norm_backward_reduce -> summed
"all-reduce" -> batch_norm_backward_elemt) against float64 BatchNorm on the whole batch, written
here without opgraph.

Bound (normwise): ``max |got − ref| <= B · max magnitude``, the magnitude of a quantity being
its formula as the kernels evaluate it, in float64 with every term made positive: Σ|dy| for
grad_bias, |w|·rstd·(|x| + |mean|) + |b| for y, and for grad_weight rstd·(Σ|dy·x| + |mean|·Σ|dy|),
because SyncBatchNormBackwardReduce forms Σdy·(x − mean) as Σdy·x − mean·Σdy, which cancels
when |mean| >> std (see the large-offset test). Rounding errors scale with these magnitudes,
also where a result cancels. float32: B = 8 ulps = 2⁻²¹ — a few roundings per element; the
ordered sums (``l0ops/ordered.py``, 64 lanes added one after another) err like √(M/64)·u·rms
of a term while the magnitude grows like M·mean|term|, so the ratio does not grow with M.
Measured worst, 10 shapes (M = 2..65536 per channel) × 4 seeds × 910B/950 with these inputs and
the example's, and 120 random shapes/splits: 3.5 ulps (y; grad_input 3.0, running stats 2.4,
grad_weight 2.4, grad_bias 0.8). Half precision: statistics and channel sums are computed in
float32 from exactly representable inputs (the float32 bound; measured ≤ 2.0 ulps); y and
grad_input are rounded once to the data dtype, by at most half an ulp: B = one ulp, 2⁻¹⁰ for
float16, 2⁻⁷ for bfloat16 (measured 0.69 · 2⁻¹¹ and 0.74 · 2⁻⁸).
"""
from __future__ import annotations

import doctest
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import opgraph
from backends import native

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "syncbn_step_one_process.py"
_spec = importlib.util.spec_from_file_location("syncbn_step_one_process", EXAMPLE)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

BF16 = opgraph.DataType.BF16.np
F32_BOUND = 2.0 ** -21                                  # 8 float32 ulps, relative (see above)
HALF_BOUND = {np.float16: 2.0 ** -10, BF16: 2.0 ** -7}  # one ulp: y and grad_input only
PLATFORMS = ("Ascend910B", "Ascend950")
BACKENDS = [pytest.param("numpy"), pytest.param(
    "native", marks=pytest.mark.skipif(not native.available(), reason=native.availability()[1]))]
QUANTITIES = ("y", "running_mean", "running_var", "grad_input", "grad_weight", "grad_bias")
# (shape, samples per rank): uneven, one-sample ranks, empty ranks first / last / twice, 2-D..5-D
CASES = [((8, 4, 5, 5), (4, 3, 1)), ((8, 4, 5, 5), (5, 3, 0)), ((12, 3, 2, 3, 4), (0, 11, 1)),
         ((9, 5), (6, 2, 1)), ((3, 4, 7), (1, 1, 1)), ((6, 3, 4, 4), (0, 2, 0, 3, 1)),
         ((16, 8, 12, 12), (9, 6, 1))]


def inputs(shape, dtype=np.float32, seed=0):
    """x, dy of ``shape`` (channel offsets and scales differ), float32 parameters and running
    stats that are not torch's defaults (so momentum shows)."""
    rng = np.random.default_rng(1000 + seed)
    C = shape[1]
    cshape = (1, C) + (1,) * (len(shape) - 2)
    x = rng.standard_normal(shape) * rng.uniform(0.5, 3, cshape) + rng.uniform(-2, 2, cshape)
    return {"x": x.astype(dtype), "dy": rng.standard_normal(shape).astype(dtype),
            "weight": rng.uniform(-2, 2, C).astype(np.float32),
            "bias": rng.uniform(-1, 1, C).astype(np.float32),
            "running_mean": rng.uniform(-1, 1, C).astype(np.float32),
            "running_var": rng.uniform(0.5, 2, C).astype(np.float32)}


def by_channel(a):
    """[N, C, ...] -> [C, N·...] in float64."""
    return np.moveaxis(np.asarray(a, np.float64), 1, 0).reshape(a.shape[1], -1)


def reference(x, dy, weight, bias, running_mean, running_var, eps, momentum):
    """{name: (float64 value [C, M] or [C], magnitude)} of training BatchNorm on the whole batch:
    biased variance for normalising, unbiased (M/(M−1)) for the running variance."""
    xc, dyc = by_channel(x), by_channel(dy)
    M = xc.shape[1]
    w, b = weight.astype(np.float64)[:, None], bias.astype(np.float64)[:, None]
    rm, rv = running_mean.astype(np.float64), running_var.astype(np.float64)
    mu = xc.sum(1) / M
    d = xc - mu[:, None]
    var = (d * d).sum(1) / M
    s = (1.0 / np.sqrt(var + eps))[:, None]
    xh = d * s
    gb, gw = dyc.sum(1), (dyc * xh).sum(1)
    new_rv = rv + momentum * (var * M / (M - 1) - rv)
    a = np.abs
    xmu_mag = a(dyc * xc).sum(1) + a(mu) * a(dyc).sum(1)  # of Σdy·x − mean·Σdy, as computed
    return {
        "y": (w * xh + b, a(w) * s * (a(xc) + a(mu)[:, None]) + a(b)),
        "running_mean": (rm + momentum * (mu - rm),
                         (1 - momentum) * a(rm) + momentum * a(xc).mean(1)),
        "running_var": (new_rv, new_rv),
        "grad_input": (w * s / M * (M * dyc - gb[:, None] - xh * gw[:, None]),
                       a(w) * s / M * (M * a(dyc) + a(dyc).sum(1)[:, None]
                                       + a(xh) * s * xmu_mag[:, None])),
        "grad_weight": (gw, s[:, 0] * xmu_mag),
        "grad_bias": (gb, a(dyc).sum(1)),
    }


def chain(a, split, eps=1e-5, momentum=0.1):
    """The example's chain on ``a`` cut into ranks of ``split`` samples; copies of the running
    stats are updated (and checked to be the arrays returned)."""
    cuts = np.cumsum(split)[:-1]
    rm, rv = a["running_mean"].copy(), a["running_var"].copy()
    out = ex.syncbn_step(np.split(a["x"], cuts), np.split(a["dy"], cuts), a["weight"], a["bias"],
                         rm, rv, eps, momentum)
    assert out["running_mean"] is rm and out["running_var"] is rv  # updated in place
    return out


def relative_errors(out, ref):
    """{name: max |got − ref| / max magnitude}."""
    errs = {}
    for name, (value, mag) in ref.items():
        got = out[name]
        got = by_channel(got) if got.ndim > 1 else got.astype(np.float64)
        assert got.shape == value.shape, name
        errs[name] = float(np.max(np.abs(got - value)) / np.max(mag))
    return errs


def bits(a):
    return a.view(np.uint16 if a.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape,split", CASES, ids=lambda v: "x".join(map(str, v)))
def test_float32_chain_matches_float64_batch_norm(shape, split, platform, backend):
    a = inputs(shape, seed=len(split) + shape[0])
    with opgraph.platform(platform), opgraph.use_backend(backend):
        out = chain(a, split)
    errs = relative_errors(out, reference(**a, eps=1e-5, momentum=0.1))
    assert set(errs) == set(QUANTITIES)
    assert all(e <= F32_BOUND for e in errs.values()), {k: f"{v:.3g}" for k, v in errs.items()}
    assert all(out[n].dtype == np.float32 for n in QUANTITIES)


@pytest.mark.parametrize("momentum,eps", [(1.0, 1e-3), (0.5, 1e-7), (0.0, 1e-5)])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_momentum_eps_and_unbiased_running_var(platform, momentum, eps):
    """momentum 1: the running var is exactly the batch's unbiased variance; 0: untouched."""
    a = inputs((7, 3, 4), seed=3)
    with opgraph.platform(platform):
        out = chain(a, (4, 2, 1), eps=eps, momentum=momentum)
    ref = reference(**a, eps=eps, momentum=momentum)
    errs = relative_errors(out, ref)
    assert all(e <= F32_BOUND for e in errs.values()), errs
    if momentum == 0.0:
        for n in ("running_mean", "running_var"):
            assert np.array_equal(bits(out[n]), bits(a[n]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, platform", [  # bfloat16 statistics exist on the Ascend950 only
    pytest.param(d, p, id=f"{name}-{p}") for d, name in ((np.float32, "f32"), (np.float16, "f16"), (BF16, "bf16"))
    for p in PLATFORMS if d is not BF16 or p == "Ascend950"])
def test_levels_0_1_2_give_the_same_bits(dtype, platform, backend):
    a = inputs((16, 8, 12, 12), dtype, seed=5)
    outs = []
    for level in (0, 1, 2):
        with opgraph.platform(platform), opgraph.use_backend(backend), opgraph.opt_level(level):
            outs.append(chain(a, (9, 0, 6, 1)))
    for n in QUANTITIES:
        assert np.array_equal(bits(outs[0][n]), bits(outs[1][n])), n
        assert np.array_equal(bits(outs[0][n]), bits(outs[2][n])), n


@pytest.mark.skipif(not native.available(), reason=native.availability()[1])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_native_gives_the_numpy_bits(platform):
    a = inputs((16, 8, 12, 12), seed=6)
    outs = []
    for backend in ("numpy", "native"):
        with opgraph.platform(platform), opgraph.use_backend(backend):
            outs.append(chain(a, (9, 6, 1)))
    for n in QUANTITIES:
        assert np.array_equal(bits(outs[0][n]), bits(outs[1][n])), n


@pytest.mark.parametrize("platform,dtype", [
    ("Ascend910B", np.float16), ("Ascend950", np.float16), ("Ascend950", BF16)],
    ids=["910B-f16", "950-f16", "950-bf16"])
@pytest.mark.parametrize("shape,split", CASES[:4], ids=lambda v: "x".join(map(str, v)))
def test_half_precision_chain(shape, split, platform, dtype):
    a = inputs(shape, dtype, seed=7)
    with opgraph.platform(platform):
        out = chain(a, split)
    errs = relative_errors(out, reference(**a, eps=1e-5, momentum=0.1))
    for n in QUANTITIES:
        rounded = n in ("y", "grad_input")
        assert out[n].dtype == (dtype if rounded else np.float32), n
        assert errs[n] <= (HALF_BOUND[dtype] if rounded else F32_BOUND), (n, errs[n])


@pytest.mark.parametrize("platform", PLATFORMS)
def test_large_offset_within_the_bound_of_the_kernels_formula(platform):
    """|mean| thousands of times std: Σdy·x − mean·Σdy cancels. Within the bound of that
    formula; 16 times outside the bound for Σdy·(x − mean) formed directly (measured: ≈1250
    float32 ulps of Σ|dy·x̂|)."""
    a = inputs((8, 4, 5, 5), seed=1)
    a["x"] = (a["x"] * 0.01 + 100).astype(np.float32)
    with opgraph.platform(platform):
        out = chain(a, (4, 3, 1))
    ref = reference(**a, eps=1e-5, momentum=0.1)
    errs = relative_errors(out, ref)
    assert all(e <= F32_BOUND for e in errs.values()), errs
    xc = by_channel(a["x"])
    xhat = (xc - xc.mean(1)[:, None]) / np.sqrt(xc.var(1)[:, None] + 1e-5)
    direct = np.abs(by_channel(a["dy"]) * xhat).sum(1)
    err = np.max(np.abs(out["grad_weight"] - ref["grad_weight"][0]))
    assert err > 16 * F32_BOUND * direct.max()


def test_bfloat16_statistics_are_refused_on_910B():
    a = inputs((4, 2, 3), BF16)
    with pytest.raises(opgraph.AclnnError, match=r"input: dtype BF16 is not supported"):
        chain(a, (2, 1, 1))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_an_empty_rank_changes_no_bit(platform):
    """torch's SyncBatchNorm drops a rank without samples from the gather and adds its zeros to
    the all-reduce: the same bits as without that rank."""
    a = inputs((8, 4, 5), seed=8)
    with opgraph.platform(platform):
        with_empty, without = chain(a, (5, 0, 3)), chain(a, (5, 3))
    for n in QUANTITIES:
        assert np.array_equal(bits(with_empty[n]), bits(without[n])), n


def test_example_docstring_examples():
    assert doctest.testmod(ex, optionflags=doctest.ELLIPSIS).failed == 0


LINE = re.compile(r"^  (\w+) +(\S+) +(\S+) +(\S+)$", re.M)


def run_example(*args):
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                          timeout=120, cwd=EXAMPLE.parent.parent)


@pytest.mark.parametrize("args,header,bound", [
    ((), "ranks 4+3+1 of [8,4,5,5] float32, Ascend910B, backend numpy", {}),
    (("--split", "5,3,0", "--dtype", "float16", "--platform", "Ascend950", "--seed", "3"),
     "ranks 5+3+0 of [8,4,5,5] float16, Ascend950, backend numpy",
     {"y": 2.0 ** -10, "grad_input": 2.0 ** -10}),
])
def test_example_script(args, header, bound):
    p = run_example(*args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SyncBatchNorm step on one process: {header}" in p.stdout
    rows = {m[0]: tuple(map(float, m[1:])) for m in LINE.findall(p.stdout)}
    assert list(rows) == list(QUANTITIES)
    for name, (abs_err, rel, printed_bound) in rows.items():
        assert printed_bound == pytest.approx(bound.get(name, F32_BOUND), rel=1e-2)
        assert 0 <= rel <= printed_bound and abs_err >= 0
    assert p.stdout.rstrip().endswith("ok: every error is within its bound")


@pytest.mark.parametrize("args,message", [
    (("--dtype", "bfloat16"), "input: dtype BF16 is not supported on Ascend910B"),
    (("--shape", "8,4", "--split", "4,4,1"), "split into ranks"),
    (("--platform", "Nope"), "unknown platform 'Nope'"),
])
def test_example_script_bad_input(args, message):
    p = run_example(*args)
    assert p.returncode == 2 and p.stdout == ""
    assert message in p.stderr.splitlines()[-1]
    assert "Traceback" not in p.stderr
