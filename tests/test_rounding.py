"""l0ops.rounding.round_to_half against numpy's own float32 -> float16 -> float32 round trip, bit
for bit: every float16 value, every midpoint between neighbours (the ties) and the float32 on
either side of each, the edges of the three paths, and random float32 bits (NaN payloads
included). An exhaustive run over all 2**32 float32 patterns matched too (2026-12-05, 0 of
4294967296 differ; ~8 minutes, so not part of the suite)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from l0ops import rounding
from l0ops.rounding import LARGE_BITS, MIN_NORMAL_BITS, round_to_half, widen, widen_half


def numpy_round_trip(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return x.astype(np.float16).astype(np.float32)


def check(bits: np.ndarray) -> None:
    x = bits.astype(np.uint32).view(np.float32)
    expected = numpy_round_trip(x)
    with np.errstate(all="ignore"):
        got = round_to_half(x.copy())
    differ = np.flatnonzero(got.view(np.uint32) != expected.view(np.uint32))
    assert differ.size == 0, [(hex(int(b)), hex(int(g)), hex(int(e))) for b, g, e in zip(
        bits[differ[:5]], got.view(np.uint32)[differ[:5]], expected.view(np.uint32)[differ[:5]])]


def half_values_as_bits() -> np.ndarray:
    """Every float16 value (NaNs and infinities included) as float32 bits."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
        .astype(np.float32).view(np.uint32)


def test_every_half_value_comes_back_unchanged():
    check(half_values_as_bits())


def test_every_tie_between_neighbours_and_the_floats_beside_it():
    halves = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    above = np.arange(1, 0x7C01, dtype=np.uint16).view(np.float16).astype(np.float64)
    ties = ((halves + above) / 2).astype(np.float32)  # exact: a float16 midpoint fits float32
    assert np.array_equal(ties.astype(np.float64), (halves + above) / 2)
    bits = ties.view(np.uint32)
    for step in (-2, -1, 0, 1, 2):
        b = (bits.astype(np.int64) + step).astype(np.uint32)
        check(b)
        check(b | np.uint32(0x80000000))  # and negative


@pytest.mark.parametrize("edge", [MIN_NORMAL_BITS, LARGE_BITS, 0x477FF000, 0x7F800000, 0])
def test_the_edges_of_the_three_paths(edge):
    around = np.arange(-4096, 4097, dtype=np.int64) + edge
    b = around[(around >= 0) & (around < 1 << 31)].astype(np.uint32)
    check(b)
    check(b | np.uint32(0x80000000))


def test_random_float32_bits():
    rng = np.random.default_rng(0)
    check(rng.integers(0, 1 << 32, size=1 << 21, dtype=np.uint64).astype(np.uint32))


def test_strided_and_shaped_arrays_in_place():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 7, 10)) * np.float32(3e-5)).astype(np.float32)  # subnormals too
    expected, before = numpy_round_trip(x), x.copy()
    view = x[:, ::2, 1::3]  # not contiguous: rounded where it lies
    assert round_to_half(view) is view
    assert np.array_equal(view.view(np.uint32), expected[:, ::2, 1::3].view(np.uint32))
    untouched = np.ones(x.shape, bool)
    untouched[:, ::2, 1::3] = False
    assert np.array_equal(x[untouched].view(np.uint32), before[untouched].view(np.uint32))


def test_only_float32_is_taken():
    with pytest.raises(TypeError, match="float32"):
        round_to_half(np.zeros(3, np.float64))


def test_widening_every_half_value_is_numpys_own():
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    expected = halves.astype(np.float32).view(np.uint32)
    assert np.array_equal(widen_half(halves).view(np.uint32), expected)  # NaN payloads too
    grid = halves.reshape(256, 256)[::3, 1::2]  # strided, two dims
    assert np.array_equal(widen(grid).view(np.uint32), grid.astype(np.float32).view(np.uint32))
    assert widen(np.float16(2.5)).shape == () and float(widen(np.float16(2.5))) == 2.5
    b = np.float32([1.5, -3.0]).astype(ml_dtypes.bfloat16)  # other narrow dtypes: numpy's astype
    assert widen(b).dtype == np.float32 and widen(b).tolist() == [1.5, -3.0]
    with pytest.raises(TypeError, match="float16"):
        widen_half(np.zeros(2, np.float32))


def test_work_arrays_are_kept_for_chunks_only(monkeypatch):
    """A chunk-sized call reuses this thread's work arrays; a larger one does not keep its own."""
    monkeypatch.setattr(rounding, "KEPT_ELEMS", 1000)
    monkeypatch.setattr(rounding._WORK, "arrays", None, raising=False)  # none kept yet
    x = np.linspace(-3, 3, 999, dtype=np.float32)
    expected = numpy_round_trip(x)
    round_to_half(x)
    kept = rounding._WORK.arrays
    assert np.array_equal(x.view(np.uint32), expected.view(np.uint32))
    big = np.linspace(-3, 3, 5000, dtype=np.float32)
    big_expected = numpy_round_trip(big)
    round_to_half(big)
    assert rounding._WORK.arrays is kept and kept[0].size == 999
    assert np.array_equal(big.view(np.uint32), big_expected.view(np.uint32))
