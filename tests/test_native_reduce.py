"""FusedReduce on the native backend (backends/native/reduce.py, reduce_c.py): bit-identical to
the numpy reference (l0ops.ordered's order) for every dtype, layout and length — runs that start
mid-lane, blocks whose last one is shorter than 64 lanes, strided, channels_last and broadcast
inputs, NaN/Inf/-0.0 — the same for any thread count, planned once per operand layout. The
family's op_apis, channel groups, epilogues and rows: tests/test_native_reduce_paths.py."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from backends import native
from backends.native import build
from backends.native import reduce as native_reduce
from backends.native.reduce import collapse_reduced
from backends.native.reduce_run import run_fused_reduce_native
from l0ops.fused_reduce import FusedReduceAttrs, Instr
from reduce_bodies import BF16, DTYPES, F16, F32, backward_body, bits, check_same, keep, passes_of, stats_body, steps_of

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])

SHAPES = [(4, 3, 5, 6), (2, 3, 28, 28), (3, 2, 40000), (1, 2, 32768 + 5), (5, 4, 7, 9), (2, 64)]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_sums_bits_equal_numpy_and_near_float64(shape, dt):
    rng = np.random.default_rng(0)
    dy = rng.standard_normal(shape).astype(DTYPES[dt])
    x = rng.standard_normal(shape).astype(DTYPES[dt])
    mean = rng.standard_normal(shape[1]).astype(np.float32).reshape(keep(shape))
    got = check_same(backward_body(shape, dt), [dy, x, mean])
    axes = tuple(d for d in range(len(shape)) if d != 1)
    d64, x64 = dy.astype(np.float64), x.astype(np.float64)
    scale = np.abs(d64 * x64).sum(axes) + 1
    assert np.all(np.abs(got[0] - (d64 * x64).sum(axes)) <= 1e-4 * scale)
    assert np.all(np.abs(got[1] - d64.sum(axes)) <= 1e-4 * (np.abs(d64).sum(axes) + 1))


@pytest.mark.parametrize("half", [None, F16, BF16], ids=["f32", "f16-diff", "bf16-diff"])
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", [(8, 5, 33, 31), (3, 4, 28, 28), (2, 3, 40001)], ids=lambda s: "x".join(map(str, s)))
def test_two_pass_statistics_bits_equal_numpy(shape, dt, half):
    x = (np.random.default_rng(1).standard_normal(shape) * 3 + 2).astype(DTYPES[dt])
    mean, var = check_same(stats_body(shape, half), [x])
    axes = tuple(d for d in range(len(shape)) if d != 1)
    assert np.allclose(mean, x.astype(np.float64).mean(axes), rtol=1e-5, atol=1e-5)
    assert np.allclose(var, x.astype(np.float64).var(axes), rtol=1e-2 if half else 1e-5)


@pytest.mark.parametrize("half", [None, F16, BF16], ids=["f32", "f16-diff", "bf16-diff"])
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", [(3, 9, 33, 31), (2, 64, 28, 28), (2, 8, 40001), (1, 12, 32768 + 5)],
                         ids=lambda s: "x".join(map(str, s)))
def test_statistics_run_channel_by_channel_with_the_bits_of_two_passes(shape, dt, half, monkeypatch):
    """From BLOCKED_MIN_K channels the two passes run a group of channels at a time in one C
    call (the mean, then the squared differences while the group is in cache; groups of 8 for
    2×64×28×28, 3 for 1×12×32773, whose channels' bytes fill the group's budget, 2 for 9
    channels, one at a time for 2×8×40001): numpy's bits, and the bits of the two passes run
    one after the other."""
    x = (np.random.default_rng(12).standard_normal(shape) * 3 + 2).astype(DTYPES[dt])
    x.reshape(-1)[5::1009] = 3e4  # large values among small ones: a change of order shows
    a = stats_body(shape, half)
    blocked = check_same(a, [x])
    assert steps_of(a, [x]) == ["blocked"]
    monkeypatch.setattr(native_reduce, "BLOCKED_MIN_K", 10 ** 9)
    a = stats_body(shape, half)  # a new body object: planned anew
    assert steps_of(a, [x]) == ["pass", "pass"]
    apart = run_fused_reduce_native(a, [x])
    assert all(np.array_equal(bits(p), bits(q)) for p, q in zip(blocked, apart))
    axes = tuple(d for d in range(len(shape)) if d != 1)
    assert np.allclose(blocked[0], x.astype(np.float64).mean(axes), rtol=1e-5, atol=1e-5)


def test_statistics_with_nan_inf_and_signed_zero_run_channel_by_channel():
    shape = (2, 8, 3000)
    x = np.random.default_rng(13).standard_normal(shape).astype(np.float32)
    x[:, 0] = -0.0
    x[1, 1, 17] = np.nan
    x[0, 2, 5] = np.inf
    x[:, 3, ::2], x[:, 3, 1::2] = np.inf, -np.inf
    a = stats_body(shape)
    with np.errstate(invalid="ignore"):
        mean, var = check_same(a, [x])
    assert steps_of(a, [x]) == ["blocked"]
    assert np.signbit(mean[0]) and np.isnan(mean[1]) and mean[2] == np.inf and np.isnan(mean[3])
    assert np.isnan(var[1]) and np.isnan(var[2]) and np.all(np.isfinite(var[4:]))


def test_a_pass_reading_a_per_channel_input_keeps_two_passes():
    """An instruction between the passes that reads a per-channel input (not computed from the
    first pass) is not rendered per channel: the passes run one after the other."""
    shape = (3, 16, 50)
    body = list(stats_body(shape).body)
    body[3] = Instr(op="mul", args=("t1", "in1"), dtype=F32)  # the mean's scale from an input
    a = FusedReduceAttrs(body=tuple(body), results=("t3", f"t{len(body) - 1}"), out_shapes=((16,),) * 2)
    x = np.random.default_rng(14).standard_normal(shape).astype(np.float32)
    scale = np.full((1, 16, 1), 1 / 150, np.float32)
    check_same(a, [x, scale])
    assert steps_of(a, [x, scale]) == ["pass", "pass"]


def test_exact_sums_equal_the_exact_values():
    """Small integers: every partial sum is exact, so any correct order gives the true sum."""
    shape = (7, 3, 33, 35)
    x = np.random.default_rng(2).integers(-50, 50, shape).astype(np.float32)
    mean, _ = run_fused_reduce_native(stats_body(shape), [x])
    n = np.float32(1.0 / (7 * 33 * 35))
    assert np.array_equal(mean, x.astype(np.float64).sum((0, 2, 3)).astype(np.float32) * n)


@pytest.mark.parametrize("layout", ["channels_last", "sliced", "transposed", "broadcast"])
def test_strided_and_broadcast_inputs_bits_equal_numpy(layout):
    rng = np.random.default_rng(3)
    shape = (6, 8, 13, 11)
    base = rng.standard_normal((6, 13, 11, 8)).astype(np.float32)
    if layout == "channels_last":
        x = base.transpose(0, 3, 1, 2)
    elif layout == "sliced":
        x = rng.standard_normal((6, 8, 13, 22)).astype(np.float32)[..., ::2]
    elif layout == "transposed":
        x = rng.standard_normal((11, 13, 8, 6)).astype(np.float32).transpose(3, 2, 1, 0)
    else:
        x = np.broadcast_to(rng.standard_normal((1, 8, 13, 11)).astype(np.float32), shape)
    dy = rng.standard_normal(shape).astype(np.float32)
    mean = rng.standard_normal(8).astype(np.float32).reshape(1, 8, 1, 1)
    check_same(backward_body(shape, "f32"), [dy, x, mean])
    check_same(stats_body(shape), [x])


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", [(4, 70, 9, 7), (2, 5, 150, 130), (3, 16, 64)], ids=lambda s: "x".join(map(str, s)))
def test_channels_last_kernel_bits_equal_numpy(shape, dt):
    """Kept indices contiguous, reduced dims strided: the items run across channels (chunks of
    64 with a tail, fewer channels than a vector, two blocks)."""
    rng = np.random.default_rng(11)
    order = (0,) + tuple(range(2, len(shape))) + (1,)
    def cl():  # channels_last memory, NC... shape
        return rng.standard_normal(tuple(shape[d] for d in order)).astype(DTYPES[dt]).transpose(
            np.argsort(order))
    x, dy = cl(), cl()
    mean = rng.standard_normal(shape[1]).astype(np.float32).reshape(keep(shape))
    stats = stats_body(shape, F16 if dt == "f16" else None)
    for a, ins in ((stats, [x]), (backward_body(shape, dt), [dy, x, mean])):
        check_same(a, ins)
        passes = passes_of(a, ins)
        assert passes and all(p.cols for p in passes)
        assert steps_of(a, ins) == (["blocked"] if a is stats else ["pass"])  # stats: one C call


@pytest.mark.parametrize("n", [1, 2, 7])
@pytest.mark.parametrize("shape", [(6272, 64), (600, 60), (20000, 2), (40000, 64), (3000, 70), (33000, 100),
                                   (12000, 200)],
                         ids=lambda s: "x".join(map(str, s)))
def test_channels_last_pass_of_one_item_splits_its_lanes(shape, n, threads):
    """A 2-d input is channels_last: its channels are the kept indices. With one block and one
    chunk of them (the first three shapes), or fewer than 8 such items over several blocks
    (40000×64 and 33000×100: two blocks, the second shorter; 100 channels are one chunk, and
    so are 200 over 9.6 MB), a parallel pass splits each block's 64 lanes into groups, one item
    each, and folds them after the run (reduce_c: OPG_LANE_GROUPS); one thread keeps one item. Every channel's order, and so its bits, stays numpy's; large values among
    small ones make a change of order show."""
    threads(n)
    rng = np.random.default_rng(31)
    x, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    x.reshape(-1)[5::293] = 3e4
    mean = rng.standard_normal(shape[1]).astype(np.float32).reshape(1, -1)
    stats = stats_body(shape)
    for a, ins in ((stats, [x]), (backward_body(shape, "f32"), [dy, x, mean])):
        check_same(a, ins)
        passes = passes_of(a, ins)
        assert passes and all(p.cols for p in passes)
        assert steps_of(a, ins) == (["blocked"] if a is stats else ["pass"])  # stats: one C call


def test_special_values_keep_their_bits():
    shape = (2, 4, 100)
    x = np.full(shape, -0.0, np.float32)                   # channel 0: all -0.0 -> -0.0
    x[:, 1] = np.random.default_rng(4).standard_normal((2, 100))
    x[0, 1, 7] = np.nan                                    # channel 1: NaN
    x[1, 2, 3] = np.inf                                    # channel 2: +inf
    x[:, 3, ::2], x[:, 3, 1::2] = np.inf, -np.inf          # channel 3: inf - inf = NaN
    dy = np.ones(shape, np.float32)
    with np.errstate(invalid="ignore"):  # inf - inf in the reference
        got = check_same(backward_body(shape, "f32"), [dy, x, np.zeros((1, 4, 1), np.float32)])
    assert np.signbit(got[0][0]) and got[0][0] == 0
    assert np.isnan(got[0][1]) and got[0][2] == np.inf and np.isnan(got[0][3])


def test_planned_once_per_layout():
    shape = (3, 4, 50, 60)
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    a = stats_body(shape)
    first = check_same(a, [x])
    compiles, memory = build.stats["compiles"], build.stats["memory_hits"]
    again = run_fused_reduce_native(a, [x + 0])              # same layout: no new kernel lookups
    assert build.stats["compiles"] == compiles and build.stats["memory_hits"] == memory
    assert all(np.array_equal(bits(p), bits(q)) for p, q in zip(first, again))
    check_same(a, [np.asfortranarray(x)])                    # another layout: planned anew


def test_collapse_keeps_the_row_major_order():
    assert collapse_reduced((32, 56, 56), [[200704, 56, 1]]) == ([32, 3136], [[200704, 1]])
    assert collapse_reduced((4, 1, 5), [[5, 7, 1], [1, 0, 4]]) == ([4, 5], [[5, 1], [1, 4]])
    assert collapse_reduced((1, 1), [[3, 1]]) == ([1], [[0]])


THREADS = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from reduce_bodies import backward_body, stats_body
from backends.native.reduce_run import run_fused_reduce_native
shape = (5, 3, 28, 1000)
rng = np.random.default_rng(7)
dy, x = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
m = rng.standard_normal((1, 3, 1, 1)).astype(np.float32)
outs = run_fused_reduce_native(backward_body(shape, "f32"), [dy, x, m]) + run_fused_reduce_native(stats_body(shape), [x])
wide = rng.standard_normal((3, 24, 28, 100)).astype(np.float32)  # channel by channel
outs += run_fused_reduce_native(stats_body(wide.shape), [wide])
sys.stdout.write(b"".join(o.tobytes() for o in outs).hex())
"""


def test_the_same_bits_for_any_thread_count():
    outs = []
    for n in ("1", "2", "3", "5"):
        env = {**os.environ, "OPGRAPH_NUM_THREADS": n, "OMP_NUM_THREADS": n}
        outs.append(subprocess.run([sys.executable, "-c", THREADS.format(tests=os.path.dirname(__file__))],
                                   env=env, capture_output=True, text=True, timeout=300, check=True).stdout)
    assert outs[0] and all(o == outs[0] for o in outs)
