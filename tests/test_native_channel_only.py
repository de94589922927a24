"""Inputs whose every dim but C is 1 ([1, 64, 1], [1, 5], ...): their per-channel terms already
fill the iteration space, and were taken for per-element work, so the native backend left the
fused kernels of aclnnBatchNormElemt and aclnnBatchNormElemtBackward to numpy ("view per
element"). In a space of one line nothing is large, so they are hoisted now: native renders the
kernels in C, with numpy's bits; numpy's chunked run of a large C keeps level 0's bits."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import opgraph
from backends import native
from opgraph.cli import main
from opgraph.ops import batch_norm_elemt, batch_norm_elemt_backward

import reference as R

SHAPES = [(1, 64, 1), (1, 5), (1, 7, 1, 1), (1, 3, 1, 1, 1)]
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def arrays(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    C = shape[1]
    data = [rng.standard_normal(shape).astype(dtype) for _ in range(2)]
    per_channel = [rng.standard_normal(C).astype(np.float32) for _ in range(5)]
    per_channel[1] = np.abs(per_channel[1]) + 0.5  # invstd
    return data, per_channel


def both_op_apis(shape, dtype) -> list[np.ndarray]:
    (dy, x), (mean, invstd, w, b, sdy) = arrays(shape, dtype)
    return [batch_norm_elemt(x, w, b, mean, invstd, 1e-5),
            batch_norm_elemt_backward(dy, x, mean, invstd, w, sdy, sdy * 0.5,
                                      np.full(2, 3, np.int32))]


@pytest.mark.skipif(not native.available(), reason=native.availability()[1])
@pytest.mark.parametrize("platform", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_native_equals_numpy(shape, dname, platform):
    with opgraph.platform(platform):
        with opgraph.use_backend("numpy"):
            want = both_op_apis(shape, DTYPES[dname])
        with opgraph.use_backend("native"):
            got = both_op_apis(shape, DTYPES[dname])
    for g, w in zip(got, want):
        R.assert_bits_equal(g, w)


@pytest.mark.skipif(not native.available(), reason=native.availability()[1])
@pytest.mark.parametrize("op", ["aclnnBatchNormElemt", "aclnnBatchNormElemtBackward"])
def test_the_kernel_is_rendered_in_c(capsys, op):
    assert main(["emit-c", op, "--shape", "1,64,1"]) == 0
    out = capsys.readouterr().out
    assert "not rendered" not in out and "#include <stdint.h>" in out


def test_numpy_chunks_of_a_large_channel_count_keep_level_0_bits():
    shape = (1, 300_000, 1)  # more elements than one chunk: the hoisted terms are sliced
    results = {}
    for level in (0, 2):
        with opgraph.use_backend("numpy"), opgraph.opt_level(level):
            results[level] = both_op_apis(shape, np.float32)
    for a, b in zip(results[0], results[2]):
        R.assert_bits_equal(b, a)
