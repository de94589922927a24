"""A new batch size on the native backend reuses the kernel and prologue table built for the same
body at another size (``launch.Launch.resized``) and only lays the loop out anew — when the sizes the
body and its per-channel part fix, and the per-channel inputs' layouts, are unchanged. Results
are checked against float32 numpy written out here and against the numpy backend."""
from __future__ import annotations

import numpy as np
import pytest

import opgraph
import reference as R
from backends import native
from backends.native import launch
from l0ops.interpreter import Hoisted
from l0ops.primitives import FusedAttrs, Instr
from opgraph.core.dtypes import DataType as D

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])
C, W, K = 3, 4, 6
BASE = FusedAttrs(shape=(1, C, W), result="t4", out_dtype=D.FLOAT, body=(
    Instr(op="sum", args=("in2",), dtype=D.FLOAT),
    Instr(op="div", args=("in0", "t0"), dtype=D.FLOAT),
    Instr(op="view", args=("t1",), dtype=D.FLOAT, shape=(1, C, 1)),
    Instr(op="sub", args=("in1", "t2"), dtype=D.FLOAT),
    Instr(op="mul", args=("t3", "t3"), dtype=D.FLOAT),
))


def operands(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(C).astype(np.float32),
            rng.standard_normal((n, C, W)).astype(np.float32),
            rng.integers(1, 9, K).astype(np.float32)]  # whole numbers: any summing order is exact


def expected(ins: list[np.ndarray]) -> np.ndarray:
    d = ins[1] - (ins[0] / np.float32(ins[2].sum(dtype=np.float64)))[None, :, None]
    return d * d


def launch_and_result(n: int, ins: list[np.ndarray]):
    a = BASE.model_copy(update={"shape": (n, C, W)})  # the body object kept, as the cache does
    out = native.run_fused_native(a, ins)
    return launch.launch_for(a, ins, out), out


@pytest.mark.parametrize("n", [5, 7, 64, 4099])
def test_a_new_batch_size_reuses_the_kernel_and_keeps_the_bits(n):
    first, _ = launch_and_result(2, operands(2))
    ins = operands(n, seed=n)
    ln, out = launch_and_result(n, ins)
    assert ln is not first and ln.fn is first.fn and ln.tab is first.tab
    assert np.array_equal(out.view(np.uint32), expected(ins).view(np.uint32))


def test_a_per_channel_input_with_another_layout_gets_its_own_prologue():
    first, _ = launch_and_result(2, operands(2))
    ins = operands(5, seed=3)
    ins[0] = np.repeat(ins[0], 2)[::2]  # the same values, strided
    ln, out = launch_and_result(5, ins)
    assert ln.tab is not first.tab
    assert np.array_equal(out.view(np.uint32), expected(ins).view(np.uint32))


@pytest.mark.parametrize("dtype", [R.F32, R.F16, R.BF16], ids=["f32", "f16", "bf16"])
def test_new_batch_sizes_of_the_op_api_match_the_numpy_backend(dtype):
    for n in (3, 5, 9, 130):
        case = R.make_case((n, 2, 8), dtype, seed=n)
        with opgraph.use_backend("numpy"), opgraph.opt_level(2):
            want = R.compute(case)
        with opgraph.use_backend("native"), opgraph.opt_level(2):
            got = R.compute(case)
        assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)), n


def loop_of(ln) -> tuple:
    """What a launch's kernel call and overlap check take from its layout."""
    return (ln.ndim, list(ln.shape), list(ln.strides), ln.extents, ln.out_extent, ln.same)


@pytest.mark.parametrize("first_n, n", [(2, 2), (2, 5), (2, 64), (1, 1)])
@pytest.mark.parametrize("layout", ["row-major", "strided input", "strided output"])
def test_a_resized_launch_lays_its_loop_out_as_a_fresh_one_would(first_n, n, layout):
    first, _ = launch_and_result(first_n, operands(first_n))
    assert first.groups is not None  # row-major operands: resized() reuses the merged dims
    ins = operands(n, seed=n)
    out = np.zeros((n, C, W), np.float32)
    if layout == "strided input":
        ins[1] = np.repeat(ins[1], 2, axis=2)[:, :, ::2]
    elif layout == "strided output":
        out = np.zeros((n, C, 2 * W), np.float32)[:, :, ::2]
    a = BASE.model_copy(update={"shape": (n, C, W)})
    ln = first.resized(a, ins, out)
    fresh = launch.Launch(a, Hoisted(a, ins), ins, out)
    assert ln is not None and loop_of(ln) == loop_of(fresh)
    assert (ln.groups is not None) == (layout == "row-major")
    native.run_fused_native(a, ins, out)
    assert np.array_equal(out.view(np.uint32), expected(ins).view(np.uint32))
