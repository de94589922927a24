"""aclnnBatchNormElemt on 2-D and 3-D inputs large enough for the numpy interpreter to cut the
fused kernel into chunks (BatchNorm1d shapes): the op_api reshapes them to the kernel's 4-D
layout, and every backend gives the float64 formula's values and the numpy backend's bits,
contiguous, strided or in place (the output is the input). (Until this test, such an input failed at level 2 with a reshape error.)"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import backends as B

import opgraph
from backends import native
from backends.numpy_backend import NumpyExecutable
from opgraph import ops
from opgraph.aclnn import aclnnBatchNormElemt, aclnnBatchNormElemtGetWorkspaceSize

BACKENDS = ["numpy"] + (["native"] if native.available() else [])


@pytest.mark.parametrize("layout", ["contiguous", "strided", "in-place"])
@pytest.mark.parametrize("shape", [(160000, 4), (8, 16, 5000)], ids=["rank2", "rank3"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_large_rank2_and_rank3_inputs(shape, dtype, layout):
    rng = np.random.default_rng(1)
    C = shape[1]
    x = rng.standard_normal(shape[:-1] + (2 * shape[-1],)).astype(dtype)
    x = x[..., ::2] if layout == "strided" else np.ascontiguousarray(x[..., :shape[-1]])
    x0 = x.copy()
    assert x.flags.c_contiguous == (layout != "strided")
    w, b, mean = (rng.uniform(-2, 2, C).astype(dtype) for _ in range(3))
    invstd = rng.uniform(0.5, 2, C).astype(dtype)
    per_channel = [v.astype(np.float64).reshape((1, C) + (1,) * (len(shape) - 2)) for v in (w, b, mean, invstd)]
    w64, b64, m64, i64 = per_channel
    want = (x0.astype(np.float64) - m64) * i64 * w64 + b64
    got = {}
    for be in BACKENDS:
        xb = x0.copy() if layout == "in-place" else x  # in place: the output is the input
        with opgraph.use_backend(be), opgraph.platform("Ascend950"):
            got[be] = ops.batch_norm_elemt(xb, w, b, mean, invstd, 1e-5,
                                           out=xb if layout == "in-place" else None)
        assert layout == "in-place" or np.array_equal(x, x0)  # the input untouched
        tol = 1e-5 if dtype == np.float32 else 2e-2
        assert got[be].shape == shape
        assert np.allclose(got[be].astype(np.float64), want, rtol=tol, atol=tol), be
    for be in BACKENDS[1:]:
        assert np.array_equal(got[be].view(np.uint16 if dtype != np.float32 else np.uint32),
                              got["numpy"].view(np.uint16 if dtype != np.float32 else np.uint32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_kernel_computes_into_the_callers_output(backend, monkeypatch):
    """The fused kernel's result is placed in the caller's output through the reshape back to
    [N,C,L]: its lowering computes there (``takes_out``), with no temporary to copy over."""

    def no_copy(*args):
        raise AssertionError("a temporary was copied into its slot")
    monkeypatch.setattr(NumpyExecutable, "_place", no_copy)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 16, 500)).astype(np.float32)
    w, b, mean, invstd = (opgraph.tensor(rng.uniform(0.5, 2, 16).astype(np.float32)) for _ in range(4))
    out = np.full_like(x, np.nan)
    with opgraph.use_backend(backend):
        _, _, ex = aclnnBatchNormElemtGetWorkspaceSize(opgraph.tensor(x), w, b, mean, invstd, 1e-5,
                                                       opgraph.tensor(out))
        assert aclnnBatchNormElemt(None, 0, ex) == 0
    exe = ex.program.executable(B.get(backend))
    assert [slot.user for slot in exe.into.values()] == ["output"]
    m, i, ww, bb = (t.numpy().reshape(1, 16, 1).astype(np.float64) for t in (mean, invstd, w, b))
    assert np.allclose(out, (x - m) * i * ww + bb, rtol=1e-5, atol=1e-5)
