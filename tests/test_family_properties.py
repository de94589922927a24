"""Random calls of the SyncBatchNorm-family op_apis through ``opgraph.ops``: the native backend
gives the numpy reference's bits on a call's first run and when it is repeated (the repeat runs
direct, "What phase 1 caches" in the README). Drawn per case: the SoC, the dtype (bf16 on the
950), rank 2-5, the channel count, each big array's layout (contiguous, channels last, a step
on the last dim, an offset), an ``out=`` array's layout, special values (NaN, ±inf, ±0, huge,
tiny) and the native run's opt level; every drawn call is valid. Which NaN comes out is left
open (README), as :func:`opgraph.testing.compare` does.
"""
from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

import opgraph
from backends import native
from opgraph import ops
from opgraph.testing import compare

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])

OPS = ("stats", "reduce", "gather", "sync_gather", "elemt", "elemt_out", "backward_reduce",
       "backward_elemt", "backward_elemt_out")
LAYOUTS = ["contiguous", "channels_last", "step", "offset"]
SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-8, 7e4, -3e38])


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any, special: bool) -> np.ndarray:
    x = rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 300.0])
    if special:
        hit = rng.random(shape) < 0.02
        x[hit] = rng.choice(SPECIAL, int(hit.sum()))
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(dtype)


def _laid_out(a: np.ndarray, layout: str) -> np.ndarray:
    """``a``'s values in ``layout``: channels last (dim 1 innermost in memory), every other
    element of a wider last dim, or one element past the start of a bigger buffer."""
    if layout == "channels_last":
        perm = (0, *range(2, a.ndim), 1)
        return np.ascontiguousarray(a.transpose(perm)).transpose(np.argsort(perm))
    if layout == "step":
        wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        wide[..., ::2] = a
        return wide[..., ::2]
    if layout == "offset":
        buf = np.zeros(a.size + 1, a.dtype)
        buf[1:] = a.ravel()
        return buf[1:].reshape(a.shape)
    return a


def drawn_call(seed: int) -> dict:
    """Case ``seed``: its op_api by ``seed`` (each of :data:`OPS` in turn), the rest drawn from it."""
    rng = np.random.default_rng(seed)

    def pick(options: list) -> Any:
        return options[int(rng.integers(len(options)))]
    op, soc = OPS[seed % len(OPS)], pick(["Ascend910B", "Ascend950"])
    rank = 4 if op == "reduce" else int(rng.integers(2, 6))  # BatchNormReduce takes 4-d only
    shape = (int(rng.integers(1, 7)), pick([1, 3, 8, 16, 31, 64]),
             *(pick([1, 2, 7, 16, 17, 33]) for _ in range(rank - 2)))
    return dict(op=op, soc=soc, shape=shape, level=pick([0, 1, 2]),
                dtype=pick(["float32", "float16"] + (["bfloat16"] if soc == "Ascend950" else [])),
                layouts=(pick(LAYOUTS), pick(LAYOUTS), pick(LAYOUTS)),
                weight_dtype=pick(["same", "float32"]), weight=bool(rng.random() < 0.8),
                bias=bool(rng.random() < 0.8), flags=tuple(bool(f) for f in rng.random(3) < 0.7),
                ranks=int(rng.integers(1, 4)), special=bool(rng.random() < 0.5), seed=seed)


def _call(p: dict) -> Callable[[], tuple]:
    """The drawn call, on fresh copies of its in-out and out= arrays each time."""
    rng = np.random.default_rng([p["seed"], 1])  # not the stream that drew the case
    dt = ml_dtypes.bfloat16 if p["dtype"] == "bfloat16" else np.dtype(p["dtype"])
    shape, (lx, ldy, lout), C = p["shape"], p["layouts"], p["shape"][1]
    x = _laid_out(_values(rng, shape, dt, p["special"]), lx)
    dy = _laid_out(_values(rng, shape, dt, p["special"]), ldy)
    wdt = dt if p["weight_dtype"] == "same" else np.float32
    mean, invstd = rng.standard_normal(C).astype(np.float32), rng.uniform(0.1, 3, C).astype(np.float32)
    weight = rng.standard_normal(C).astype(wdt) if p["weight"] else None
    bias = rng.standard_normal(C).astype(wdt) if p["bias"] else None
    out = _laid_out(np.zeros(shape, dt), lout)
    op = p["op"]
    if op == "stats":
        return lambda: ops.batch_norm_stats(x, 1e-5)
    if op == "reduce":
        return lambda: ops.batch_norm_reduce(x)
    if op == "gather":
        R = p["ranks"]
        means, invstds = _values(rng, (R, C), np.float32, p["special"]), rng.uniform(0.1, 3, (R, C)).astype(np.float32)
        counts = rng.integers(1, 50, R).astype(np.float32)

        def gather() -> tuple:
            running_mean, running_var = mean.copy(), invstd.copy()  # in-out
            got = ops.batch_norm_gather_stats_with_counts(x, means, invstds, running_mean,
                                                          running_var, 0.1, 1e-5, counts)
            return (*got, running_mean, running_var)
        return gather
    if op == "sync_gather":
        R = p["ranks"]
        sums = _values(rng, (R, C), dt, p["special"])
        squares = np.abs(_values(rng, (R, C), dt, p["special"]))
        counts = rng.integers(1, 50, R).astype(np.int32)

        def sync_gather() -> tuple:
            running_mean, running_var = mean.astype(dt), invstd.astype(dt)  # in-out, new each call
            got = ops.sync_batch_norm_gather_stats(sums, squares, counts, running_mean, running_var,
                                                   0.1, 1e-5)
            return (*got, running_mean, running_var)
        return sync_gather
    if op == "backward_reduce":
        return lambda: ops.batch_norm_backward_reduce(dy, x, mean, invstd, weight, *p["flags"])
    if op.startswith("elemt"):
        fn, args = ops.batch_norm_elemt, (x, weight, bias, mean, invstd, 1e-5)
    else:
        sums = rng.standard_normal((2, C)).astype(np.float32)
        fn, args = ops.batch_norm_elemt_backward, (dy, x, mean, invstd, weight, sums[0], sums[1],
                                                   np.int32([max(1, x.size // C)]))
    if not op.endswith("_out"):
        return lambda: (fn(*args),)

    def into_out() -> tuple:
        written = out.copy()  # the same layout
        fn(*args, out=written)
        return (written,)
    return into_out


def _run(call: Callable[[], tuple], backend: str, soc: str, level: int) -> list:
    """The call's outputs as arrays (None for one not asked for)."""
    with opgraph.use_backend(backend), opgraph.platform(soc), opgraph.opt_level(level):
        got = call()
    return [None if v is None else np.asarray(v) for v in got]


@pytest.mark.parametrize("seed", range(54))
def test_native_gives_the_numpy_bits_first_and_direct(seed):
    p = drawn_call(seed)
    call = _call(p)
    expected = _run(call, "numpy", p["soc"], 2)
    for run in ("first", "repeated"):
        got = _run(call, "native", p["soc"], p["level"])
        assert len(got) == len(expected)
        for k, (g, e) in enumerate(zip(got, expected)):
            assert (g is None) == (e is None), f"{run} run, output {k}: {g} against {e}"
            if e is not None:
                diff = compare(g, e)
                assert diff is None, f"{run} run, output {k}: {diff} ({p})"
