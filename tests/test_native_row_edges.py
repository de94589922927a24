"""The edges of a row in the native element-wise kernels (``backends.native.simd``): the
lanes left after the vector loops come from the row's last whole vector, of which only those
lanes are stored (``vector_tail``); in the non-temporal loop a peel of partly stored vectors up
to the first cache line boundary, non-temporal stores over whole lines only, the rest of the row
by ordinary stores. Rows of 49 or 196 elements (7×7, 14×14 maps) start and end anywhere in a
line, so every row exercises them. Each case must give numpy's bits, leave the memory around
the output alone, and stay right when the output is also an input (each lane reads only its own
elements, and the lanes a partial store leaves out are not written). Rows of 1 to
``simd.SHORT_ROW`` elements of an NCHW tensor run as one run per claim (``simd.short_rows``):
a vector's per-channel lanes split between two rows wherever a row ends inside it, or, for rows
of at most a vector, loaded from a table of the per-channel values along C rows."""
from __future__ import annotations

import numpy as np
import pytest

import backends
import opgraph
import reference as R
from backends import native
from backends.native import render, simd

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])

DTYPES = {"f32": R.F32, "f16": R.F16, "bf16": R.BF16}
SENTINEL = 8  # elements of the buffer on each side of the output



def _streamed_rows(inner: int, dtype) -> tuple[int, int, int]:
    """(N, C, inner) with C = 8 whose output reaches ``render.STREAM_BYTES``."""
    rows = -(-render.STREAM_BYTES // (inner * np.dtype(dtype).itemsize))
    return (-(-rows // 8), 8, inner)


def _native_into(case: R.Case, out: np.ndarray, arrays: "list | None" = None) -> None:
    """``case`` on the native backend at level 2 into ``out``, run in C (no fallback)."""
    b = backends.get("native")
    b.fallbacks.clear()
    with opgraph.opt_level(2), opgraph.use_backend("native"):
        opgraph.ops.batch_norm_elemt_backward(*(arrays or case.arrays()), out=out)
    assert not b.fallbacks, dict(b.fallbacks)


def _expected(case: R.Case) -> np.ndarray:
    with opgraph.opt_level(2), opgraph.use_backend("numpy"):
        return R.compute(case)


def _on_one_and_two_threads(case: R.Case, expected: np.ndarray, threads) -> None:
    """``case`` on native into a new output on one thread, then on two: ``expected``'s bits."""
    for k in (1, 2):
        threads(k)
        out = np.zeros(case.input.shape, case.out_dtype)
        _native_into(case, out)
        R.assert_bits_equal(out, expected)


def _in_place(case: R.Case, expected: np.ndarray) -> None:
    """``case`` on native with the output the gradient input itself: ``expected``'s bits."""
    arrays = case.arrays()
    grad = arrays[0].copy()
    arrays[0] = grad
    _native_into(case, grad, arrays)
    R.assert_bits_equal(grad, expected)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("inner", [7, 49, 196])
@pytest.mark.parametrize("offset", [0, 3])
def test_streamed_short_rows(dtype, inner, offset, threads):
    """Outputs over STREAM_BYTES in rows shorter than a vector (7), than a line of bf16 (49)
    and a few lines long (196), starting ``offset`` elements into a buffer: numpy's bits, the
    sentinels around the output untouched, for 1 and 2 threads."""
    dt = DTYPES[dtype]
    case = R.make_case(_streamed_rows(inner, dt), dt, seed=inner + offset)
    expected = _expected(case)
    for k in (1, 2):
        threads(k)
        buf = np.full(case.input.size + 2 * SENTINEL, 7, dt)
        out = buf[SENTINEL + offset:SENTINEL + offset + case.input.size].reshape(case.input.shape)
        _native_into(case, out)
        assert out.nbytes >= render.STREAM_BYTES
        R.assert_bits_equal(out, expected)
        outside = np.concatenate([buf[:SENTINEL + offset], buf[SENTINEL + offset + out.size:]])
        assert np.array_equal(R.bits(outside), R.bits(np.full(outside.size, 7, dt)))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("inner", [15, 17, 18, 23, 24, 31, 33, 47, 49, 63, 196])
def test_row_tails(dtype, inner):
    """Rows in the caches (no streaming) whose length leaves 1 to a vector's width minus one
    lanes after the vector loops, for 8 and 16 float lanes (and bf16's pairs of them), on
    either side of the fewest lanes a whole vector is used for (simd._tail_lanes: 2 and 8)."""
    dt = DTYPES[dtype]
    case = R.make_case((6, 5, inner), dt, seed=inner)
    out = np.zeros(case.input.shape, dt)
    _native_into(case, out)
    R.assert_bits_equal(out, _expected(case))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("streamed", [False, True], ids=["cached", "streamed"])
def test_output_is_the_gradient_input(dtype, streamed):
    """``out`` is ``gradOut`` itself: the tail's whole vector reads elements the vector loop
    has already overwritten, and the peel's vectors elements it has not reached; only lanes
    that read their own, unwritten elements are stored."""
    dt = DTYPES[dtype]
    shape = _streamed_rows(49, dt) if streamed else (6, 5, 49)
    case = R.make_case(shape, dt, seed=11)
    _in_place(case, _expected(case))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("inner", [1, 2, 4, 9, 15, 16, 17, 23, 31, 33, 100, simd.SHORT_ROW, simd.SHORT_ROW + 1])
def test_short_rows_as_one_run(dtype, inner, threads):
    """Rows of at most a vector (a vector's per-channel lanes from the table, simd.tiny_table)
    and longer ones whose end falls at every lane of a vector (split between two rows), up to
    and past the longest row run so; enough rows for several claims on two threads, so that a
    claim starts inside the channels (its first row's channel by division, its place in the
    table's period); a NaN mean and an infinite invstd in two channels."""
    dt = DTYPES[dtype]
    case = R.make_case((-(-render.GRAIN * 3 // (5 * inner)), 5, inner), dt, seed=inner)
    case.mean[0], case.invstd[1] = np.nan, np.inf
    _on_one_and_two_threads(case, _expected(case), threads)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_short_rows_of_one_image(dtype):
    """One image ([1, C, H, W]: the kernel sees [C, H·W]) and a 3-d [N, C, L] input, with rows
    longer than a vector and not."""
    dt = DTYPES[dtype]
    for shape in [(1, 48, 7, 7), (2, 40, 31), (1, 40, 3, 3), (3, 17, 5)]:
        case = R.make_case(shape, dt, seed=sum(shape))
        out = np.zeros(case.input.shape, dt)
        _native_into(case, out)
        R.assert_bits_equal(out, _expected(case))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("C", [3, 10, 15, 17, 20, 40, 63, 64])
def test_few_channels_innermost(dtype, C, threads):
    """A 2-d [N, C] input (BatchNorm1d) with fewer channels than four vectors' lanes: its rows as
    one run, each vector's per-channel lanes from a one-row table (simd.tiny_table); several
    claims on two threads; and the output also the gradient input."""
    dt = DTYPES[dtype]
    case = R.make_case((-(-render.GRAIN * 3 // C), C), dt, seed=C)
    case.mean[0] = np.nan
    expected = _expected(case)
    _on_one_and_two_threads(case, expected, threads)
    _in_place(case, expected)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_few_channels_last_streamed(dtype):
    """channels_last with 3 channels (a network's first layer; the kernel sees [N·H·W, 3]), an
    output over STREAM_BYTES: the run's whole lines streamed, numpy's bits."""
    dt = DTYPES[dtype]
    hw = int((render.STREAM_BYTES / (2 * 3 * np.dtype(dt).itemsize)) ** 0.5) + 1
    case = R.make_case((2, 3, hw, hw), dt, seed=4)
    expected = _expected(case)
    arrays = case.arrays()
    arrays[0], arrays[1] = R.channels_last(arrays[0]), R.channels_last(arrays[1])
    out = R.channels_last(np.zeros(case.input.shape, dt))
    _native_into(case, out, arrays)
    assert out.nbytes >= render.STREAM_BYTES
    R.assert_bits_equal(out, expected)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("C", [64, 100, 256])
@pytest.mark.parametrize("offset", [0, 1])
def test_channels_innermost_rows_streamed(dtype, C, offset, threads):
    """A 2-d [N, C] input whose output reaches STREAM_BYTES: where the output starts on a cache
    line and a row is whole lines (64 and 256 channels at offset 0) the rows, four at a time, are
    stored non-temporally (render: ``lines``); otherwise (100 channels, or an output one element
    into its buffer) by ordinary stores. N leaves rows past the last four for the one-row loop.
    numpy's bits, the sentinels around the output untouched, on 1 and 2 threads."""
    dt = DTYPES[dtype]
    size = np.dtype(dt).itemsize
    N = -(-render.STREAM_BYTES // (C * size)) + 3
    case = R.make_case((N, C), dt, seed=C + offset)
    expected = _expected(case)
    per_line = 64 // size
    for k in (1, 2):
        threads(k)
        buf = np.full(N * C + 3 * per_line + 1, 7, dt)
        start = (-buf.ctypes.data % 64) // size + per_line + offset  # a line of sentinels first
        out = buf[start:start + N * C].reshape(N, C)
        assert (out.ctypes.data % 64 == 0) == (offset == 0)
        _native_into(case, out)
        assert out.nbytes >= render.STREAM_BYTES
        R.assert_bits_equal(out, expected)
        outside = np.concatenate([buf[:start], buf[start + out.size:]])
        assert np.array_equal(R.bits(outside), R.bits(np.full(outside.size, 7, dt)))
