"""The native kernels' loop over pairs of bf16 vectors (``render.paired``: one load widened into
two vectors of interleaved lanes, packed back in order by one store) and the rounding only the
store reads, which leaves the low half (``render.store_reads_top``). Both must give numpy's bits
for every row length around the pair and vector widths, in the plain loop and in the streamed
(non-temporal) one from any alignment, in quiet rows and in rows that a NaN with low payload
bits sends to the NaN-tested rounding."""
from __future__ import annotations

from typing import Callable

import ml_dtypes
import numpy as np
import pytest

import backends
import opgraph
import reference as R
from backends import native
from backends.native import render, team
from l0ops.interpreter import Hoisted
from l0ops.primitives import FusedAttrs, Instr
from opgraph.core.dtypes import DataType as D
from opgraph.testing import compare

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])

BF16 = ml_dtypes.bfloat16
DIRTY_NAN = np.array([0xFFFFFFFF], np.uint32).view(np.float32)[0]  # low payload bits set


def _plan(big: tuple[D, D], out: D) -> render.Plan:
    """in0 * in1 - c in float32 (c a per-channel float32 scalar), rounded to bf16 (t4), then
    t4 + t4 in bf16 (the result, for a bf16 ``out``) or t4 cast to ``out``."""
    last = Instr(op="add", args=("t4", "t4"), dtype=D.BF16) if out == D.BF16 else \
        Instr(op="cast", args=("t4",), dtype=out)
    body = (Instr(op="cast", args=("in0",), dtype=D.FLOAT),
            Instr(op="cast", args=("in1",), dtype=D.FLOAT),
            Instr(op="mul", args=("t0", "t1"), dtype=D.FLOAT),
            Instr(op="sub", args=("t2", "in2"), dtype=D.FLOAT),
            Instr(op="cast", args=("t3",), dtype=D.BF16), last)
    a = FusedAttrs(shape=(2, 8), body=body, result="t5", out_dtype=out)
    return render.plan(a, Hoisted(a, [np.ones((2, 8), big[0].np), np.ones((2, 8), big[1].np),
                                      np.ones((2, 1), np.float32)]))


def test_the_pair_loop_is_rendered_for_bf16_data_only():
    both_bf16 = render.render(_plan((D.BF16, D.BF16), D.BF16))
    assert render.paired(_plan((D.BF16, D.BF16), D.BF16))
    assert "opg_vi_ld(&q0[j])" in both_bf16 and "opg_v_st2_bf16(&q3[j], v_t5_a, v_t5_b)" in both_bf16
    assert "opg_v_nt2_bf16(&q3[j]" in both_bf16 and "for (; j + OPG_PW <= nl; j += OPG_PW)" in both_bf16
    for big, out in [((D.BF16, D.FLOAT), D.BF16), ((D.BF16, D.BF16), D.FLOAT),
                     ((D.FLOAT16, D.FLOAT16), D.BF16)]:
        p = _plan(big, out)
        assert not render.paired(p) and "opg_vi_ld(&" not in render.render(p)


def test_only_a_rounding_the_store_alone_reads_keeps_the_low_half():
    p = _plan((D.BF16, D.BF16), D.BF16)
    src = render.render(p)
    assert render.store_reads_top(p)
    # t4 is read by t5: cleared; t5 only by the store: its low half left (quiet rows or not)
    assert "v_t4 = opg_v_rnd_bf16_q(v_t3)" in src and "v_t4 = opg_v_rnd_bf16(v_t3)" in src
    assert "v_t5 = opg_v_rnd_bf16_qtop(" in src and "v_t5 = opg_v_rnd_bf16_top(" in src
    assert "v_t4_a = opg_v_rnd_bf16_q(v_t3_a)" in src and "v_t5_b = opg_v_rnd_bf16_qtop(" in src
    assert not render.store_reads_top(_plan((D.BF16, D.BF16), D.FLOAT))


def _patterns(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Every bf16 bit pattern (NaNs, infinities, subnormals, ties), shuffled, tiled to ``shape``."""
    pool = np.random.default_rng(seed).permutation(np.arange(65536, dtype=np.uint16))
    return np.resize(pool, shape).view(BF16)


def _assert_numpys_bits(outs: list[np.ndarray]) -> None:
    """numpy's bits except which NaN comes out (IEEE leaves the payload and sign open; numpy's
    own SIMD loops pick operands differently): NaNs in the same places (``compare``)."""
    nan = np.isnan(outs[0].astype(np.float32))
    assert (~nan).sum() > nan.sum()  # mostly ordinary numbers, compared bit by bit
    diff = compare(outs[1], outs[0])
    assert diff is None, diff


def _numpy_then_native(call: Callable[[], np.ndarray]) -> list[np.ndarray]:
    """``call()`` on Ascend950 at level 2 on the numpy backend, then on native (which must run
    its kernel in C)."""
    outs = []
    backends.get("native").fallbacks.clear()
    for name in ("numpy", "native"):
        with opgraph.platform("Ascend950"), opgraph.opt_level(2), opgraph.use_backend(name), \
                np.errstate(all="ignore"):
            outs.append(call())
    assert not backends.get("native").fallbacks  # the kernel ran in C
    return outs


def _backward_elemt(grad, inp, channel, out_of) -> list[np.ndarray]:
    """aclnnBatchNormElemtBackward on numpy, then on native (into ``out_of()``)."""
    counter = np.array([grad.size // grad.shape[1]], np.int32)
    return _numpy_then_native(lambda: opgraph.ops.batch_norm_elemt_backward(
        grad, inp, *channel, counter, out=out_of()))


def _channel(C: int, rng: np.random.Generator, dirty: bool) -> list[np.ndarray]:
    """mean, invstd, weight, sum_dy, sum_dy_xmu as float32; with ``dirty`` channel 0's mean is a
    NaN with low payload bits (its rows take the NaN-tested rounding) and channel 1's invstd
    infinite."""
    params = [rng.uniform(0.5, 2, C).astype(np.float32) for _ in range(5)]
    params[0][2 % C] = -params[0][2 % C]
    if dirty:
        params[0][0], params[1][1 % C] = DIRTY_NAN, np.inf
    return params


@pytest.mark.parametrize("inner", [7, 8, 15, 16, 17, 23, 24, 31, 33, 47, 48, 1001])
@pytest.mark.parametrize("dirty", [False, True], ids=["quiet", "dirty"])
def test_every_row_length_around_the_widths(inner, dirty):
    """Rows shorter than one vector, than a pair, and every remainder after the pairs (a whole
    vector, a scalar tail, both), 8 and 16 float lanes alike."""
    C = 5
    rng = np.random.default_rng(inner)
    grad, inp = _patterns((3, C, inner), 1), _patterns((3, C, inner), 2)
    _assert_numpys_bits(_backward_elemt(grad, inp, _channel(C, rng, dirty), lambda: None))


@pytest.mark.parametrize("offset", [0, 1, 7])
def test_the_streamed_pairs_from_any_alignment(offset):
    """An output over ``render.STREAM_BYTES`` takes the non-temporal loop, whose pairs store
    whole aligned pairs: ``offset`` elements into a buffer and an odd row length start rows at
    every alignment, so the scalar peel before the pairs runs 0 to 2 * lanes - 1 elements."""
    C, inner = 4, render.STREAM_BYTES // 2 // 8 + 13
    grad, inp = _patterns((2, C, inner), 3), _patterns((2, C, inner), 4)
    channel = _channel(C, np.random.default_rng(offset), dirty=True)
    n = grad.size

    def out_of() -> np.ndarray:
        return np.zeros(n + offset, BF16)[offset:].reshape(grad.shape)
    _assert_numpys_bits(_backward_elemt(grad, inp, channel, out_of))


@pytest.mark.parametrize("inner", [15, 40, render.STREAM_BYTES // 2 // 4 + 9], ids=["short", "rows", "streamed"])
def test_batch_norm_elemt_bf16_pairs(inner):
    """aclnnBatchNormElemt on Ascend950 (bf16 input, one full-size operand): numpy's bits."""
    C = 3
    x = _patterns((2, C, inner), 5)
    rng = np.random.default_rng(6)
    w, b, mean, invstd = (rng.uniform(0.5, 2, C).astype(np.float32) for _ in range(4))
    mean[0] = np.nan
    _assert_numpys_bits(_numpy_then_native(lambda: opgraph.ops.batch_norm_elemt(x, w, b, mean, invstd, 1e-5)))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape,layout", [((4099, 16), "2d"), ((4099, 24), "2d"), ((1030, 31), "2d"),
                                          ((3, 40, 5, 7), "channels_last")],
                         ids=["4099x16", "4099x24", "1030x31", "channels_last"])
def test_pairs_with_per_channel_vectors(shape, layout, threads):
    """Channels innermost (a 2-d [N, C] input, channels_last): the per-channel operands are
    vectors along the row, loaded in the pairs' lane order (``opg_v_lo_f32``), once for 4 rows
    in the rows block and per row in the rows left over. Channels a whole number of pairs, a
    pair and a vector, a pair and a scalar tail; one and two threads."""
    C = shape[1]
    grad, inp = _patterns(shape, 7), _patterns(shape, 8)
    out_of = lambda: None  # noqa: E731
    if layout == "channels_last":  # inputs and output: the kernel walks the output's memory
        grad, inp = (R.channels_last(a) for a in (grad, inp))
        out_of = lambda: R.channels_last(np.zeros(shape, BF16))  # noqa: E731
    channel = _channel(C, np.random.default_rng(C), dirty=True)
    before = team.threads()
    team.set_threads(threads)
    try:
        _assert_numpys_bits(_backward_elemt(grad, inp, channel, out_of))
    finally:
        team.set_threads(before)
