"""The native backend's serial call on per-channel work (backends/native/prologue.py, small.py):
sums over at most 64 elements (each in a lane of its own, folded 64 kept indices at a time),
per-channel instructions ``OPG_W`` elements at a time with their size-1 dims left out, and the
thresholds that send a body of such sums to the serial call (``min_short_elements`` where the
passes would run in C alone: the statistics of a [N <= 64, C] input; ``min_stepped_elements``
where they would stop for numpy: BatchNormGatherStatsWithCounts). Expected values: the l0ops
numpy reference and, for the sums, a tree fold written out here."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import ops
import reference as R
from backends import native
from native_limits import reduce_limits_at
from backends.native import build, small
from backends.native.direct_reduce import DirectReduce
from l0ops.fused_reduce import FusedReduce, FusedReduceAttrs
from l0ops.interpreter import run_fused
from l0ops.primitives import FusedAttrs, Instr
from opgraph.aclnn import batch_norm_gather_stats_with_counts as gather
from opgraph.aclnn.cache import EXECUTOR_CACHE
from opgraph.aclnn.direct import NUMPY_CALLS
from opgraph.core.dtypes import DataType as D

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])

NP = {D.FLOAT: np.float32, D.FLOAT16: np.float16, D.BF16: ml_dtypes.bfloat16}


def I(op, *args, dtype=D.FLOAT, **kw):  # noqa: E743 - short name for body listings
    return Instr(op=op, args=args, dtype=dtype, **kw)


def spread(rng, shape, decades: int = 6, dtype=np.float32) -> np.ndarray:
    """Values of very different magnitudes, so that the order of the additions shows in the bits."""
    x = rng.uniform(0.5, 1.5, shape) * 10.0 ** rng.integers(-decades, decades + 1, shape)
    return (x * rng.choice([-1, 1], shape)).astype(dtype)


def tree(values: np.ndarray) -> np.float32:
    """l0ops.ordered's fold of up to 64 lanes, in float32: a[j] += a[j + n], n = ceil(m/2)."""
    a, m = [np.float32(v) for v in values], len(values)
    while m > 1:
        n = (m + 1) // 2
        for j in range(m - n):
            a[j] = np.float32(a[j] + a[j + n])
        m = n
    return a[0]


def sum_attrs(over, keep, dtype=D.FLOAT) -> FusedReduceAttrs:
    body = (I("sum", "in0", dtype=dtype, shape=keep, over=over),)
    return FusedReduceAttrs(body=body, results=("t0",), out_shapes=(tuple(n for n in keep if n != 1) or (1,),))


@pytest.mark.parametrize("R_", [1, 2, 3, 17, 64, 65])
@pytest.mark.parametrize("K", [1, 63, 130])
def test_sum_over_the_ranks_of_every_channel(R_, K):
    """[R, K] summed over R: up to 64 each element in a lane of its own (the fast fold), 65 the
    general path; every kept index (a partial last chunk of 64 too) the tree of its column."""
    x = spread(np.random.default_rng(R_ * 1000 + K), (R_, K))
    x[0, 0], x[-1, K // 2] = -0.0, np.inf
    a = sum_attrs((R_, K), (1, K))
    assert small.short_sums(a) == (R_ <= 64)
    got = small.run_small_reduce_native(a, [x])[0]
    R.assert_bits_equal(got, FusedReduce.compute([x], a)[0])
    if R_ <= 64:  # the sum is the lanes' tree
        R.assert_bits_equal(got, np.float32([tree(x[:, k]) for k in range(K)]))


@pytest.mark.parametrize("layout", ["reduced inner", "strided", "two reduced dims"])
@pytest.mark.parametrize("dt", [D.FLOAT, D.FLOAT16, D.BF16])
def test_short_sums_in_other_layouts_and_dtypes(layout, dt):
    """The reduced elements read through their strides in row-major order (kept innermost or
    not, negative strides, two reduced dims), the sum rounded to its dtype."""
    rng = np.random.default_rng(7)
    K, values = 70, {"decades": 6 if dt == D.FLOAT else 2, "dtype": NP[dt]}  # a sum keeps its dtype
    if layout == "reduced inner":
        x, over, keep = spread(rng, (K, 5), **values), (K, 5), (K, 1)
    elif layout == "strided":
        x, over, keep = spread(rng, (12, 2 * K), **values)[::-2, ::2], (6, K), (1, K)
    else:
        x, over, keep = spread(rng, (4, K, 8), **values), (4, K, 8), (1, K, 1)
    a = sum_attrs(over, keep, dt)
    assert small.short_sums(a)
    R.assert_bits_equal(small.run_small_reduce_native(a, [x])[0], FusedReduce.compute([x], a)[0])


@pytest.mark.parametrize("dt", [D.FLOAT, D.FLOAT16, D.BF16])
def test_inputs_copied_in_a_vector_at_a_time(dt):
    """The body's inputs widened into the call's registers: a row read in place (inner stride
    1), a value repeated along the row (a broadcast view, inner stride 0) and a strided one
    (element by element), each over rows of 40 (two or five vectors and a tail)."""
    rng = np.random.default_rng(13)
    K, n = 6, 40
    col = spread(rng, (K, 1), 2, NP[dt])
    inputs = [spread(rng, (K, n), 2, NP[dt]), np.broadcast_to(col, (K, n)),
              spread(rng, (K, 3 * n), 2, NP[dt])[:, ::3]]
    body = (I("mul", "in0", "in1", dtype=dt), I("add", "t0", "in2", dtype=dt),
            I("sum", "t1", dtype=dt, shape=(K, 1), over=(K, n)))
    a = FusedReduceAttrs(body=body, results=("t1", "t2"), out_shapes=((K, n), (K,)))
    for got, want in zip(small.run_small_reduce_native(a, inputs), FusedReduce.compute(inputs, a)):
        R.assert_bits_equal(got, want)


def test_a_gather_like_body_with_a_broadcast_count():
    """Σ_w mean[w, c] · count[w] / Σ count, the counts viewed [W, 1]: rows whose operands are a
    per-channel row and a per-rank constant (inner strides 1 and 0)."""
    rng = np.random.default_rng(3)
    W, C = 5, 37
    body = (I("view", "in1", shape=(W, 1)), I("mul", "in0", "t0"),
            I("sum", "t1", shape=(1, C), over=(W, C)), I("sum", "t0", shape=(1, 1), over=(W, 1)),
            I("div", "t2", "t3"), I("sqrt", "t4"))
    a = FusedReduceAttrs(body=body, results=("t4", "t5"), out_shapes=((C,), (C,)))
    ins = [spread(rng, (W, C)), np.float32(rng.integers(1, 9, W))]
    with np.errstate(all="ignore"):
        for got, want in zip(small.run_small_reduce_native(a, ins), FusedReduce.compute(ins, a)):
            R.assert_bits_equal(got, want)


def test_what_makes_a_body_short():
    assert small.short_sums(sum_attrs((8, 16, 8), (1, 16, 1)))          # 64 elements a channel
    assert not small.short_sums(sum_attrs((8, 16, 9), (1, 16, 1)))      # 72
    assert not small.short_sums(FusedReduceAttrs(body=(I("sum", "in0", shape=(1, 3)),),
                                                 results=("t0",), out_shapes=((3,),)))  # no over
    limits = (4096, 1 << 16, 1 << 20)
    assert [small.serial_below(k, *limits) for k in (small.LONG, small.SHORT, small.STEPPED)] == [4096, 1 << 16, 1 << 20]
    assert small.serial_below(small.SHORT, 10 ** 6, 1 << 16, 1 << 20) == 10 ** 6


SPECIAL = [np.nan, -0.0, 0.0, np.inf, -np.inf, -2, 1e-45, 3e-39, 0.1, 7, 1e30, 65504, 70000, 1 / 3]


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "sqrt", "cast", "pow-0.5", "pow2", "pow-1"])
@pytest.mark.parametrize("dt", [D.FLOAT, D.FLOAT16, D.BF16])
def test_per_channel_instructions_a_vector_at_a_time(op, dt):
    """A per-channel [1, C, 1] instruction of a fused body (its size-1 dims left out: one row of
    C = 37, two or four vectors and a tail) on special values, against a per-channel constant
    (inner stride 0) or another channel row (stride 1): the interpreter's bits."""
    C = 37
    rng = np.random.default_rng(11)
    with np.errstate(all="ignore"):
        u = np.resize(np.float32(SPECIAL), C) * rng.choice(np.float32([1, -1]), C)
        v = rng.permutation(u)
    per, src = (1, C, 1), D.FLOAT if op == "cast" else dt  # arithmetic keeps its operands' dtype
    body = [I("view", "in0", dtype=src, shape=per), I("view", "in1", dtype=src, shape=per)]
    if op.startswith("pow"):
        body += [I("fill", value=float(op[3:]), dtype=dt), I("pow", "t0", "t2", dtype=dt)]
    else:
        args = {"add": ("t0", "t1"), "sub": ("t1", "t0"), "mul": ("t0", "t2"), "div": ("t2", "t0"),
                "sqrt": ("t0",), "cast": ("t1",)}[op]
        body += [I("fill", value=0.3, dtype=src), I(op, *args, dtype=dt)]
    body.append(I("mul", "in2", "t3", dtype=dt))
    a = FusedAttrs(shape=(2, C, 5), body=tuple(body), result="t4", out_dtype=dt)
    with np.errstate(all="ignore"):
        ins = [u.astype(NP[src]), v.astype(NP[src]), rng.uniform(1, 2, (2, C, 5)).astype(NP[dt])]
    with np.errstate(all="ignore"):
        R.assert_bits_equal(native.run_fused_native(a, ins), run_fused(a, ins))


@pytest.fixture
def direct_sides(monkeypatch):
    """The side (serial call or passes) of every prepared direct FusedReduce run."""
    sides, real = [], DirectReduce.run

    def spy(self, bindings, limits):
        done = real(self, bindings, limits)
        sides.append(("serial" if self.small else "passes") if done else None)
        return done
    monkeypatch.setattr(DirectReduce, "run", spy)
    return sides


def test_the_kind_of_a_body_picks_its_threshold():
    """Statistics over 8 rows are short sums two on a chain (their passes run as one C call);
    the gather's three on a chain would stop for numpy between passes; statistics over 100
    rows are long. Told from the body alone: nothing is compiled."""
    before = build.stats["compiles"]
    stats = (I("sum", "in0", shape=(1, 512), over=(8, 512)), I("sub", "in0", "t0"),
             I("mul", "t1", "t1"), I("sum", "t2", shape=(1, 512), over=(8, 512)))
    assert small.serial_kind(FusedReduceAttrs(body=stats, results=("t3",), out_shapes=((512,),))) == small.SHORT
    assert small.serial_kind(sum_attrs((100, 512), (1, 512))) == small.LONG
    body = (I("view", "in1", shape=(8, 1)), I("mul", "in0", "t0"),
            I("sum", "t0", shape=(1, 1), over=(8, 1)), I("div", "t1", "t2"),
            I("sum", "t3", shape=(1, 512), over=(8, 512)), I("sub", "in0", "t4"),
            I("sum", "t5", shape=(1, 512), over=(8, 512)))
    assert small.sum_chain(body) == 3
    assert small.serial_kind(FusedReduceAttrs(body=body, results=("t6",), out_shapes=((512,),))) == small.STEPPED
    assert build.stats["compiles"] == before


@pytest.mark.parametrize("case", ["gather over 8 ranks", "stats over 8 rows"])
def test_a_short_body_over_min_elements_runs_the_serial_call(case, direct_sides, monkeypatch):
    """Over ``min_elements`` (4096) but under its threshold — the gather of 8 ranks × 512
    channels (9224 elements; stepped), the statistics of [8, 1024] (8192; short) — the serial
    call; with the thresholds at 0 the passes; numpy's bits both ways."""
    rng = np.random.default_rng(5)
    W, C = 8, 512
    mean, invstd = rng.standard_normal((W, C)).astype(np.float32), rng.uniform(0.5, 2, (W, C)).astype(np.float32)
    counts = rng.integers(1, 50, W).astype(np.float32)
    x = (rng.standard_normal((8, 1024)) * 3 + 1).astype(np.float32)
    results = {}
    for name, backend, limit in (("numpy", "numpy", None), ("serial", "native", None), ("passes", "native", 0)):
        if limit is not None:
            monkeypatch.setattr(native.NativeBackend, "min_short_elements", limit)
            monkeypatch.setattr(native.NativeBackend, "min_stepped_elements", limit)
        EXECUTOR_CACHE.clear()  # prepared anew, on this side of the threshold
        NUMPY_CALLS.entries.clear()
        rm, rv = np.zeros(C, np.float32), np.ones(C, np.float32)
        with opgraph.use_backend(backend), opgraph.opt_level(2):
            for _ in range(2):  # the second call runs the prepared direct path
                if case == "stats over 8 rows":
                    got = list(ops.batch_norm_stats(x, 1e-5))
                else:
                    got = list(gather.batch_norm_gather_stats_with_counts(
                        np.zeros((2, C, 3), np.float32), mean, invstd, rm, rv, 0.1, 1e-5, counts)) + [rm, rv]
        results[name] = got
        if backend == "native":
            assert direct_sides and direct_sides[-1] == name
    for side in ("serial", "passes"):
        for got, want in zip(results[side], results["numpy"]):
            R.assert_bits_equal(got, want)


@pytest.mark.parametrize("rows", [5, 37, 63, 100])
@pytest.mark.parametrize("layout", ["2-d", "channels_last"])
def test_passes_over_few_rows_fold_every_channel_alike(rows, layout, monkeypatch):
    """A channels_last pass over fewer than 64 rows (an odd number: the lanes' tree halves
    unevenly) folds the lanes of all its channels at once (``opg_fold_cols``): the statistics
    and the backward sums on the passes (the thresholds at 0), numpy's bits."""
    reduce_limits_at(monkeypatch, 0)
    rng = np.random.default_rng(rows)
    C = 80
    shape = (rows, C) if layout == "2-d" else (1, C, 1, rows)
    x = spread(rng, shape)
    dy = spread(rng, shape)
    if layout == "channels_last":  # channels innermost in memory
        x, dy = (np.moveaxis(np.ascontiguousarray(np.moveaxis(a, 1, -1)), -1, 1) for a in (x, dy))
    mean, invstd, w = (rng.uniform(0.5, 2, C).astype(np.float32) for _ in range(3))
    results = {}
    for backend in ("numpy", "native"):
        with opgraph.use_backend(backend), opgraph.opt_level(2), np.errstate(all="ignore"):
            results[backend] = [*ops.batch_norm_stats(x, 1e-5),
                                *ops.batch_norm_backward_reduce(dy, x, mean, invstd, w, True, True, True)]
    for got, want in zip(results["native"], results["numpy"]):
        R.assert_bits_equal(got, want)
