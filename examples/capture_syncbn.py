"""A SyncBatchNorm training step (forward + backward of one layer) as op_api calls and two
collectives, captured as one program: the sequence opgraph.torch.SyncBatchNorm runs per rank,
on numpy arrays. ``opgraph capture examples/capture_syncbn.py`` shows it; run this file to see
the program at each level next to the calls one by one.

    >>> import numpy as np, opgraph
    >>> with opgraph.capture() as prog:
    ...     out = step((4, 3, 5, 5))
    >>> prog.stats().collectives, sorted(prog.outputs)[:3]
    (2, ['gradBias', 'gradInput', 'gradWeight'])
"""
from __future__ import annotations

import argparse
from typing import Any, Sequence

import numpy as np

import opgraph
from opgraph.aclnn.batch_norm_elemt import batch_norm_elemt
from opgraph.aclnn.batch_norm_elemt_backward import batch_norm_elemt_backward
from opgraph.aclnn.batch_norm_gather_stats_with_counts import batch_norm_gather_stats_with_counts
from opgraph.aclnn.batch_norm_reduce_backward import batch_norm_backward_reduce
from opgraph.aclnn.batch_norm_stats import batch_norm_stats
from opgraph.capture import all_gather, all_reduce

EPS, MOMENTUM = 1e-5, 0.1


def make_inputs(shape: Sequence[int] = (8, 16, 14, 14), dtype: Any = np.float32,
                seed: int = 0) -> dict[str, np.ndarray]:
    """Random x and dy [N, C, ...], weight, bias, running mean and var [C]."""
    rng = np.random.default_rng(seed)
    C = shape[1]
    return {"x": (rng.standard_normal(shape) * 2 + 0.5).astype(dtype),
            "dy": rng.standard_normal(shape).astype(dtype),
            "weight": rng.uniform(0.5, 2, C).astype(np.float32),
            "bias": rng.uniform(-1, 1, C).astype(np.float32),
            "running_mean": np.zeros(C, np.float32), "running_var": np.ones(C, np.float32)}


def step_on(x: np.ndarray, dy: np.ndarray, weight: np.ndarray, bias: np.ndarray,
            running_mean: np.ndarray, running_var: np.ndarray, group: str = "local",
            world: int = 1) -> dict[str, np.ndarray]:
    """One forward + backward of SyncBatchNorm on this rank's batch ``x`` with upstream gradient
    ``dy``, over ``world`` ranks of as many samples each; running stats updated in place."""
    count = x.size // x.shape[1]
    counts = np.full(world, count, np.float32)
    # forward: statistics, exchange, global statistics, normalise
    mean, invstd = batch_norm_stats(x, EPS)
    mean_all, invstd_all = all_gather(mean, invstd, group=group)
    gmean, ginvstd = batch_norm_gather_stats_with_counts(
        x, mean_all, invstd_all, running_mean, running_var, MOMENTUM, EPS, counts)
    y = batch_norm_elemt(x, weight, bias, gmean, ginvstd, EPS)
    # backward: per-channel sums, exchange, input gradient
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = batch_norm_backward_reduce(
        dy, x, gmean, ginvstd, weight, True, True, True)
    sum_dy, sum_dy_xmu = all_reduce(sum_dy, sum_dy_xmu, group=group)
    grad_input = batch_norm_elemt_backward(dy, x, gmean, ginvstd, weight, sum_dy, sum_dy_xmu,
                                           np.full(world, count, np.int32))
    return {"y": y, "grad_input": grad_input, "grad_weight": grad_weight, "grad_bias": grad_bias,
            "running_mean": running_mean, "running_var": running_var}


def step(shape: Sequence[int] = (8, 16, 14, 14), dtype: Any = np.float32, seed: int = 0,
         group: str = "local", world: int = 1) -> dict[str, np.ndarray]:
    """:func:`step_on` on :func:`make_inputs`."""
    return step_on(**make_inputs(shape, dtype, seed), group=group, world=world)


def shape_arg(text: str) -> tuple[int, ...]:
    """"8,16,14,14" -> (8, 16, 14, 14): N,C[,...], every dim at least 1 (argparse turns the
    ValueError into a usage error)."""
    shape = tuple(int(v) for v in text.split(","))
    if len(shape) < 2 or min(shape) < 1:
        raise ValueError(text)
    return shape


def main(argv: "Sequence[str] | None" = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=shape_arg, default=(8, 16, 14, 14),
                    help="N,C[,...] of the batch (default: 8,16,14,14)")
    shape = ap.parse_args(argv).shape
    for level in (0, 1, 2):
        with opgraph.capture(level) as prog:
            step(shape)
        one, s = prog.stats_one_by_one(), prog.stats()
        print(f"level {level}: one by one {one.launches} launches + {one.collectives} collectives, "
              f"{one.bytes_moved} B; captured {s.launches} launches + {s.collectives} "
              f"collectives, {s.bytes_moved} B")
    print(prog.compiled)


if __name__ == "__main__":
    main()
