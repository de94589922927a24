"""The native backend: bit-identical to the numpy backend on every layout / dtype / platform,
kernels cached on disk, clear errors without a compiler or on a compile failure."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backends
import opgraph
from opgraph import ops
from opgraph.cli import main
import reference as R
from backends import native
from native_limits import reduce_limits_at
from backends.native import build, launch, team
from l0ops.interpreter import run_fused
from l0ops.primitives import FusedAttrs, Instr
from opgraph.core.dtypes import DataType as D
from opgraph.core.ir import Graph, TensorType

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])

SOCS = ("Ascend910B", "Ascend950")
CHANNEL_F32 = {n: R.F32 for n in ("mean", "invstd", "weight", "sumDy", "sumDyXmu")}
CONFIGS = {
    "f32": dict(dtype=R.F32),
    "f16": dict(dtype=R.F16),
    "bf16": dict(dtype=R.BF16),
    "mixed": dict(dtype=R.F16, dtypes=CHANNEL_F32),
    "f32-to-f16": dict(dtype=R.F32, out_dtype=R.F16),
    "f16-null-weight": dict(dtype=R.F16, weight=False),
    "bf16-null-weight": dict(dtype=R.BF16, weight=False),
}


def both(case: R.Case, soc: str, layouts=None, out_factory=None):
    """gradInput from the numpy and the native backend at level 2 (plus the native fallbacks)."""
    results = []
    for name in ("numpy", "native"):
        with opgraph.platform(soc), opgraph.opt_level(2), opgraph.use_backend(name):
            if out_factory is None:
                results.append(R.compute(case, layouts))
            else:
                t, storage, _ = out_factory()
                R.run_op(R.to_tensors(case, layouts), t)
                results.append(storage)
    return results


@pytest.fixture(autouse=True)
def kernels_of_any_size(monkeypatch):
    """Run even tiny kernels in C, so small test shapes test the C code (the reduction passes
    too, where the serial call would take them)."""
    reduce_limits_at(monkeypatch, 0)


@pytest.fixture
def no_fallback():
    b = backends.get("native")
    b.fallbacks.clear()
    yield
    assert not b.fallbacks, dict(b.fallbacks)


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_bit_identical_to_numpy(config, soc, no_fallback):
    case = R.make_case((3, 5, 4, 7), **CONFIGS[config], seed=1)
    expected, got = both(case, soc)
    R.assert_bits_equal(got, expected)
    R.assert_bits_equal(got, case.expected(soc))


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 2, 3, 4)], ids=["rank2", "rank5"])
@pytest.mark.parametrize("dtype", [R.F32, R.F16, R.BF16], ids=["f32", "f16", "bf16"])
def test_ranks(shape, dtype, soc, no_fallback):
    case = R.make_case(shape, dtype, seed=2)
    expected, got = both(case, soc)
    R.assert_bits_equal(got, expected)


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("config", ["f32", "f16", "bf16", "mixed"])
def test_strided_inputs_and_output_view(config, soc, no_fallback):
    case = R.make_case((3, 4, 5, 6), **CONFIGS[config], seed=3)
    layouts = {"gradOut": "perm", "input": "step", "mean": "offset", "invstd": "step",
               "weight": "perm", "sumDy": "offset"}
    shape = case.input.shape
    expected, got = both(case, soc, layouts, lambda: R.padded_out(shape, case.out_dtype))
    _, pristine_storage, pristine = R.padded_out(shape, case.out_dtype)
    R.assert_bits_equal(got, expected)  # the whole storage: gaps keep the sentinel
    assert not np.array_equal(R.bits(got), R.bits(pristine)), "nothing was written"
    view, _, _ = R.padded_out(shape, case.out_dtype)
    mask = np.ones(got.shape, bool)
    idx = np.lib.stride_tricks.as_strided(
        np.arange(got.size)[view.offset:], shape=shape,
        strides=tuple(s * 8 for s in view.strides))
    mask[idx.ravel()] = False
    assert np.array_equal(R.bits(got)[mask], R.bits(pristine)[mask])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=4).map(tuple),
       dtype=st.sampled_from([R.F32, R.F16, R.BF16]),
       out=st.sampled_from([None, R.F32, R.F16, R.BF16]),
       weight=st.booleans(), soc=st.sampled_from(SOCS),
       layout=st.sampled_from(["contig", "perm", "step"]), seed=st.integers(0, 2**16))
def test_property_matches_numpy(shape, dtype, out, weight, soc, layout, seed):
    case = R.make_case(shape, dtype, out_dtype=out, weight=weight, seed=seed)
    expected, got = both(case, soc, {"gradOut": layout, "input": layout})
    R.assert_bits_equal(got, expected)


def _cast_attrs(shape, to: D) -> FusedAttrs:
    return FusedAttrs(shape=shape, body=(Instr(op="cast", args=("in0",), dtype=to),), result="t0",
                      out_dtype=to)


@pytest.mark.parametrize("src,dst", [(D.FLOAT16, D.FLOAT), (D.BF16, D.FLOAT),
                                     (D.FLOAT, D.FLOAT16), (D.FLOAT, D.BF16)])
def test_conversions_exhaustive(src, dst):
    """Every f16/bf16 pattern widens exactly; float → f16/bf16 rounds like numpy (RNE), including
    subnormals, overflow to inf and every tie near the half grid."""
    h = np.arange(1 << 16, dtype=np.uint32)
    if src != D.FLOAT:
        x = h.astype(np.uint16).view(src.np)
    else:
        rng = np.random.default_rng(0)
        grid = (h << 13) + 0x38000000
        bits = np.concatenate([rng.integers(0, 1 << 32, 400_000, dtype=np.uint64).astype(np.uint32),
                               grid + 0x1000, grid + 0x0FFF, grid + 0x1001, (h << 16) + 0x8000,
                               np.arange(0x33000000, 0x38900000, 0x1001, dtype=np.uint32),
                               np.arange(0x477F0000, 0x47810000, 0x101, dtype=np.uint32)])
        x = np.concatenate([bits, bits | 0x80000000]).view(np.float32)
    with np.errstate(all="ignore"):
        expected = run_fused(_cast_attrs(x.shape, dst), [x])
        got = native.run_fused_native(_cast_attrs(x.shape, dst), [x])
    nan = np.isnan(expected.astype(np.float32))
    assert np.array_equal(nan, np.isnan(got.astype(np.float32)))
    assert np.array_equal(R.bits(got)[~nan], R.bits(expected)[~nan])


def test_unsupported_body_falls_back_to_numpy():
    g = Graph("f")
    x = g.add_input("x", TensorType((2, 3), D.INT32))
    attrs = FusedAttrs(shape=(2, 3), body=(Instr(op="cast", args=("in0",), dtype=D.FLOAT),
                                           Instr(op="add", args=("t0", "t0"), dtype=D.FLOAT)),
                       result="t1", out_dtype=D.FLOAT)
    g.outputs = [g.add_node("FusedElementwise", [x], attrs).outputs[0]]
    b = native.NativeBackend()
    data = np.arange(6, dtype=np.int32).reshape(2, 3)
    out = b.evaluate(g, {"x": opgraph.tensor(data)})
    assert out[g.outputs[0].name].tolist() == (2.0 * data).tolist()
    assert sum(b.fallbacks.values()) == 1 and "s32" in next(iter(b.fallbacks))


def test_disk_cache_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("OPGRAPH_CACHE_DIR", str(tmp_path))
    source = "#include <stdint.h>\nint64_t opg_kernel(void) { return 4242; }\n"
    build.forget()
    before = dict(build.stats)
    k = build.load(source)
    k.fn.restype = ctypes_int64()
    assert k.fn() == 4242 and build.stats["compiles"] == before["compiles"] + 1
    assert k.library.parent == tmp_path and k.source.read_text() == source
    assert "-ffp-contract=off" in k.library.with_suffix(".cmd").read_text()
    mtime = k.library.stat().st_mtime_ns
    assert build.load(source) is k  # in process: no work at all
    build.forget()  # like a new process
    assert build.load(source).library == k.library
    assert build.stats["compiles"] == before["compiles"] + 1
    assert build.stats["disk_hits"] == before["disk_hits"] + 1
    code = ("import ctypes, sys; from backends.native import build; "
            f"k = build.load({source!r}); k.fn.restype = ctypes.c_int64; "
            "print(k.fn(), build.stats['compiles'])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": root}, timeout=60)
    assert proc.stdout.split() == ["4242", "0"], proc.stderr
    assert k.library.stat().st_mtime_ns == mtime


def ctypes_int64():
    return ctypes.c_int64


def test_compile_error_names_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("OPGRAPH_CACHE_DIR", str(tmp_path))
    with pytest.raises(build.NativeBuildError) as e:
        build.load("void opg_kernel(void) { this is not C; }\n")
    msg = str(e.value)
    src = next(tmp_path.glob("k_*.c"))
    assert str(src) in msg and "error" in msg
    assert not list(tmp_path.glob("*.so*")), "no partial library is left behind"


def test_unavailable_without_compiler(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no compiler on it
    assert native.availability() == (False, "no C compiler found (tried cc, gcc, clang)")
    assert not native.available()
    with pytest.raises(backends.BackendUnavailable, match="no C compiler found"):
        backends.get("native")
    assert "native" not in backends.available()
    assert backends.get("numpy").name == "numpy"


def test_a_named_compiler_that_is_missing_is_not_swapped_for_another(monkeypatch):
    """$CC names the compiler: when it is not found the backend says so, rather than quietly
    compiling with cc (whose objects would differ)."""
    monkeypatch.setenv("CC", "no-such-cc-opgraph")
    ok, why = native.availability()
    assert not ok and why.startswith("$CC is 'no-such-cc-opgraph', which is not found on PATH"), why
    with pytest.raises(backends.BackendUnavailable, match="no-such-cc-opgraph"):
        backends.get("native")
    monkeypatch.delenv("CC")
    assert native.availability() == (True, "")


def test_emit_c_cli(capsys):
    assert main(["emit-c", "aclnnBatchNormElemtBackward", "--shape", "2,3,4", "--dtype", "bf16",
                 "--platform", "Ascend950"]) == 0
    out = capsys.readouterr().out
    assert "void opg_kernel" in out and "opg_st_bf16" in out and "Ascend950" in out
    assert main(["emit-c", "aclnnBatchNormElemtBackward", "--level", "1"]) == 1
    assert "fusion happens at --level 2" in capsys.readouterr().err


def test_collapse_and_bf16_dtype_sanity():
    assert native.collapse((4, 1, 3), [[3, 99, 1]]) == ([12], [[1]])
    assert native.collapse((1, 1), [[5, 7], [0, 0]]) == ([1], [[0], [0]])
    assert np.dtype(D.BF16.np) == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_every_half_bit_pattern_through_the_simd_loops(dtype, soc, no_fallback):
    """All 65536 fp16 / bf16 bit patterns (NaNs, infinities, subnormals, ties) as gradOut and,
    permuted, as input; channel parameters include inf, NaN, subnormals and huge values. The SIMD
    loops (native fp16 lanes, float lanes) must give numpy's bits exactly, except that which NaN
    (payload, sign) comes out is not specified: IEEE 754 leaves it open and numpy's own SIMD
    loops pick operands differently; NaNs must be NaNs in the same places."""
    rng = np.random.default_rng(7)
    grad = np.arange(65536, dtype=np.uint16).view(dtype).reshape(2, 4, 8192)
    inp = rng.permutation(np.arange(65536, dtype=np.uint16)).view(dtype).reshape(2, 4, 8192)
    tiny = np.float32(2.0 ** -20)
    params = [np.array(v, np.float32).astype(dtype) for v in (
        [0.5, -np.inf, 3.0, tiny], [1.5, 0.25, np.nan, 2.0], [1.0, -2.0, tiny, 60000.0],
        [0.0, 1.0, -3.0, np.inf], [2.0, tiny, 1e4, -1.0])]
    counter = np.array([3, 5], np.int32)
    outs = []
    for name in ("numpy", "native"):
        with opgraph.platform(soc), opgraph.opt_level(2), opgraph.use_backend(name):
            with np.errstate(invalid="ignore"):
                outs.append(opgraph.ops.batch_norm_elemt_backward(grad, inp, *params, counter))
    ref, got = (o.astype(np.float32) for o in outs)
    nan = np.isnan(ref)
    assert nan.any() and (~nan).sum() > 20000  # many ordinary numbers are compared bit by bit
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(outs[0].view(np.uint16)[~nan], outs[1].view(np.uint16)[~nan])


def test_small_fused_kernels_run_in_c_unless_below_the_threshold(monkeypatch):
    monkeypatch.setattr(native.NativeBackend, "min_elements", 4096)
    b = backends.get("native")
    x = np.ones((2, 3, 4), np.float32)
    c = np.ones(3, np.float32)
    expected = opgraph.ops.batch_norm_elemt_backward(x, x, c, c, c, c, c, np.int32([2]))
    before = b.small
    with opgraph.use_backend("native"):
        y = opgraph.ops.batch_norm_elemt_backward(x, x, c, c, c, c, c, np.int32([2]))
    assert b.small == before and np.array_equal(R.bits(y), R.bits(expected))
    monkeypatch.setattr(native.NativeBackend, "min_fused_elements", 4096)
    with opgraph.use_backend("native"):
        y = opgraph.ops.batch_norm_elemt_backward(x, x, c, c, c, c, c, np.int32([2]))
    assert b.small == before + 1 and np.array_equal(R.bits(y), R.bits(expected))


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(6, 5), (4, 5, 30), (2, 5, 30, 2)], ids=["rank2", "rank3", "rank4"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_batch_norm_elemt_of_any_rank_runs_in_c(shape, dtype, soc, layout):
    """BatchNormElemt reshapes a 2-D/3-D input to the kernel's 4-D layout: that view stays out of
    the fused kernel (a full-size view of a graph input moves nothing), which then reads the
    input through it — in C, with numpy's bits. A strided 2-D/3-D input is made contiguous
    first (the Contiguous fuses into the kernel, the view after it with it): that kernel still
    runs on numpy, with the same bits."""
    nat = backends.get("native")
    nat.fallbacks.clear()
    rng = np.random.default_rng(4)
    C = shape[1]
    x = rng.standard_normal((2,) + shape).astype(dtype)[1] if layout == "contiguous" else \
        rng.standard_normal(shape[:-1] + (2 * shape[-1],)).astype(dtype)[..., ::2]
    w, b, mean, invstd = (rng.uniform(0.5, 2, C).astype(dtype) for _ in range(4))
    got = {}
    for be in ("numpy", "native"):
        with opgraph.platform(soc), opgraph.opt_level(2), opgraph.use_backend(be):
            got[be] = ops.batch_norm_elemt(x, w, b, mean, invstd, 1e-5)
    R.assert_bits_equal(got["native"], got["numpy"])
    falls_back = layout == "strided" and len(shape) < 4
    assert bool(nat.fallbacks) == falls_back, dict(nat.fallbacks)


def test_vector_isa_names_what_the_compiler_targets():
    """The kernels' own preamble reports its lanes; the compiler's predefined macros (asked
    separately, with the kernels' flags) say which branch of it must have been taken."""
    cc = build.find_compiler()[0]
    macros = subprocess.run([*cc, *build.flags(cc), "-dM", "-E", "-x", "c", os.devnull],
                            capture_output=True, text=True, check=True).stdout.split()
    if "__AVX512F__" in macros:
        expected = "AVX-512, 16 float lanes"
    elif "__AVX2__" in macros and "__F16C__" in macros:
        expected = "AVX2 + F16C, 8 float lanes"
    else:
        expected = "scalar C"
    assert launch.vector_isa() == expected


@pytest.mark.parametrize("shape", [(3, 2, 20000), (2, 3, 4, 9000), (4096, 3, 2)],
                         ids=["rows-of-3-blocks", "carry-through-3-dims", "short-rows"])
@pytest.mark.parametrize("layout", ["contig", "perm"])
def test_claims_that_start_mid_row_and_rows_that_carry(shape, layout, no_fallback):
    """Work items are (row, block of the row); a thread's claim of items may start in the middle
    of a row, and each next row is found by carrying through the outer dims (no division per
    item): long rows of several blocks, rows carrying through three outer dims, and many short
    rows, on two threads, give numpy's bits."""
    before = team.threads()
    team.set_threads(2)
    try:
        case = R.make_case(shape, R.F32, seed=4)
        expected, got = both(case, "Ascend910B", {"gradOut": layout, "input": layout})
    finally:
        team.set_threads(before)
    R.assert_bits_equal(got, expected)


@pytest.mark.parametrize("dtype", [R.F32, R.F16, R.BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(2, 8), (3, 70), (9, 3), (4099, 64), (4101, 70)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("n", [1, 2])
def test_rows_of_a_2d_input_run_several_at_a_time(shape, dtype, n, no_fallback):
    """A 2-d [N, C] input's per-channel operands are vectors along its rows: the kernel takes
    its rows 4 at a time, each per-channel vector loaded once for the 4 (render.ROWS), then the
    rows left over one at a time; each row's elements past its last whole vector run scalar.
    Fewer rows than 4, a claim's rows not a multiple of 4, channels not a multiple of the
    vector width, one and two threads: numpy's bits, for BatchNormElemtBackward and
    BatchNormElemt."""
    before = team.threads()
    team.set_threads(n)
    try:
        case = R.make_case(shape, dtype, seed=6)
        expected, got = both(case, "Ascend950")
        R.assert_bits_equal(got, expected)
        rng = np.random.default_rng(6)
        x = rng.standard_normal(shape).astype(dtype)
        w, b, mean, invstd = (rng.uniform(0.5, 2, shape[1]).astype(dtype) for _ in range(4))
        outs = {}
        for be in ("numpy", "native"):
            with opgraph.platform("Ascend950"), opgraph.opt_level(2), opgraph.use_backend(be):
                outs[be] = ops.batch_norm_elemt(x, w, b, mean, invstd, 1e-5)
        R.assert_bits_equal(outs["native"], outs["numpy"])
    finally:
        team.set_threads(before)
