"""Rounding float32 registers to float16 in place, bit for bit what
``x.astype(np.float16).astype(np.float32)`` gives, at a fifth of its cost; and float16 inputs
widened to float32 registers by a table (:func:`widen`, half the cost of ``astype``).

A float16 instruction of a fused body is computed in float32 and rounded to float16 (one rounding,
as the NPU's float16 arithmetic). numpy converts float32 to float16 one element at a time
(~4 ns an element on the AVX-512 VM, most of a float16 body's time); here the rounding is a
handful of whole-array integer operations on the float32 bits (~0.7 ns):

* a float16 normal (2**-14 <= |v| < 65504): round to nearest even at mantissa bit 13, by adding
  ``0xFFF`` plus the bit that will become the last one kept, then clearing the 13 low bits;
* a float16 subnormal or zero (|v| < 2**-14): ``(|v| + 0.75) - 0.75`` in float32 rounds |v| to a
  multiple of 2**-24 (the ulp of [0.5, 1)), ties to even because 0.75 is an even multiple; the
  sign is put back;
* |v| >= 65504, infinities and NaN (rare): numpy's own conversion, so overflow to infinity and
  NaN payloads come out exactly as its round trip gives them.

Tested against numpy's round trip on every float16 value, the midpoints between neighbours and
a step either side of them, and random float32 bits (tests/test_rounding.py).

    >>> import numpy as np
    >>> x = np.float32([1 + 2 ** -11, 1 + 3 * 2 ** -11, 3e-8, -65519.0, 1e-45])
    >>> round_to_half(x.copy()).tolist() == x.astype(np.float16).astype(np.float32).tolist()
    True
"""
from __future__ import annotations

import threading

import numpy as np

MIN_NORMAL_BITS = 0x38800000  # 2**-14, float16's smallest normal, as float32 bits
LARGE_BITS = 0x477FE000       # 65504, float16's largest finite value: from here on, numpy's way
SUBNORMAL_SHIFT = np.float32(0.75)
_WORK = threading.local()
KEPT_ELEMS = 1 << 20  # work arrays up to this size are kept per thread (6 MiB)


def _work(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's work arrays (uint32, two bool) of ``shape``, kept from call to call up to
    :data:`KEPT_ELEMS` elements (a fused body's chunks): a fresh one per call would be an mmap
    and its page faults in a process with glibc's default malloc settings. Larger (a whole
    tensor) get fresh ones, so that no thread holds 6 bytes an element of its largest call."""
    n = int(np.prod(shape))
    if n > KEPT_ELEMS:
        return np.empty(shape, np.uint32), np.empty(shape, np.bool_), np.empty(shape, np.bool_)
    flat = getattr(_WORK, "arrays", None)
    if flat is None or flat[0].size < n:
        flat = _WORK.arrays = (np.empty(n, np.uint32), np.empty(n, np.bool_), np.empty(n, np.bool_))
    return tuple(a[:n].reshape(shape) for a in flat)  # type: ignore[return-value]


def round_to_half(x: np.ndarray) -> np.ndarray:
    """Round the float32 array ``x`` (contiguous or not) to float16 values in place; returns it."""
    if x.dtype != np.float32:
        raise TypeError(f"round_to_half takes float32, got {x.dtype}")
    bits = x.view(np.uint32)
    word, small, large = _work(x.shape)
    np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=word)
    np.less(word, MIN_NORMAL_BITS, out=small)
    np.greater_equal(word, LARGE_BITS, out=large)
    tiny = x[small] if small.any() else None
    huge = x[large] if large.any() else None
    carry = np.right_shift(bits, 13, out=word)
    carry &= np.uint32(1)
    carry += np.uint32(0xFFF)
    bits += carry
    bits &= np.uint32(0xFFFFE000)
    if tiny is not None:
        x[small] = np.copysign((np.abs(tiny) + SUBNORMAL_SHIFT) - SUBNORMAL_SHIFT, tiny)
    if huge is not None:
        x[large] = huge.astype(np.float16).astype(np.float32)
    return x


def widen_half(h: np.ndarray) -> np.ndarray:
    """``h.astype(np.float32)`` for a float16 array, by a 65536-entry table of numpy's own
    conversions (the same bits, NaN payloads included; ~1.0 against ~1.7 ns an element).

        >>> widen_half(np.float16([1.5, -0.0, 6e-8])).tolist() == [1.5, -0.0, float(np.float16(6e-8))]
        True
    """
    if h.dtype != np.float16:
        raise TypeError(f"widen_half takes float16, got {h.dtype}")
    return np.take(_widening_table(), h.view(np.uint16))


def widen(x: np.ndarray) -> np.ndarray:
    """A float16 or bfloat16 array as a new float32 one: float16 by :func:`widen_half` (arrays
    of rank >= 1), the rest by ``astype``.

        >>> widen(np.float16([0.5, 2])).dtype, widen(np.float16(3)).tolist()
        (dtype('float32'), 3.0)
    """
    if x.dtype == np.float16 and x.ndim:
        return widen_half(x)
    return x.astype(np.float32)


def _widening_table() -> np.ndarray:
    table = getattr(_widening_table, "table", None)
    if table is None:
        table = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
            .astype(np.float32)
        _widening_table.table = table  # type: ignore[attr-defined]
    return table


__all__ = ["round_to_half", "widen", "widen_half"]
