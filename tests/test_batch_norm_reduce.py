"""aclnnBatchNormReduce (per-channel Σx, Σx²) and its l0 kernel BNTrainingReduce: the vendor's
check table row by row (status, a message naming the argument, outputs untouched), the empty
path that runs before every other check, the l0 graph on 910B and 950, the numerics against an
independent loop model of the documented summation order (bits) and float64 (bounds), views and
strides, levels, the backend kit and the CLI."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import opgraph
from backends.numpy_backend import NUMPY_LOWERINGS, NumpyBackend, NumpyExecutable
from opgraph import aclnn, passes
from opgraph.aclnn.batch_norm_reduce import (aclnnBatchNormReduce,
                                             aclnnBatchNormReduceGetWorkspaceSize, batch_norm_reduce)
from opgraph.cli import main as cli_main
from opgraph.testing import check_backend
from sum_model import loop_sum

F32, F16, BF16, I32 = np.float32, np.float16, np.dtype(ml_dtypes.bfloat16), np.int32
NULLPTR, INVALID, INNER_NULLPTR, NO_KERNEL = 161001, 161002, 561103, 561003
SOCS = ("Ascend910B", "Ascend950")
SENTINEL = 0x5A
EPS = float(np.finfo(F32).eps)


def sentinel(shape, dtype=F32) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.full(n, SENTINEL, np.uint8).view(dtype).reshape(shape)


def rand_x(shape, dtype=F32, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 3 + 0.5).astype(dtype)


def t(a, fmt="ND"):
    return a if a is None or isinstance(a, opgraph.Tensor) else opgraph.tensor(a, format=fmt)


def phase1(x, s, q, soc="Ascend910B", fmt="NCHW"):
    with opgraph.platform(soc):
        st, ws, ex = aclnnBatchNormReduceGetWorkspaceSize(t(x, fmt), t(s), t(q))
    return int(st), ws, ex, aclnn.aclGetRecentErrMsg()


def run(x, s, q, soc="Ascend910B", fmt="NCHW"):
    st, ws, ex, msg = phase1(x, s, q, soc, fmt)
    assert st == 0, msg
    with opgraph.platform(soc):
        assert aclnnBatchNormReduce(bytearray(ws) if ws else None, ws, ex) == 0
    return ex


def expect_error(x, s, q, status, name, *words, soc="Ascend910B", fmt="NCHW"):
    outs = [a for a in (s, q) if isinstance(a, np.ndarray)]
    before = [a.tobytes() for a in outs]
    st, ws, ex, msg = phase1(x, s, q, soc, fmt)
    assert st == status, f"expected {status}, got {st}: {msg}"
    assert ex is None and ws == 0
    assert msg.split("): ", 1)[1].split(":")[0].split(" ")[0] == name, msg  # names it first
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert [a.tobytes() for a in outs] == before, "an output was written by a failing call"


# --- an independent model of the documented order (tests/sum_model.py), as loops ---------------
def model(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Per channel: the (n, h, w) elements in row-major order, cast to float32 one by one."""
    c_dim = 3 if fmt == "NHWC" else 1
    s, q = [], []
    for c in range(x.shape[c_dim]):
        vals = [F32(v) for v in np.take(x, c, axis=c_dim).ravel().astype(F32)]
        s.append(loop_sum(vals))
        q.append(loop_sum([F32(v * v) for v in vals]))
    return np.array(s, F32), np.array(q, F32)


def bits_equal(a, b) -> bool:
    return np.array_equal(np.asarray(a, F32).view(np.uint32), np.asarray(b, F32).view(np.uint32))


# --------------------------------------------------------------------------------------------
# check table (RED: NULL, empty, dtype, format, shape; then the kernel gate)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["x", "sum", "squareSum"])
def test_null_is_161001_naming_the_argument(name):
    args = {"x": rand_x((2, 3, 2, 2)), "sum": sentinel(3), "squareSum": sentinel(3)}
    args[name] = None
    expect_error(args["x"], args["sum"], args["squareSum"], NULLPTR, name, "NULL")


def test_null_comes_in_argument_order_and_before_the_empty_test():
    expect_error(None, None, sentinel(3), NULLPTR, "x")
    expect_error(np.zeros((0, 3, 2, 2), F32), sentinel(3), None, NULLPTR, "squareSum")


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950", "Ascend910"])
def test_empty_x_fills_zeros_before_any_other_check(soc):
    # int32, ND-tagged, rank 3, outputs of the wrong dtype and shape: all unchecked when empty
    x = np.zeros((0, 3, 4), I32)
    s, q = sentinel(3), sentinel((2, 2), F16)
    ex = run(x, s, q, soc=soc, fmt="ND")
    assert s.tolist() == [0, 0, 0] and q.dtype == F16 and not q.any()
    assert [n.op for n in ex.graph.nodes] == ["Fill", "ReFormat", "ViewCopy"] * 2
    assert [n.attrs.dtype for n in ex.graph.nodes if n.op == "Fill"] == [
        opgraph.DataType.FLOAT, opgraph.DataType.FLOAT16]


def test_an_empty_output_takes_the_empty_path_with_a_non_empty_x():
    s, q = np.zeros(0, F32), sentinel(5, I32)         # squareSum: wrong dtype and size
    run(rand_x((2, 3, 2, 2)), s, q)
    assert q.tolist() == [0] * 5


@pytest.mark.parametrize("dtype", [I32, np.float64, np.int8])
def test_x_dtype_outside_f32_f16_bf16_is_161002(dtype):
    expect_error(rand_x((2, 3, 2, 2)).astype(dtype), sentinel(3), sentinel(3), INVALID, "x", "dtype")


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend910_93", "Ascend950"])
def test_bf16_x_needs_no_soc_gate(soc):
    x = rand_x((2, 3, 2, 2), BF16)
    s, q = sentinel(3), sentinel(3)
    run(x, s, q, soc=soc)
    assert bits_equal(s, model(x, "NCHW")[0])


@pytest.mark.parametrize("name", ["sum", "squareSum"])
@pytest.mark.parametrize("dtype", [F16, BF16, np.float64])
def test_outputs_must_be_float32(name, dtype):
    args = {"sum": sentinel(3), "squareSum": sentinel(3)}
    args[name] = sentinel(3, dtype)
    expect_error(rand_x((2, 3, 2, 2)), args["sum"], args["squareSum"], INVALID, name, "dtype")


def test_dtype_is_checked_before_format():
    # x is ND-tagged (a format error) but sum's dtype error comes first
    expect_error(rand_x((2, 3, 2, 2)), sentinel(3, F16), sentinel(3), INVALID, "sum", "dtype", fmt="ND")


@pytest.mark.parametrize("fmt", ["ND", "NCL", "HWCN", "NC1HWC0", "NCDHW"])
def test_x_must_be_tagged_nchw_or_nhwc(fmt):
    expect_error(rand_x((2, 3, 2, 2)), sentinel(3), sentinel(3), INVALID, "x", fmt, "NCHW, NHWC",
                 fmt=fmt)


@pytest.mark.parametrize("name", ["sum", "squareSum"])
def test_outputs_must_be_tagged_nd(name):
    args = {"sum": sentinel(3), "squareSum": sentinel(3)}
    args[name] = opgraph.tensor(args[name], format="NC")
    expect_error(rand_x((2, 3, 2, 2)), args["sum"], args["squareSum"], INVALID, name, "format NC")


def test_format_is_checked_before_rank():
    expect_error(rand_x((2, 3, 4)), sentinel(3), sentinel(3), INVALID, "x", "format ND", fmt="ND")
    expect_error(rand_x((2, 3, 4)), sentinel(3), sentinel(3), INVALID, "x", "rank 3")


@pytest.mark.parametrize("rank", [2, 3, 5, 6, 7, 8])
def test_ranks_other_than_4_are_rejected_unless_empty(rank):
    shape = (2, 3) + (2,) * (rank - 2)
    expect_error(rand_x(shape), sentinel(3), sentinel(3), INVALID, "x", f"rank {rank}")
    s = sentinel(3)
    run(np.zeros((0,) + shape[1:], F32), s, sentinel(3))   # empty: zeros, no rank check
    assert s.tolist() == [0, 0, 0]


@pytest.mark.parametrize("name,shape,word", [
    ("sum", (3, 1), "rank 2"), ("squareSum", (), "rank 0"),
    ("sum", (4,), "[C] = [3]"), ("squareSum", (2,), "[C] = [3]")])
def test_output_shape_rows(name, shape, word):
    args = {"sum": sentinel(3), "squareSum": sentinel(3)}
    args[name] = sentinel(shape)
    expect_error(rand_x((2, 3, 2, 2)), args["sum"], args["squareSum"], INVALID, name, word)


def test_sum_rank_is_checked_before_squaresum_rank_before_sizes():
    expect_error(rand_x((2, 3, 2, 2)), sentinel(5), sentinel((3, 1)), INVALID, "squareSum", "rank 2")


def test_nhwc_channel_is_dim_3():
    x = rand_x((2, 3, 4, 5))                                  # NHWC: C = 5, not 3
    expect_error(x, sentinel(3), sentinel(3), INVALID, "sum", "[C] = [5]", "x.shape[3]", fmt="NHWC")
    s, q = sentinel(5), sentinel(5)
    run(x, s, q, fmt="NHWC")
    assert bits_equal(s, model(x, "NHWC")[0]) and bits_equal(q, model(x, "NHWC")[1])


@pytest.mark.parametrize("soc", ["Ascend910", "Ascend310P", "Ascend310B"])
def test_socs_without_the_kernel_get_561003_after_the_checks(soc):
    expect_error(rand_x((2, 3, 2, 2)), sentinel(3), sentinel(3), NO_KERNEL, "BNTrainingReduce", soc=soc)
    expect_error(rand_x((2, 3, 2, 2), I32), sentinel(3), sentinel(3), INVALID, "x", soc=soc)


def test_strided_sum_is_561103_and_strided_squaresum_works():
    x = rand_x((2, 3, 2, 2))
    buf = sentinel(6)
    expect_error(x, buf[::2], sentinel(3), INNER_NULLPTR, "sum", "contiguous")
    assert buf.view(np.uint8).tolist() == [SENTINEL] * 24
    s, buf = sentinel(3), sentinel(6)
    run(x, s, buf[::2])
    want_s, want_q = model(x, "NCHW")
    assert bits_equal(s, want_s) and bits_equal(buf[::2], want_q)
    assert buf[1::2].tobytes() == bytes([SENTINEL]) * 12               # the gaps untouched


# --------------------------------------------------------------------------------------------
# the l0 graph, per SoC
# --------------------------------------------------------------------------------------------
GRAPH = """\
  %0: {d}[2,3,4,5]@{f} = Contiguous(%x)
  %1: f32[{s}] = UnsqueezeNd(%sum, dims=[{u}])
  %2: f32[{s}]@{f} = ReFormat(%1, format={f})
  %3: f32[{s}]@{f}, %4: f32[{s}]@{f} = BNTrainingReduce(%0, shape=[{s}])
  %5: f32[{c}]@{f} = SqueezeNd(%3, dims=[{u}])
  %6: f32[{c}] = ReFormat(%5, format=ND)
  %7: f32[{c}]@{f} = SqueezeNd(%4, dims=[{u}])
  %8: f32[{c}] = ReFormat(%7, format=ND)
  %9: f32[{c}] = ViewCopy(%6, %sum)
  %10: f32[{c}] = ViewCopy(%8, %squareSum)
  return %9, %10"""


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("dtype,d", [(F32, "f32"), (F16, "f16"), (BF16, "bf16")])
@pytest.mark.parametrize("fmt", ["NCHW", "NHWC"])
def test_level0_graph_op_by_op(soc, dtype, d, fmt):
    C = 3 if fmt == "NCHW" else 5
    ex = run(rand_x((2, 3, 4, 5), dtype), sentinel(C), sentinel(C), soc=soc, fmt=fmt)
    body = str(ex.graph).splitlines()[1:-1]
    want = GRAPH.format(d=d, f=fmt, c=C, s="1,3,1,1" if fmt == "NCHW" else "1,1,1,5",
                        u="0,2,3" if fmt == "NCHW" else "0,1,2")
    assert body == want.splitlines()


@pytest.mark.parametrize("soc", SOCS)
def test_level1_launches_bntrainingreduce_and_no_other_computing_kernel(soc):
    ex = run(rand_x((2, 3, 4, 5)), sentinel(3), sentinel(3), soc=soc)
    g1 = passes.optimize(ex.graph, 1)
    launched = [n.op for n in g1.nodes if not n.opdef.is_free(n)]
    assert [op for op in launched if op != "ViewCopy"] == ["BNTrainingReduce"]
    assert "UnsqueezeNd" not in [n.op for n in g1.nodes]      # ResizeTo4D's view is dead


@pytest.mark.parametrize("soc", SOCS)
def test_level1_launch_count_is_cann_s_one_kernel(soc):
    ex = run(rand_x((2, 3, 4, 5)), sentinel(3), sentinel(3), soc=soc)
    assert passes.graph_stats(passes.optimize(ex.graph, 1)).launches == 1


def test_strided_x_keeps_its_contiguous_copy_at_level1():
    big = rand_x((2, 3, 8, 5))
    ex = run(big[:, :, ::2], sentinel(3), sentinel(3))
    g1 = passes.optimize(ex.graph, 1)
    assert [n.op for n in g1.nodes if not n.opdef.is_free(n)][:2] == ["Contiguous", "BNTrainingReduce"]


# --------------------------------------------------------------------------------------------
# numerics: bits against the loop model (the 950 kernel's op order and opgraph's sum order;
# 910B: the same formula), bounds against float64
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("fmt,shape", [("NCHW", (2, 3, 4, 5)), ("NHWC", (3, 5, 7, 2)),
                                       ("NCHW", (4, 2, 9, 11))])
def test_bits_match_the_loop_model(soc, dtype, fmt, shape):
    x = rand_x(shape, dtype, seed=sum(shape))
    C = shape[3 if fmt == "NHWC" else 1]
    s, q = sentinel(C), sentinel(C)
    run(x, s, q, soc=soc, fmt=fmt)
    want_s, want_q = model(x, fmt)
    assert bits_equal(s, want_s) and bits_equal(q, want_q)


def test_bits_and_bound_over_several_blocks():
    x = rand_x((3, 2, 150, 160), seed=7)                    # R = 72000: three 32768-blocks
    s, q = sentinel(2), sentinel(2)
    run(x, s, q)
    want_s, want_q = model(x, "NCHW")
    assert bits_equal(s, want_s) and bits_equal(q, want_q)
    R, xd = 72000, x.astype(np.float64)
    k = 32768 / 64 + 6 + math.ceil(math.log2(R / 32768))   # the documented first-order bound
    for got, terms in ((s, xd), (q, xd * xd)):
        exact, mag = terms.sum(axis=(0, 2, 3)), np.abs(terms).sum(axis=(0, 2, 3))
        assert (np.abs(got - exact) <= (k + 1) * EPS * mag).all()


@pytest.mark.parametrize("hw", [(1, 3), (2, 5), (17, 1), (1, 1)])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_950_small_r_template_sums_sequentially_from_plus_zero(hw, dtype, level):
    """NCHW, N = 1 and H·W in {1, 3, 10, 17}: the 950 tiling's small-R template
    (bn_training_reduce_tiling_arch35.cpp:49-68) keeps one register per channel and adds
    x[0, c, r] (and its float32 square) for r = 0, 1, … from +0 (bn_training_reduce_small_r.h:
    46-62) — not opgraph's lane/tree order: (1e8 + 1) + −1e8 is 0 there, 1 in the tree."""
    x = rand_x((1, 2) + hw, dtype, seed=3)
    if x[0, 0].size >= 3:  # channel 0: big, 1, −big, then zeros
        x[0, 0] = 0
        x[0, 0].flat[:3] = [1e4, 1.0, -1e4] if dtype is F16 else [1e8, 1.0, -1e8]
    x[0, 1] = -0.0  # +0 + −0 = +0: −0s sum to +0
    s, q = sentinel(2), sentinel(2)
    run(x, s, q, soc="Ascend950")
    want_s, want_q = [], []
    for c in range(2):
        acc, sq = F32(0.0), F32(0.0)
        for v in x[0, c].ravel().astype(F32):
            acc, sq = F32(acc + v), F32(sq + F32(v * v))
        want_s.append(acc)
        want_q.append(sq)
    assert bits_equal(s, want_s) and bits_equal(q, want_q)
    assert not np.signbit(s[1])
    if x[0, 0].size >= 3 and dtype is F32:
        assert s[0] == 0  # the tree order gives 1 here (f16 data: exact in float32 either way)


def test_square_is_taken_in_float32_not_in_the_input_dtype():
    x = np.full((1, 1, 2, 2), 65504, F16)                   # f16 max: x² overflows f16, not f32
    s, q = sentinel(1), sentinel(1)
    run(x, s, q)
    assert s.tolist() == [4 * 65504.0] and q.tolist() == [4 * 65504.0 ** 2]


def test_nan_and_inf_propagate():
    x = np.ones((2, 3, 1, 2), F32)
    x[0, 0, 0, 0] = np.nan
    x[1, 1, 0, 1] = np.inf
    x[0, 2, 0, 0], x[1, 2, 0, 0] = np.inf, -np.inf
    s, q = sentinel(3), sentinel(3)
    run(x, s, q, soc="Ascend950")
    assert np.isnan(s[0]) and s[1] == np.inf and np.isnan(s[2])
    assert np.isnan(q[0]) and q[1] == np.inf and q[2] == np.inf


@pytest.mark.parametrize("fmt", ["NCHW", "NHWC"])
def test_non_contiguous_x_gives_the_bits_of_its_contiguous_copy(fmt):
    base = rand_x((2, 6, 4, 5), seed=3)
    views = [base[:, ::2], base.transpose(0, 2, 3, 1).copy().transpose(0, 3, 1, 2)]  # channels_last
    for v in views:
        assert not v.flags.c_contiguous
        C = v.shape[3 if fmt == "NHWC" else 1]
        a, b, c, d = sentinel(C), sentinel(C), sentinel(C), sentinel(C)
        run(v, a, b, fmt=fmt)
        run(np.ascontiguousarray(v), c, d, fmt=fmt)
        assert bits_equal(a, c) and bits_equal(b, d)
        assert bits_equal(a, model(v, fmt)[0])


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_levels_0_1_2_give_identical_bits(soc, dtype):
    x = rand_x((3, 4, 6, 7), dtype, seed=11)
    got = []
    for level in (0, 1, 2):
        s, q = sentinel(4), sentinel(4)
        with opgraph.opt_level(level):
            run(x, s, q, soc=soc)
        got.append((s, q))
    for s, q in got[1:]:
        assert bits_equal(s, got[0][0]) and bits_equal(q, got[0][1])


def test_reference_formula_is_float64_over_non_channel_dims():
    spec = aclnn.get_op_api("aclnnBatchNormReduce")
    x = np.arange(24, dtype=F32).reshape(2, 3, 2, 2)
    ref = spec.reference({"x": x, "sum": None, "squareSum": None})
    assert ref["sum"].tolist() == [sum(x[:, c].ravel().tolist()) for c in range(3)]
    nhwc = spec.reference({"x": opgraph.tensor(x, format="NHWC")})
    assert nhwc["squareSum"].tolist() == [float(sum(v * v for v in x[..., c].ravel().tolist()))
                                          for c in range(2)]


# --------------------------------------------------------------------------------------------
# the Pythonic function
# --------------------------------------------------------------------------------------------
def test_pythonic_takes_numpy_as_nchw_and_tensors_with_their_tag():
    x = rand_x((2, 3, 4, 5), F16)
    s, q = batch_norm_reduce(x)
    assert s.dtype == q.dtype == F32 and s.shape == (3,)
    assert bits_equal(s, model(x, "NCHW")[0]) and bits_equal(q, model(x, "NCHW")[1])
    s, q = batch_norm_reduce(opgraph.tensor(x, format="NHWC"))
    assert s.shape == (5,) and bits_equal(q, model(x, "NHWC")[1])
    assert batch_norm_reduce(np.zeros((0, 3, 2, 2), F32))[0].tolist() == [0, 0, 0]


def test_pythonic_raises_with_the_op_api_status():
    with pytest.raises(opgraph.AclnnError) as e:
        batch_norm_reduce(rand_x((2, 3, 4)))
    assert e.value.status == INVALID and "x: rank 3" in str(e.value)
    with pytest.raises(opgraph.AclnnError) as e:
        batch_norm_reduce(None)
    assert e.value.status == NULLPTR and "x: must not be NULL" in str(e.value)  # the op_api's words
    with pytest.raises(opgraph.AclnnError) as e:
        batch_norm_reduce("abc")
    assert e.value.status == INVALID and "input" in str(e.value)
    with opgraph.platform("Ascend910"), pytest.raises(opgraph.AclnnError) as e:
        batch_norm_reduce(rand_x((2, 3, 4, 5)))
    assert e.value.status == NO_KERNEL


# --------------------------------------------------------------------------------------------
# backend kit and CLI: the generator tags x NCHW (the spec's formats)
# --------------------------------------------------------------------------------------------
def test_backend_kit_passes_for_numpy():
    # strided outputs included: a strided sum is refused (561103) by the reference and the target alike
    report = check_backend("numpy", op_apis=["aclnnBatchNormReduce"])
    assert report.ok, str(report)
    assert report.cases == 2 * 3 * 3 * 3 * 2          # shapes x SoCs x dtypes x levels x layouts


class FlipsSquareSum(NumpyBackend):
    """Deliberately wrong: flips the lowest bit of BNTrainingReduce's squareSum."""

    name = "wrong-bntr"

    def compile(self, graph, memory_plan, platform):
        def lower(exe, node, args):
            s, q = node.opdef.compute(args, node.attrs)
            q.view(np.uint32)[...] ^= 1
            return [s, q]
        table = NUMPY_LOWERINGS.extend({"BNTrainingReduce": lower})
        return NumpyExecutable(self, graph, memory_plan, platform, table)


def test_backend_kit_catches_a_wrong_bntrainingreduce():
    report = check_backend(FlipsSquareSum(), op_apis=["aclnnBatchNormReduce"], levels=(1,),
                           dtypes=["float32"], layouts=("contiguous",), platforms=["Ascend950"])
    assert not report.ok and len(report.failures) == report.cases == 2
    assert all("squareSum" in f.detail for f in report.failures)


def _cli(capsys, *argv):
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


COMMANDS = ["run", "dump", "plan", "emit-c", "emit-cpp"]


@pytest.mark.parametrize("command", COMMANDS)
def test_cli_commands_work_or_fail_in_one_line(capsys, tmp_path, command):
    extra = ["-o", str(tmp_path / "p.cpp")] if command == "emit-cpp" else []
    code, out, err = _cli(capsys, command, "aclnnBatchNormReduce", "--shape", "2,3,4,5",
                          "--dtype", "float16", "--platform", "Ascend950", *extra)
    if code == 0:
        assert out and not err
    else:
        assert len(err.strip().splitlines()) == 1 and err.startswith("opgraph:"), err
    if command in ("run", "dump", "plan", "emit-cpp"):
        assert code == 0
    if command == "run":
        assert "max rel error" in out and "squareSum" in out
