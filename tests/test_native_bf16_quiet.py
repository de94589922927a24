"""The native kernels' bf16 rounding without the NaN test (``render.quiet_bf16``): taken only in
rows whose per-channel scalars hold no NaN with low payload bits, and bit-identical to numpy
both where it is taken and where such a NaN sends the row to the tested rounding."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import backends
import opgraph
from backends import native
from backends.native import render
from l0ops.interpreter import Hoisted
from l0ops.primitives import FusedAttrs, Instr
from opgraph.core.dtypes import DataType as D

BF16 = ml_dtypes.bfloat16
# f32 NaNs whose low half is not zero: adding the rounding bias to 0xFFFFFFFF or 0x7FFF8000
# carries into the sign bit (a NaN would come out as a zero); 0x7FC00001 only changes the payload
DIRTY_NANS = (0xFFFFFFFF, 0x7FFF8000, 0x7FC00001)


def _plan(big: D, mid: D) -> render.Plan:
    """(in0 - in1) computed in ``mid``, cast to bf16, plus in0 cast to bf16: in0 full-size of
    dtype ``big``, in1 a float32 per-channel scalar."""
    body = (Instr(op="cast", args=("in0",), dtype=mid),
            Instr(op="cast", args=("in1",), dtype=mid),
            Instr(op="sub", args=("t0", "t1"), dtype=mid),
            Instr(op="cast", args=("t2",), dtype=D.BF16),
            Instr(op="cast", args=("in0",), dtype=D.BF16),
            Instr(op="add", args=("t3", "t4"), dtype=D.BF16))
    a = FusedAttrs(shape=(2, 8), body=body, result="t5", out_dtype=D.BF16)
    return render.plan(a, Hoisted(a, [np.ones((2, 8), big.np), np.ones((2, 1), np.float32)]))


def _quiet(p: render.Plan) -> set[str]:
    return {p.live[k][0] for k in render.quiet_bf16(p)}


def test_which_roundings_skip_the_nan_test():
    p = _plan(D.BF16, D.FLOAT)
    # bf16 arithmetic and a cast of an arithmetic result; not a cast of a load (t4), which may
    # hold a signalling NaN, nor f32 instructions (no rounding)
    assert _quiet(p) == {"t3", "t5"}
    src = render.render(p)
    assert "opg_v_rnd_bf16_q(v_t2)" in src and "quiet_row = !(opg_low_nan(h1))" in src
    assert _quiet(_plan(D.BF16, D.BF16)) == {"t2", "t3", "t5"}  # t0: a cast of a load
    assert _quiet(_plan(D.FLOAT16, D.FLOAT)) == set()  # f16 NaNs have payload bits in the low half
    assert _quiet(_plan(D.FLOAT, D.FLOAT)) == set()
    assert _quiet(_plan(D.BF16, D.FLOAT16)) == set()
    assert "quiet_row" not in render.render(_plan(D.FLOAT, D.FLOAT))


@pytest.mark.parametrize("inner", [64, render.STREAM_BYTES // 2 // 8 + 40], ids=["rows", "streamed"])
def test_nan_payloads_in_per_channel_scalars_keep_their_rows_exact(inner):
    """aclnnBatchNormElemtBackward on Ascend950 (bf16 data, f32 per-channel tensors, one bf16
    rounding at the end): channels whose mean is a NaN with low payload bits must come out NaN
    wherever numpy gives NaN; the other channels take the untested rounding and match bit by
    bit. ``streamed``: an output large enough for the non-temporal store loop."""
    rng = np.random.default_rng(3)
    C = 4 + len(DIRTY_NANS)
    grad = rng.standard_normal((2, C, inner), np.float32).astype(BF16)
    inp = rng.standard_normal((2, C, inner), np.float32).astype(BF16)
    mean = rng.standard_normal(C, np.float32)
    mean[:len(DIRTY_NANS)] = np.array(DIRTY_NANS, np.uint32).view(np.float32)
    mean[len(DIRTY_NANS)] = np.nan  # a NaN with a clean low half: the untested rounding
    invstd, weight, sum_dy, sum_dy_xmu = (rng.uniform(0.5, 2, C).astype(np.float32) for _ in range(4))
    counter = np.array([2 * inner], np.int32)
    outs = []
    backends.get("native").fallbacks.clear()
    for name in ("numpy", "native"):
        with opgraph.platform("Ascend950"), opgraph.opt_level(2), opgraph.use_backend(name):
            outs.append(opgraph.ops.batch_norm_elemt_backward(
                grad, inp, mean, invstd, weight, sum_dy, sum_dy_xmu, counter))
    assert not backends.get("native").fallbacks  # the kernel ran in C
    ref, got = (o.astype(np.float32) for o in outs)
    nan = np.isnan(ref)
    assert nan[:, :len(DIRTY_NANS) + 1].all() and not nan[:, len(DIRTY_NANS) + 1:].any()
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(outs[0].view(np.uint16)[~nan], outs[1].view(np.uint16)[~nan])


def test_the_untested_rounding_is_taken_for_bf16_rows():
    """The quiet variant is what the 950's bf16 element-wise kernels compile to."""
    x = np.ones((2, 3, 16), BF16)
    c = np.ones(3, np.float32)
    with opgraph.platform("Ascend950"), opgraph.opt_level(2):
        ex = opgraph.aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
            *map(opgraph.tensor, (x, x, c, c, c, c, c, np.int32([2]), np.empty_like(x))))[2]
    fused = [n for n in ex.program.compiled.nodes if n.op == "FusedElementwise"]
    assert fused and all("opg_v_rnd_bf16_q" in native.emit_c(n) for n in fused)
