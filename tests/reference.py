"""An independent reference for aclnnBatchNormElemtBackward, used only by the tests.

Nothing here imports ``l0ops`` or ``backends``: the numerics are re-derived from the vendor
description (reference §5.2/§5.5, design §4) step by step:

* promote type: FP16 only when all seven float inputs are FP16 (a NULL weight is a FLOAT ones
  tensor), else FP32;
* ``total`` = Σ counter (all elements, as float32), ``meanDy = f32(sumDy) / total`` and
  ``meanDyXmu = f32(sumDyXmu) / total`` in float32, broadcast as (1, C, 1, …), then cast to the
  promote type;
* DAV_2201 (Ascend910B / 910_93, and Ascend910): eight vector steps in the promote type, fp16 with
  *native* numpy float16 arithmetic;
* DAV_3510 (Ascend950): everything in float32 with the regbase order, rounded back to the promote
  type;
* finally a cast (round to nearest even) to gradInput's dtype.

The second half of the file is test harness: building argument sets with known layouts and
calling the op_api. It never computes an expected value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import ml_dtypes
import numpy as np

import opgraph
from opgraph import aclnn

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
BF16 = np.dtype(ml_dtypes.bfloat16)
I32 = np.dtype(np.int32)

ARCH = {"Ascend910B": 2201, "Ascend910_93": 2201, "Ascend910": 1001, "Ascend950": 3510}
NAMES = ("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter")


# --------------------------------------------------------------------------------------------
# reference numerics
# --------------------------------------------------------------------------------------------
def counter_total(counter: np.ndarray) -> np.float32:
    """Σ counter over every element, in float32. The tests only use counters whose float32 sum
    is exact (small integers or halves), so the summation order cannot matter; we check it."""
    vals = np.asarray(counter).astype(F32).astype(F64).ravel()
    total = math.fsum(vals)
    assert float(np.float32(total)) == total, "test counters must sum exactly in float32"
    return np.float32(total)


def promote(arrays) -> np.dtype:
    return F16 if all(np.dtype(a.dtype) == F16 for a in arrays) else F32


def _bshape(x: np.ndarray) -> tuple[int, ...]:
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _steps_2201(go, x, mean, invstd, weight, mdy, mdyx):
    """The eight DAV_2201 vector steps, in whatever dtype the operands have."""
    s1 = go - mdy                 # Sub(gradOut, meanDy)
    s2 = x - mean                 # Sub(input, mean)
    m = invstd * invstd           # Mul(invstd, invstd)
    m = m * mdyx                  # Mul(., meanDyXmu)
    s2 = s2 * m                   # Mul(input - mean, .)
    s1 = s1 - s2                  # Sub
    s1 = s1 * invstd              # Mul(., invstd)
    return s1 * weight            # Mul(., weight)


def _steps_3510(go, x, mean, invstd, weight, mdy, mdyx):
    sub1 = go - mdy
    sub2 = x - mean
    m1 = invstd * invstd
    m2 = mdyx * m1
    m3 = sub2 * m2
    sub3 = sub1 - m3
    w = invstd * weight
    return sub3 * w


def grad_input(gradOut, input, mean, invstd, weight, sumDy, sumDyXmu, counter, out_dtype,
               soc: str = "Ascend910B") -> np.ndarray:
    """The bit-exact expected gradInput (numpy arrays in, an array of ``out_dtype`` out)."""
    arch = ARCH[soc]
    C = input.shape[1]
    if weight is None:
        weight = np.ones(C, F32)
    seven = [gradOut, input, mean, invstd, weight, sumDy, sumDyXmu]
    T = promote(seven)
    total = counter_total(counter)
    # MeanByCounter: float32 true division, [C]
    mdy_c = np.asarray(sumDy).astype(T).astype(F32) / total
    mdyx_c = np.asarray(sumDyXmu).astype(T).astype(F32) / total
    assert mdy_c.dtype == F32 and mdyx_c.dtype == F32
    bs = _bshape(input)
    full = input.shape

    def bc(p):
        return np.broadcast_to(np.asarray(p).reshape(bs), full)

    go_t = np.asarray(gradOut).astype(T)
    x_t = np.asarray(input).astype(T)
    mean_t, inv_t, w_t = (bc(np.asarray(p).astype(T)) for p in (mean, invstd, weight))
    mdy_t = bc(mdy_c).astype(T)
    mdyx_t = bc(mdyx_c).astype(T)
    with np.errstate(all="ignore"):
        if arch in (2201, 1001):
            res = _steps_2201(go_t, x_t, mean_t, inv_t, w_t, mdy_t, mdyx_t)  # native T arithmetic
            assert res.dtype == T
        elif arch == 3510:
            ops = [a.astype(F32) for a in (go_t, x_t, mean_t, inv_t, w_t, mdy_t, mdyx_t)]
            res = _steps_3510(*ops)
            assert res.dtype == F32
            res = res.astype(T)
        else:
            raise ValueError(f"no reference kernel for {soc}")
    out_dtype = np.dtype(out_dtype)
    if res.dtype == out_dtype:
        return np.array(res)
    return res.astype(F32).astype(out_dtype)  # exact widening first, then one RNE rounding


def grad_input_f64(gradOut, input, mean, invstd, weight, sumDy, sumDyXmu, counter) -> np.ndarray:
    """The formula of reference §5.2 in float64 (an oracle, not bit-exact)."""
    C = input.shape[1]
    f = lambda a: np.asarray(a).astype(F32).astype(F64)  # noqa: E731  (bf16 -> f64 via f32)
    w = np.ones(C) if weight is None else f(weight)
    total = f(counter).sum()
    bs = _bshape(input)
    mdy, mdyx = (f(sumDy) / total).reshape(bs), (f(sumDyXmu) / total).reshape(bs)
    mu, inv, w = f(mean).reshape(bs), f(invstd).reshape(bs), w.reshape(bs)
    return ((f(gradOut) - mdy) - (f(input) - mu) * inv * inv * mdyx) * inv * w


def error_scale(gradOut, input, mean, invstd, weight, sumDy, sumDyXmu, counter) -> np.ndarray:
    """Per-element magnitude of the terms of the formula (for rounding-error bounds)."""
    C = input.shape[1]
    f = lambda a: np.abs(np.asarray(a).astype(F32).astype(F64))  # noqa: E731
    w = np.ones(C) if weight is None else f(weight)
    total = np.abs(np.asarray(counter).astype(F64).sum())
    bs = _bshape(input)
    mdy, mdyx = (f(sumDy) / total).reshape(bs), (f(sumDyXmu) / total).reshape(bs)
    mu, inv, w = f(mean).reshape(bs), f(invstd).reshape(bs), w.reshape(bs)
    return (f(gradOut) + mdy + (f(input) + mu) * inv * inv * mdyx) * inv * w


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of a float array, for bit-exact comparisons."""
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray, any_nan: bool = False) -> None:
    """Bit-exact equality; with ``any_nan``, a NaN where a NaN is expected passes whatever its
    payload (for expectations computed by other arithmetic than the kernel's)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = bits(actual), bits(expected)
    differ = a != e
    if any_nan:
        differ &= ~(np.isnan(actual.astype(np.float32)) & np.isnan(expected.astype(np.float32)))
    if differ.any():
        bad = np.argwhere(differ)
        i = tuple(bad[0])
        raise AssertionError(
            f"{len(bad)} of {a.size} elements differ; first at {i}: got {actual[i]!r} "
            f"(0x{int(a[i]):x}), expected {expected[i]!r} (0x{int(e[i]):x})")


# --------------------------------------------------------------------------------------------
# harness: argument sets, layouts, calling the op_api (no expected values here)
# --------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One argument set as numpy arrays (weight may be None)."""

    gradOut: np.ndarray
    input: np.ndarray
    mean: np.ndarray
    invstd: np.ndarray
    weight: Optional[np.ndarray]
    sumDy: np.ndarray
    sumDyXmu: np.ndarray
    counter: np.ndarray
    out_dtype: np.dtype = field(default=F32)

    def arrays(self) -> list:
        return [getattr(self, n) for n in NAMES]

    def expected(self, soc: str = "Ascend910B") -> np.ndarray:
        return grad_input(*self.arrays(), self.out_dtype, soc)

    def with_(self, **kw) -> "Case":
        return replace(self, **kw)


def _vals(rng, shape, dtype, lo, hi):
    return rng.uniform(lo, hi, size=shape).astype(F32).astype(dtype)


def make_case(shape=(2, 3, 4), dtype=F32, *, dtypes: Optional[dict] = None, out_dtype=None,
              weight: bool = True, counter_dtype=I32, counter_shape=None, seed: int = 0) -> Case:
    """Random but well-scaled arguments (no overflow in fp16): ``dtypes`` overrides per name."""
    rng = np.random.default_rng(seed)
    dt = {n: np.dtype(dtype) for n in NAMES[:-1]}
    dt.update({k: np.dtype(v) for k, v in (dtypes or {}).items()})
    C = shape[1]
    n_other = max(1, math.prod(shape) // max(C, 1))
    counter_shape = (2,) if counter_shape is None else tuple(counter_shape)
    cnt = rng.integers(1, 6, size=counter_shape)
    cnt.flat[0] += n_other
    return Case(
        gradOut=_vals(rng, shape, dt["gradOut"], -2, 2),
        input=_vals(rng, shape, dt["input"], -3, 3),
        mean=_vals(rng, (C,), dt["mean"], -1, 1),
        invstd=_vals(rng, (C,), dt["invstd"], 0.3, 2.5),
        weight=_vals(rng, (C,), dt["weight"], -2, 2) if weight else None,
        sumDy=_vals(rng, (C,), dt["sumDy"], -8, 8),
        sumDyXmu=_vals(rng, (C,), dt["sumDyXmu"], -8, 8),
        counter=cnt.astype(counter_dtype),
        out_dtype=np.dtype(out_dtype if out_dtype is not None else dt["input"]),
    )


def article_case(dtype=F32) -> Case:
    """The vendor doc's example (reference §5.2): result 0.9·x."""
    x = np.arange(8, dtype=F32).reshape(1, 2, 4).astype(dtype)
    c = lambda *v: np.array(v, F32).astype(dtype)  # noqa: E731
    return Case(x, x.copy(), c(0, 0), c(1, 1), c(1, 1), c(0, 0), c(1, 1),
                np.array([5, 5], F32), np.dtype(dtype))


def channels_last(a: np.ndarray) -> np.ndarray:
    """``a`` [N, C, H, W] laid out channels_last (C innermost in memory), the same values.

        >>> channels_last(np.zeros((2, 3, 4, 5), np.float32)).strides
        (240, 4, 60, 12)
    """
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def strided_copy(a: np.ndarray, kind: str, rng=None):
    """An opgraph.Tensor holding ``a``'s values in layout ``kind``:
    contig / perm (permuted storage) / step (every other element) / offset (offset > 0)."""
    rng = rng or np.random.default_rng(0)
    a = np.asarray(a)
    if kind == "contig":
        return opgraph.tensor(a.copy())
    if kind == "perm":
        p = rng.permutation(a.ndim)
        if a.ndim > 1 and list(p) == list(range(a.ndim)):
            p = np.roll(p, 1)
        base = np.ascontiguousarray(a.transpose(p))
        view = base.transpose(np.argsort(p))
        assert view.shape == a.shape
        return opgraph.tensor(view)
    if kind == "step":
        big = np.zeros(tuple(2 * n + 1 for n in a.shape), a.dtype)
        sl = tuple(slice(1, 1 + 2 * n, 2) for n in a.shape)
        big[sl] = a
        return opgraph.tensor(big[sl])
    if kind == "offset":
        off = int(rng.integers(1, 7))
        storage = np.zeros(a.size + off + 3, a.dtype)
        storage[off:off + a.size] = a.ravel()
        strides = []
        acc = 1
        for n in reversed(a.shape):
            strides.append(acc)
            acc *= max(n, 1)
        return opgraph.Tensor(storage, a.shape, tuple(reversed(strides)), off)
    raise ValueError(kind)


def padded_out(shape, dtype, sentinel_byte: int = 0xA5, offset: int = 3):
    """A gradInput view with gaps between elements over a sentinel-filled storage.
    Returns (tensor, storage, pristine copy of storage)."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n + 1  # one unused element after every row of every dim
    strides = tuple(reversed(strides))
    size = offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1 + 2 if math.prod(shape) else offset + 4
    raw = np.full(size * np.dtype(dtype).itemsize, sentinel_byte, np.uint8)
    storage = raw.view(dtype)
    return opgraph.Tensor(storage, shape, strides, offset), storage, storage.copy()


def to_tensors(case: Case, layouts: Optional[dict] = None, rng=None) -> list:
    """The eight input tensors (None for a NULL weight) in the given layouts."""
    layouts = layouts or {}
    out = []
    for n in NAMES:
        a = getattr(case, n)
        if a is None:
            out.append(None)
        elif n in layouts:
            out.append(strided_copy(a, layouts[n], rng))
        else:
            out.append(opgraph.tensor(a.copy()))
    return out


def run_op(inputs: list, grad_input_tensor, *, check: bool = True):
    """Phase 1 + phase 2; returns (status1, workspace size, executor, status2)."""
    st, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*inputs, grad_input_tensor)
    if st != 0:
        if check:
            raise AssertionError(f"phase 1 failed: {aclnn.aclGetRecentErrMsg()}")
        return st, ws, ex, None
    st2 = aclnn.aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex)
    if check and st2 != 0:
        raise AssertionError(f"phase 2 failed: {aclnn.aclGetRecentErrMsg()}")
    return st, ws, ex, st2


def compute(case: Case, layouts: Optional[dict] = None) -> np.ndarray:
    """Run the op_api on ``case`` with a fresh contiguous gradInput; return gradInput."""
    out = np.zeros(case.input.shape, case.out_dtype)
    run_op(to_tensors(case, layouts), opgraph.tensor(out))
    return out
