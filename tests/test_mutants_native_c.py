"""What a mutation audit of the native backend's C text and its renderers (``compiler.py``,
``c_text.py``, ``render.py``, ``simd.py``, ``reduce_c.py``, ``pair_c.py``, ``reduce.py``,
``team.py``) found unpinned: the instruction-set branches of the kernels' preamble that this
machine's ``-march=native`` does not take (AVX2 + F16C, scalar C) run and give the numpy
reference's bits, and the exact boundaries of the C kernels' work splits and tails give the
reference's bits too. Every expected value comes from the numpy reference (``run_fused``,
``FusedReduce.compute``) or from hand values."""
from __future__ import annotations

import platform

import ml_dtypes
import numpy as np
import pytest

from backends import native
from backends.native import compiler, launch
from backends.native.launch import run_fused_native
from backends.native.reduce_run import run_fused_reduce_native
from l0ops.fused_reduce import FusedReduce
from l0ops.interpreter import run_fused
from l0ops.primitives import FusedAttrs, Instr
from opgraph.core.dtypes import DataType as D
from test_native_reduce import stats_body

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])
F32, F16, BF16 = D.FLOAT, D.FLOAT16, D.BF16
NP = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16}


def same_bits(got, want) -> bool:
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    return got.dtype == want.dtype and got.shape == want.shape and \
        np.array_equal(got.view(np.uint8), want.view(np.uint8))


def affine(shape, out: D) -> FusedAttrs:
    """(f32(x) − m)·s cast to ``out``: ``in0`` full-size, ``in1`` and ``in2`` per channel."""
    body = (Instr(op="cast", args=("in0",), dtype=F32), Instr(op="sub", args=("t0", "in1"), dtype=F32),
            Instr(op="mul", args=("t1", "in2"), dtype=F32), Instr(op="cast", args=("t2",), dtype=out))
    return FusedAttrs(shape=tuple(shape), body=body, result="t3", out_dtype=out)


def affine_inputs(shape, dt: D, channel: int = 1, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(NP[dt])
    cs = tuple(n if d == channel else 1 for d, n in enumerate(shape))
    m, s = (rng.standard_normal(cs).astype(np.float32) for _ in range(2))
    return [x, m, s]


def check_elementwise(a: FusedAttrs, inputs) -> None:
    got = run_fused_native(a, inputs)
    assert same_bits(got, run_fused(a, inputs))


def check_reduce(a, inputs) -> None:
    got = run_fused_reduce_native(a, inputs)
    want = FusedReduce.compute(inputs, a)
    assert len(got) == len(want) and all(same_bits(g, w) for g, w in zip(got, want))


# --- the preamble's other instruction-set branches ---------------------------------------------

def _gcc_or_clang() -> list[str]:
    cc = compiler.find_compiler()[0]
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the -mno-* flags are x86 GCC/clang's")
    version = compiler.run(cc, ["--version"]).stdout
    if "Free Software Foundation" not in version and "clang" not in version:
        pytest.skip("the -mno-* flags are GCC's and clang's")
    return list(cc)


@pytest.mark.parametrize("flag, isa", [("-mno-avx512f", "AVX2 + F16C, 8 float lanes"),
                                       ("-mno-avx", "scalar C")])
def test_other_instruction_sets_give_the_reference_bits(flag, isa, monkeypatch):
    """The kernels' preamble has an AVX2 + F16C and a scalar branch besides AVX-512 (their own
    fold64, fold_cols, bf16 stores, lane splits); built with ``$CC -mno-avx512f`` or
    ``-mno-avx`` (the explicit flag outranks ``-march=native``) they run here too: element-wise
    bf16/f16 bodies over short rows (split lanes), rows of at most a vector (the table), rows
    of pairs of vectors and a 2-d channels-innermost input, and reductions channel-major and
    channels_last, each with the reference's bits."""
    cc = _gcc_or_clang()
    monkeypatch.setenv("CC", " ".join([*cc, flag]))
    native_isa = launch.vector_isa()
    if native_isa != isa:
        pytest.skip(f"the compiler does not target {isa} here ({native_isa})")
    for dt in (BF16, F16):
        for shape in [(3, 5, 49), (3, 4, 2, 3), (2, 3, 1000)]:
            check_elementwise(affine(shape, dt), affine_inputs(shape, dt))
        check_elementwise(affine((64, 20), dt), affine_inputs((64, 20), dt))
    rng = np.random.default_rng(3)
    for shape in [(4, 3, 5, 6), (2, 70, 9, 7)]:
        x = rng.standard_normal(shape).astype(np.float32)
        check_reduce(stats_body(shape), [x])
    xc = rng.standard_normal((2, 9, 7, 70)).astype(np.float32).transpose(0, 3, 1, 2)
    check_reduce(stats_body(xc.shape), [xc])


def test_a_kernel_loaded_under_another_cc_is_that_compilers(monkeypatch):
    """The in-process memo of loaded kernels is keyed by ``$CC`` too (as the disk cache is by
    the compiler): after ``$CC`` changes, a source loaded before is built by the new compiler,
    not served as the old one's (it was keyed by the source and cache directory only)."""
    cc = _gcc_or_clang()
    before = launch.vector_isa()
    if before == "scalar C":
        pytest.skip("the plain compiler already builds scalar C")
    monkeypatch.setenv("CC", " ".join([*cc, "-mno-avx"]))
    assert launch.vector_isa() == "scalar C"
    monkeypatch.undo()
    assert launch.vector_isa() == before
