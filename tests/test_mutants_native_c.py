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
from backends.native import compiler, launch, render
from backends.native.launch import run_fused_native
from backends.native.reduce import plan_for
from backends.native.reduce_run import run_fused_reduce_native
from backends.native.unsupported import Unsupported
from l0ops.fused_reduce import FusedReduce, FusedReduceAttrs
from l0ops.interpreter import run_fused
from l0ops.primitives import FusedAttrs, Instr
from opgraph.core.dtypes import DataType as D
from reduce_bodies import passes_of, stats_body

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])
F32, F16, BF16 = D.FLOAT, D.FLOAT16, D.BF16
NP = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16}


def same_bits(got, want) -> bool:
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    return got.dtype == want.dtype and got.shape == want.shape and \
        np.array_equal(got.view(np.uint8), want.view(np.uint8))


def same_bits_nan_anywhere(got, want) -> bool:
    """NaNs where ``want`` has NaNs, whatever their payload or sign (README: "Bit-identical"
    covers every non-NaN result), and every other element's bits."""
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    nan = np.isnan(want.astype(np.float32))
    if got.dtype != want.dtype or got.shape != want.shape or \
            not np.array_equal(np.isnan(got.astype(np.float32)), nan):
        return False
    return same_bits(got[~nan], want[~nan])


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
        x.reshape(-1)[::7] *= 1e4  # mixed magnitudes: another order of the sums changes bits
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


def channels_last(shape, seed: int = 5, dtype=np.float32):
    """An NC... array in channels_last memory (C innermost), values of mixed magnitude (a change
    of summation order changes the bits)."""
    order = (0,) + tuple(range(2, len(shape))) + (1,)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(tuple(shape[d] for d in order)).astype(np.float32)
    x.reshape(-1)[::7] *= 1e4
    return x.astype(dtype).transpose(np.argsort(order))


@pytest.mark.parametrize("shape", [(1, 70, 5, 7), (1, 20, 3, 1)], ids=["35-rows", "3-rows"])
def test_channels_last_sums_over_an_odd_count_of_rows_under_64(shape):
    """A channels_last pass over fewer rows than 64 lanes, an odd count: each kept index's lanes
    fold by the tree of l0ops.ordered (n = ceil(m/2)), whose odd step (opg_fold_cols) only such a
    block takes, over exactly the rows' lanes (channel 0 is all -0.0, whose sum stays -0.0 only
    if no other lane is added)."""
    x = channels_last(shape)
    x[:, 0] = -0.0
    a = stats_body(shape)
    assert [p.cols for p in passes_of(a, [x])] == [True, True]
    check_reduce(a, [x])
    assert np.signbit(run_fused_reduce_native(a, [x])[0][0])


@pytest.mark.parametrize("n", [1, 2])
def test_lane_groups_fold_only_the_lanes_of_a_short_last_block(n, threads):
    """A parallel channels_last pass of fewer than 8 items over two blocks splits each block's
    lanes into groups and folds them afterwards (opg_fold_blocks): a last block of 3 rows folds
    its 3 lanes only, not lanes no item wrote. Channel 0 is all -0.0 (an unwritten lane, zero or
    not, would change its sum's bits)."""
    threads(n)
    x = np.random.default_rng(2).standard_normal((32768 + 3, 2)).astype(np.float32)
    x[:, 0] = -0.0
    a = stats_body(x.shape)
    assert [p.cols for p in passes_of(a, [x])] == [True, True]
    check_reduce(a, [x])
    assert np.signbit(run_fused_reduce_native(a, [x])[0][0])


def test_channels_last_chunk_just_above_the_widest():
    """From 8 MiB of data a channels_last item takes up to OPG_KC_MAX = 256 kept indices (its
    accumulators are sized for that); 257 of them are chunks of 64: the reference's bits."""
    x = channels_last((1, 257, 8192, 1), seed=9)
    assert x.nbytes >= 8 << 20
    check_reduce(stats_body(x.shape), [x])


def narrow_mean_body(shape, half: D):
    """Two passes with a mean rounded to ``half`` between them (Σx·(1/N) cast to ``half``), then
    Σ(x − mean)²: a per-index instruction between the passes that rounds."""
    k = tuple(n if d == 1 else 1 for d, n in enumerate(shape))
    n = float(np.float32(1.0 / (np.prod(shape) // shape[1])))
    body = (Instr(op="sum", args=("in0",), dtype=F32, shape=k, over=tuple(shape)),
            Instr(op="fill", dtype=F32, value=n),
            Instr(op="mul", args=("t0", "t1"), dtype=F32),
            Instr(op="cast", args=("t2",), dtype=half),
            Instr(op="cast", args=("t3",), dtype=F32),
            Instr(op="sub", args=("in0", "t4"), dtype=F32),
            Instr(op="mul", args=("t5", "t5"), dtype=F32),
            Instr(op="sum", args=("t6",), dtype=F32, shape=k, over=tuple(shape)))
    return FusedReduceAttrs(body=body, results=("t3", "t7"), out_shapes=((shape[1],),) * 2)


@pytest.mark.parametrize("half", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("layout", ["channel-major", "channels-last"])
def test_a_rounding_between_two_passes_run_as_one_call(layout, half):
    """The instructions between a blocked pair's passes (pair_c) round to their dtype: a mean
    cast to f16/bf16 there is the rounded value pass b reads and the result, as the reference's."""
    shape = (2, 9, 5, 7)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(shape).astype(np.float32) + 1 / 3) if layout == "channel-major" \
        else channels_last(shape, seed=4) * np.float32(1e-4) + np.float32(1 / 3)
    a = narrow_mean_body(shape, half)
    assert [st[0] for st in plan_for(a, [x]).steps if st[0] != "instr"] == ["blocked"]
    check_reduce(a, [x])


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [(2, 3, 600), (6, 120)], ids=["rows-of-600", "2d-120-channels"])
def test_a_rows_last_vector_stores_only_its_tail_lanes_in_place(shape, dt):
    """Past the vector loops a row's last lanes are computed as the row's last whole vector, of
    which only those lanes are stored (simd.vector_tail): with the output the data input itself,
    storing the vector's other lanes too would write them a second time, computed from the
    output (rows longer than simd.SHORT_ROW, and a 2-d [N, C] input's rows, both 8 lanes past
    their last vector, as the reference computes them from the input)."""
    inputs = affine_inputs(shape, dt, seed=7)
    a = affine(shape, dt)
    want = run_fused(a, [x.copy() for x in inputs])
    got = run_fused_native(a, inputs, out=inputs[0])
    assert got is inputs[0] or np.shares_memory(got, inputs[0])
    assert same_bits(inputs[0], want)


@pytest.mark.parametrize("n", [7, 5])
def test_rows_of_a_2d_input_stop_at_the_claims_last_row(n):
    """A 2-d [N, C] input's rows go four at a time (render.ROWS) while four are left in the
    claim, the rest one by one: with 7 or 5 rows nothing is written past the output (a row of
    sentinels right after it) and every row has the reference's bits."""
    shape = (n, 96)
    inputs = affine_inputs(shape, BF16, seed=n)
    a = affine(shape, BF16)
    buf = np.full((n + 1, 96), 7, np.uint16).view(ml_dtypes.bfloat16)
    run_fused_native(a, inputs, out=buf[:n])
    assert same_bits(buf[:n], run_fused(a, inputs))
    assert (buf[n].view(np.uint16) == 7).all()


@pytest.mark.parametrize("dt", [F32, BF16], ids=["f32", "bf16"])
def test_an_output_strided_in_its_last_dim_from_dense_inputs(dt):
    """Dense inputs and an output every other element of a buffer (stride 2 in its last dim):
    the rows take the strided loop, not the dense one (whose stores would be contiguous), and
    the elements between are left alone."""
    shape = (2, 3, 40)
    inputs = affine_inputs(shape, dt, seed=3)
    a = affine(shape, dt)
    buf = np.full(shape[:-1] + (2 * shape[-1],), 7, np.uint32 if dt == F32 else np.uint16)
    buf = buf.view(NP[dt])
    run_fused_native(a, inputs, out=buf[..., ::2])
    assert same_bits(buf[..., ::2], run_fused(a, inputs))
    assert (buf[..., 1::2].view(np.uint32 if dt == F32 else np.uint16) == 7).all()


# float32 values at the f16/bf16 roundings' edges: f16's overflow threshold 65520 and just
# below, its smallest normal and subnormal steps (ties included), bf16 ties, infinities, NaNs
EDGES = np.array([65519.0, 65520.0, 65535.99, -65520.0, 6.1035156e-05, 6.1e-05, 2.9802322e-08,
                  8.940697e-08, 1.0e-09, 1.00390625, 1.01171875, -1.00390625, np.inf, -np.inf,
                  np.nan, -0.0, 3.0e38, 1.0], np.float32)
EDGES = np.concatenate([EDGES, np.array([0x7F800001, 0xFFA00000], np.uint32).view(np.float32)])  # sNaNs


@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided-out"])
@pytest.mark.parametrize("dt", [F16, BF16], ids=["f16", "bf16"])
def test_roundings_at_the_half_types_edges(dt, strided):
    """f32 values rounded to f16/bf16 at every edge of the scalar helpers (c_text.HELPERS:
    opg_rnd_f16's overflow to infinity from 65520 and its subnormal steps, opg_st_bf16's ties
    and quiet NaN) and of the vector ones, and those f16/bf16 values loaded back (opg_ld_f16 of
    infinities, NaNs, subnormals) into f32: the reference's bits. A strided output takes the
    scalar loop for every element. NaNs must be where the reference's are (a signalling NaN
    must not come out infinite); their payloads are left open."""
    x = np.tile(EDGES, (2, 3, 2))
    shape = x.shape
    ones, zeros = np.ones((1, 3, 1), np.float32), np.zeros((1, 3, 1), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # 3e38 and 65520 overflow f16; sNaNs
        narrow = x.astype(NP[dt])
        for a, ins in ((affine(shape, dt), [x, zeros, ones]), (affine(shape, F32), [narrow, zeros, ones])):
            buf = np.zeros(shape[:-1] + (2 * shape[-1],), NP[a.out_dtype])
            out = buf[..., ::2] if strided else buf[..., :shape[-1]]
            run_fused_native(a, ins, out=out)
            assert same_bits_nan_anywhere(out, run_fused(a, ins))


def round_trip(shape, half: D) -> FusedAttrs:
    """in0 (f32) rounded to ``half``, widened and multiplied by in1 (per channel): an f16/bf16
    rounding whose value later f32 arithmetic reads, not a store."""
    body = (Instr(op="cast", args=("in0",), dtype=half), Instr(op="cast", args=("t0",), dtype=F32),
            Instr(op="mul", args=("t1", "in1"), dtype=F32))
    return FusedAttrs(shape=tuple(shape), body=body, result="t2", out_dtype=F32)


@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided-out"])
@pytest.mark.parametrize("dt", [F16, BF16], ids=["f16", "bf16"])
def test_a_half_rounding_read_by_later_arithmetic(dt, strided):
    """An f16/bf16 rounding inside a body (opg_rnd_f16 / opg_rnd_bf16, and the vector ones)
    gives the half value itself: 65520 rounds to f16 infinity (not 65536, which a store would
    still make infinity), a signalling NaN to a quiet one (not infinity), as the reference's."""
    x = np.tile(EDGES, (2, 3, 2))
    half = np.full((1, 3, 1), 0.5, np.float32)
    a = round_trip(x.shape, dt)
    buf = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), np.float32)
    out = buf[..., ::2] if strided else buf[..., :x.shape[-1]]
    with np.errstate(over="ignore", invalid="ignore"):
        run_fused_native(a, [x, half], out=out)
        assert same_bits_nan_anywhere(out, run_fused(a, [x, half]))


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bf16", "f16"])
def test_streamed_rows_longer_than_short_rows_peel_a_vector_at_most(dt):
    """An output of render.STREAM_BYTES in rows of 600 f16/bf16 elements (longer than
    simd.SHORT_ROW, so each row takes the streamed loop, 1200 bytes: rows start at every 16
    bytes of a cache line): the peel up to the first line boundary stores up to a vector's
    lanes at a time, however far the boundary (up to 32 elements), and the rows are the
    reference's bits, nothing written past the output."""
    rows = -(-render.STREAM_BYTES // (600 * 2))
    shape = (-(-rows // 8), 8, 600)
    inputs = affine_inputs(shape, dt, seed=12)
    a = affine(shape, dt)
    buf = np.full(int(np.prod(shape)) + 64, 7, np.uint16)
    out = buf[3:3 + int(np.prod(shape))].view(NP[dt]).reshape(shape)  # rows start mid-line
    run_fused_native(a, inputs, out=out)
    assert same_bits(out, run_fused(a, inputs))
    assert (buf[:3] == 7).all() and (buf[3 + int(np.prod(shape)):] == 7).all()


@pytest.mark.parametrize("shape", [(4, 3, 5), (7, 2, 3), (3, 5, 11)], ids=lambda s: "x".join(map(str, s)))
def test_rows_shorter_than_a_vector_from_any_lane(shape):
    """A channel-major pass over rows shorter than a vector: a row starting mid-vector takes
    one masked vector of exactly its elements up to the next aligned lane (reduce_c's head),
    not the next row's first element too."""
    x = np.random.default_rng(8).standard_normal(shape).astype(np.float32)
    x.reshape(-1)[::5] *= 1e4
    a = stats_body(shape)
    assert [p.cols for p in passes_of(a, [x])] == [False, False]
    check_reduce(a, [x])


def test_a_pass_does_not_read_a_narrowed_input_through_a_view():
    """A view of an input's exact widening is read as the input (the load widens), but a view
    of its narrowing to f16 is not: such a body is not one the passes cover (Unsupported: the
    backend falls back to numpy), never the input's unrounded values."""
    x = (np.random.default_rng(6).standard_normal((4, 6)) * 1e3 + 1 / 3).astype(np.float32)
    k = dict(dtype=F32, shape=(1, 3, 1), over=(4, 3, 2))
    body = (Instr(op="cast", args=("in0",), dtype=F16), Instr(op="cast", args=("t0",), dtype=F32),
            Instr(op="view", args=("t1",), dtype=F32, shape=(4, 3, 2)),
            Instr(op="sum", args=("t2",), **k))
    a = FusedReduceAttrs(body=body, results=("t3",), out_shapes=((3,),))
    with pytest.raises(Unsupported, match="per element"):
        run_fused_reduce_native(a, [x])
