"""One SyncBatchNorm training step on ONE process: three simulated ranks (an uneven batch with a
one-sample rank) through the five op_apis, the all-gather and all-reduce done by hand, checked
against float64 BatchNorm forward and backward on the whole batch.

    $ python examples/syncbn_step_one_process.py      # --dtype, --platform, --backend, --split
    SyncBatchNorm step on one process: ranks 4+3+1 of [8,4,5,5] float32, Ascend910B, backend numpy
    vs float64 BatchNorm on the whole batch; relative = max abs error / max magnitude
      quantity       max abs error    relative     bound
      y                   5.66e-07    7.46e-08  4.77e-07
      running_mean        1.87e-08    2.85e-08  4.77e-07
      running_var          1.1e-07    5.29e-08  4.77e-07
      grad_input           3.5e-07    9.56e-08  4.77e-07
      grad_weight         6.44e-07    3.37e-09  4.77e-07
      grad_bias              1e-06    5.99e-09  4.77e-07
    ok: every error is within its bound

"magnitude" is what rounding errors scale with: the formula as the kernels evaluate it, in
float64 with every term made positive (Σ|dy| for grad_bias). Exit status 1 if an error is above
its bound.

The chain per rank is torch's SyncBatchNorm (``torch/nn/modules/_functions.py``): a rank without
samples sends zeros and count 0 and is dropped before the gather. Import :func:`syncbn_step` to
run it on your own per-rank arrays (``tests/test_syncbn_chain.py`` does).
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

import numpy as np

import opgraph
from opgraph import ops

EPS, MOMENTUM = 1e-5, 0.1
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": opgraph.DataType.BF16.np}
# relative bounds: 8 float32 ulps (2**-21; measured at most 3.5) for what is computed and kept
# in float32; half-precision y and grad_input are rounded once more (half an ulp): one ulp
BOUNDS = {"float32": 2.0**-21, "float16": 2.0**-10, "bfloat16": 2.0**-7}
Arrays = dict[str, np.ndarray]


def all_reduce(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The ranks' float32 arrays summed in rank order (what a sum all-reduce returns)."""
    total = np.zeros_like(parts[0], dtype=np.float32)
    for p in parts:
        total += p
    return total


def syncbn_step(xs: Sequence[np.ndarray], dys: Sequence[np.ndarray], weight: np.ndarray,
                bias: np.ndarray, running_mean: np.ndarray, running_var: np.ndarray,
                eps: float = EPS, momentum: float = MOMENTUM) -> Arrays:
    """Forward and backward over the ranks' inputs ``xs`` and upstream gradients ``dys``
    ([N_r, C, ...] each); running stats updated in place. Returns y and grad_input (the ranks'
    concatenated), grad_weight and grad_bias (summed over the ranks, as DDP's all-reduce).

    >>> x = np.float32([[0, 0], [1, 2], [2, 4]])
    >>> out = syncbn_step([x[:2], x[2:]], [x[:2], x[2:]], np.ones(2, np.float32),
    ...                   np.zeros(2, np.float32), np.zeros(2, np.float32), np.ones(2, np.float32))
    >>> [round(float(v), 4) for v in out["y"][:, 0]], out["grad_input"].shape
    ([-1.2247, 0.0, 1.2247], (3, 2))
    """
    C = weight.shape[0]
    zeros = np.zeros(C, np.float32)
    # forward: per-rank statistics, all-gather, the ranks with samples only
    stats = [ops.batch_norm_stats(x, eps) if x.size else (zeros, zeros) for x in xs]
    counts = np.float32([x.size // C for x in xs])
    keep = counts >= 1
    mean_all = np.stack([m for m, _ in stats])[keep]
    invstd_all = np.stack([s for _, s in stats])[keep]
    # every rank gets the same global statistics; one process keeps one copy of the running stats
    mean, invstd = ops.batch_norm_gather_stats_with_counts(
        xs[0], mean_all, invstd_all, running_mean, running_var, momentum, eps, counts[keep])
    ys = [ops.batch_norm_elemt(x, weight, bias, mean, invstd, eps) for x in xs]
    # backward: per-rank sums, all-reduce, per-rank input gradient
    sums = [ops.batch_norm_backward_reduce(dy, x, mean, invstd, weight, True, True, True)
            if x.size else (zeros,) * 4 for x, dy in zip(xs, dys)]
    sum_dy, sum_dy_xmu = all_reduce([s[0] for s in sums]), all_reduce([s[1] for s in sums])
    counter = counts[keep].astype(np.int32).reshape(-1, 1)  # torch: count_all.to(torch.int32)
    grads = [ops.batch_norm_elemt_backward(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, counter)
             for x, dy in zip(xs, dys)]
    return {"y": np.concatenate(ys), "running_mean": running_mean, "running_var": running_var,
            "grad_input": np.concatenate(grads), "grad_weight": all_reduce([s[2] for s in sums]),
            "grad_bias": all_reduce([s[3] for s in sums])}


def batch_norm_float64(x: np.ndarray, dy: np.ndarray, weight: np.ndarray, bias: np.ndarray,
                       running_mean: np.ndarray, running_var: np.ndarray, eps: float = EPS,
                       momentum: float = MOMENTUM) -> tuple[Arrays, Arrays]:
    """Training-mode BatchNorm forward and backward on the whole batch in float64: the values,
    and per value the magnitude its rounding errors scale with (its formula with every term
    made positive, e.g. Σ|dy| for grad_bias: a sum that cancels is no more exact)."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    axes, n = (0, *range(2, x.ndim)), x.size // x.shape[1]
    c = lambda v: v.reshape((1, -1) + (1,) * (x.ndim - 2))  # noqa: E731  [C] -> channel dim
    mean, var = x.mean(axes), x.var(axes)
    rstd = 1 / np.sqrt(var + eps)
    xhat = (x - c(mean)) * c(rstd)
    grad_bias, grad_weight = dy.sum(axes), (dy * xhat).sum(axes)
    a, m = np.abs, momentum
    ref = {"y": xhat * c(weight) + c(bias),
           "running_mean": (1 - m) * running_mean + m * mean,
           "running_var": (1 - m) * running_var + m * var * n / (n - 1),
           "grad_input": c(weight * rstd) * (dy - c(grad_bias / n) - xhat * c(grad_weight / n)),
           "grad_weight": grad_weight, "grad_bias": grad_bias}
    mag = {"y": (a(x) + c(a(mean))) * c(rstd * a(weight)) + c(a(bias)),
           "running_mean": (1 - m) * a(running_mean) + m * a(x).mean(axes),
           "running_var": ref["running_var"],
           # the kernel's Σdy·(x − mean) is Σdy·x − mean·Σdy: it cancels when |mean| >> std
           "grad_weight": rstd * (a(dy * x).sum(axes) + a(mean) * a(dy).sum(axes)),
           "grad_bias": a(dy).sum(axes)}
    mag["grad_input"] = c(a(weight) * rstd) * (a(dy) + c(a(dy).mean(axes))
                                               + a(xhat) * c(rstd * mag["grad_weight"] / n))
    return ref, mag


def errors(got: np.ndarray, ref: np.ndarray, mag: np.ndarray) -> tuple[float, float]:
    """(max abs error, that / max magnitude)."""
    err = float(np.max(np.abs(got.astype(np.float64) - ref)))
    return err, err / max(float(np.max(mag)), np.finfo(np.float64).tiny)


def make_batch(shape: Sequence[int], dtype: type, seed: int = 0) -> Arrays:
    """Random x, dy [shape] in ``dtype``; weight, bias, running mean and var [C] in float32."""
    rng = np.random.default_rng(seed)
    C = shape[1]
    f32 = lambda lo, hi: rng.uniform(lo, hi, C).astype(np.float32)  # noqa: E731
    return {"x": (rng.standard_normal(shape) * 2 + 0.5).astype(dtype),
            "dy": rng.standard_normal(shape).astype(dtype), "weight": f32(0.5, 2),
            "bias": f32(-1, 1), "running_mean": f32(-1, 1), "running_var": f32(0.5, 2)}


def default_split(n: int) -> list[int]:
    """Three uneven ranks, the last with one sample: 8 -> [4, 3, 1]; 2 -> [1, 0, 1]."""
    return [n - 1 - (n - 1) // 2, (n - 1) // 2, 1]


def int_list(text: str) -> list[int]:
    """"4,3,1" -> [4, 3, 1]."""
    return [int(v) for v in text.split(",")]


def main(argv: "Sequence[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int_list, default="8,4,5,5",
                    help="N,C[,...] of the whole batch (N >= 2)")
    ap.add_argument("--split", type=int_list,
                    help="samples per rank, e.g. 5,3,0 (default: N-1 split in two, 1)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--platform", default="Ascend910B", help="bfloat16 needs Ascend950")
    ap.add_argument("--backend", choices=("numpy", "native"), default="numpy")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape = args.shape
    split = args.split or default_split(shape[0])
    if len(shape) < 2 or shape[0] < 2 or min(shape) < 1 or sum(split) != shape[0] or min(split) < 0:
        ap.error(f"need N >= 2 samples split into ranks, got --shape {shape} and split {split}")
    b = make_batch(shape, DTYPES[args.dtype], args.seed)
    ref, mag = batch_norm_float64(**b)  # before the step updates the running stats in place
    ends = np.cumsum([0] + split)
    parts = lambda a: [a[lo:hi] for lo, hi in zip(ends, ends[1:])]  # noqa: E731
    try:
        with opgraph.platform(args.platform), opgraph.use_backend(args.backend):
            got = syncbn_step(parts(b["x"]), parts(b["dy"]), b["weight"], b["bias"],
                              b["running_mean"], b["running_var"])
    except (opgraph.AclnnError, opgraph.BackendUnavailable, ValueError) as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    print(f"SyncBatchNorm step on one process: ranks {'+'.join(map(str, split))} of "
          f"[{','.join(map(str, shape))}] {args.dtype}, {args.platform}, backend {args.backend}")
    print("vs float64 BatchNorm on the whole batch; relative = max abs error / max magnitude")
    print(f"  {'quantity':<14}{'max abs error':>14}{'relative':>12}{'bound':>10}")
    bad = []
    for name, r in ref.items():
        abs_err, rel_err = errors(got[name], r, mag[name])
        bound = BOUNDS[args.dtype if got[name].dtype == b["x"].dtype else "float32"]
        print(f"  {name:<14}{abs_err:>14.3g}{rel_err:>12.3g}{bound:>10.3g}")
        if not rel_err <= bound:  # NaN fails too
            bad.append(name)
    print(f"FAIL: {', '.join(bad)} above the bound" if bad
          else "ok: every error is within its bound")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
