"""FusedReduce on the native backend, its paths past the kernels of
tests/test_native_reduce.py: the family's op_apis at level 2 give the numpy backend's bits,
counts read through their view, channel groups, the per-channel epilogue as one C call, rows
from any lane and no read past the data."""
from __future__ import annotations

import ctypes
import dataclasses
import mmap

import numpy as np
import pytest

import backends
import opgraph
from backends import native
from native_limits import reduce_limits_at
from backends.native.reduce import plan_for
from backends.native.reduce_run import run_planned
from forked import in_forked_child
from l0ops.fused_reduce import FusedReduceAttrs, Instr
from opgraph.aclnn.batch_norm_gather_stats_with_counts import batch_norm_gather_stats_with_counts
from opgraph.aclnn.batch_norm_reduce import batch_norm_reduce
from opgraph.aclnn.batch_norm_reduce_backward import batch_norm_backward_reduce
from opgraph.aclnn.batch_norm_stats import batch_norm_stats
from opgraph.core.dtypes import DataType as D
from opgraph.core.ir import Graph, TensorType
from reduce_bodies import BF16, DTYPES, F16, F32, backward_body, bits, check_same, keep, stats_body, steps_of

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])


# --- the family's op_apis at level 2: numpy vs native --------------------------------------
def op_calls(x, dy):
    C = x.shape[1]
    rng = np.random.default_rng(8)
    mean, invstd = rng.standard_normal(C).astype(np.float32), rng.uniform(0.5, 2, C).astype(np.float32)
    w = rng.standard_normal(C).astype(np.float32)
    return {"stats": lambda: batch_norm_stats(x, 1e-5),
            "reduce": lambda: batch_norm_reduce(x),
            "backward_reduce": lambda: batch_norm_backward_reduce(dy, x, mean, invstd, w, True, True, True)}


@pytest.mark.parametrize("dt, soc", [(dt, soc) for dt in DTYPES for soc in ("Ascend910B", "Ascend950")
                                     if dt != "bf16" or soc == "Ascend950"])  # bf16 stats: 950 only
@pytest.mark.parametrize("shape", [(2, 3, 28, 28), (3, 5, 9, 70), (2, 16, 9, 70)],
                         ids=lambda s: "x".join(map(str, s)))
def test_family_op_apis_bits_equal_numpy(shape, dt, soc, monkeypatch):
    reduce_limits_at(monkeypatch, 0)
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(shape) * 2 + 1).astype(DTYPES[dt])
    dy = rng.standard_normal(shape).astype(DTYPES[dt])
    nat = backends.get("native")
    nat.fallbacks.clear()
    results = {}
    for be in ("numpy", "native"):
        with opgraph.platform(soc), opgraph.opt_level(2), opgraph.use_backend(be):
            results[be] = {}
            for name, call in op_calls(x, dy).items():
                try:
                    results[be][name] = [o for o in call() if o is not None]
                except opgraph.AclnnError as e:  # unsupported dtype on this SoC: the same on both
                    results[be][name] = str(e)
    assert results["numpy"].keys() == results["native"].keys()
    for name, ref in results["numpy"].items():
        got = results["native"][name]
        if isinstance(ref, str):
            assert got == ref
            continue
        assert len(got) == len(ref) and all(np.array_equal(bits(g), bits(r)) for g, r in zip(got, ref)), name
    assert not nat.fallbacks, dict(nat.fallbacks)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("W, C", [(8, 512), (3, 40)])
def test_gather_with_counts_reads_the_counts_through_their_view(W, C, dt, monkeypatch):
    """BatchNormGatherStatsWithCounts views counts [W] as [W, 1] (after widening f16/bf16 counts
    to float32) over the [W, C] statistics: a pass reads the counts through that view (the load
    widens), so the C passes cover the body — numpy's bits, the running stats too."""
    reduce_limits_at(monkeypatch, 0)  # the passes, not the serial call
    rng = np.random.default_rng(15)
    t = DTYPES[dt]
    x = np.zeros((2, C, 3), t)
    mean, invstd = rng.standard_normal((W, C)).astype(t), rng.uniform(0.5, 2, (W, C)).astype(t)
    counts = rng.integers(1, 50, W).astype(t)
    running = rng.standard_normal(C).astype(t), rng.uniform(0.5, 2, C).astype(t)
    nat = backends.get("native")
    nat.fallbacks.clear()
    results = {}
    for be in ("numpy", "native"):
        rm, rv = (r.copy() for r in running)
        with opgraph.use_backend(be), opgraph.platform("Ascend910B"):
            outs = batch_norm_gather_stats_with_counts(x, mean, invstd, rm, rv, 0.1, 1e-5, counts)
        results[be] = [*outs, rm, rv]
    assert not np.array_equal(results["numpy"][2], running[0])  # the running stats moved
    for g, r in zip(results["native"], results["numpy"]):
        assert np.array_equal(bits(g), bits(r))
    assert not nat.fallbacks, dict(nat.fallbacks)



@pytest.mark.parametrize("n", [1, 2, 7])
@pytest.mark.parametrize("layout", ["dense", "transposed"])
@pytest.mark.parametrize("shape", [(2, 70, 9, 11), (3, 37, 20, 150), (5, 45, 7, 9), (2, 33, 32768 + 100),
                                   (4, 13, 50)], ids=lambda s: "x".join(map(str, s)))
def test_channel_groups_bits_equal_numpy(shape, layout, n, threads):
    """A channel-major pass takes its kept indices up to 16 at a time (16 from 64 of them, 8
    from 32, 2 from 8: four groups' worth), a stretch of reduced elements for each of them in
    turn (reduce_c: OPG_KG, opg_group): a last
    group of fewer, several blocks a channel, rows that are not a multiple of the 64 lanes,
    each channel's own per-channel register, strided data and any thread count keep every
    channel's order (large values among small ones: a change of order shows); so do the
    statistics' two passes, which share the item code and run a group at a time (up to 8: 8
    for the first three shapes, a last group of fewer included; 2 for 13 channels; one at a time
    for the long rows of 2×33×32868)."""
    threads(n)
    rng = np.random.default_rng(21)
    dy = rng.standard_normal(shape).astype(np.float32)
    dy.reshape(-1)[7::997] = 3e4
    x = (rng.standard_normal(shape[::-1]).astype(np.float32).T if layout == "transposed"
         else rng.standard_normal(shape).astype(np.float32))  # transposed: no dim has stride 1
    mean = rng.standard_normal(shape[1]).astype(np.float32).reshape(keep(shape))
    check_same(backward_body(shape, "f32"), [dy, x, mean])
    k, o = keep(shape), tuple(shape)  # Σ dy·(x − mean): the pass reads each channel's own mean
    centred = (Instr(op="sub", args=("in1", "in2"), dtype=F32),
               Instr(op="mul", args=("in0", "t0"), dtype=F32),
               Instr(op="sum", args=("t1",), dtype=F32, shape=k, over=o))
    check_same(FusedReduceAttrs(body=centred, results=("t2",), out_shapes=((shape[1],),)), [dy, x, mean])
    stats = stats_body(shape)
    check_same(stats, [dy])
    assert steps_of(stats, [dy]) == ["blocked"]


def epilogue_body(shape, out: D, square_sum: D):
    """Σx and Σx² (x² rounded to ``square_sum``, and so its sum) in one pass, then a
    per-channel epilogue: the mean, 1/sqrt(E[x²] − mean² + eps) rounded to ``out``."""
    k, o, C = keep(shape), tuple(shape), shape[1]
    n = float(np.float32(1.0 / (np.prod(shape) // C)))
    body = (Instr(op="cast", args=("in0",), dtype=F32),                     # t0
            Instr(op="sum", args=("t0",), dtype=F32, shape=k, over=o),      # t1
            Instr(op="mul", args=("t0", "t0"), dtype=F32),                  # t2
            Instr(op="cast", args=("t2",), dtype=square_sum),               # t3
            Instr(op="sum", args=("t3",), dtype=square_sum, shape=k, over=o),  # t4
            Instr(op="fill", dtype=F32, value=n),                           # t5
            Instr(op="mul", args=("t1", "t5"), dtype=F32),                  # t6: the mean
            Instr(op="mul", args=("t6", "t6"), dtype=F32),                  # t7
            Instr(op="cast", args=("t4",), dtype=F32),                      # t8
            Instr(op="mul", args=("t8", "t5"), dtype=F32),                  # t9
            Instr(op="sub", args=("t9", "t7"), dtype=F32),                  # t10: the variance
            Instr(op="fill", dtype=F32, value=1e-5),                        # t11
            Instr(op="add", args=("t10", "t11"), dtype=F32),                # t12
            Instr(op="sqrt", args=("t12",), dtype=F32),                     # t13
            Instr(op="fill", dtype=F32, value=1.0),                         # t14
            Instr(op="div", args=("t14", "t13"), dtype=F32),                # t15
            Instr(op="cast", args=("t15",), dtype=out),                     # t16
            Instr(op="view", args=("t6",), dtype=F32, shape=(C,)),          # t17
            Instr(op="view", args=("t16",), dtype=out, shape=(C,)))         # t18
    return FusedReduceAttrs(body=body, results=("t17", "t18"), out_shapes=((C,),) * 2)


@pytest.mark.parametrize("square_sum", [F32, F16, BF16], ids=["sq-f32", "sq-f16", "sq-bf16"])
@pytest.mark.parametrize("out", [F32, F16, BF16], ids=["out-f32", "out-f16", "out-bf16"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_the_epilogue_is_one_c_call_with_the_bits_of_numpy(dt, out, square_sum):
    """After the last pass the per-channel instructions run as one serial C call (the plan's
    ``tail``, the sums its inputs): the bits of the same plan's numpy steps and of the
    reference — sums rounded to a narrow dtype and results cast to one included, and NaN, ±inf,
    −0.0 and squares past the float16 range (inf, then 1/sqrt(inf) = 0)."""
    shape = (3, 16, 700)
    x = np.random.default_rng(16).standard_normal(shape).astype(np.float32) * 3
    x[:, 0] = -0.0
    x[1, 1, 17] = np.nan
    x[0, 2, 5] = np.inf
    x[:, 3] = 300.0  # x² = 90000: inf in float16, finite in bfloat16
    x[:, 4, ::2], x[:, 4, 1::2] = 1e-3, -1e-3
    x = x.astype(DTYPES[dt])
    a = epilogue_body(shape, out, square_sum)
    plan = plan_for(a, [x])
    assert plan.tail is not None and [st[0] for st in plan.steps[:plan.tail.at]] == ["pass"]
    with np.errstate(all="ignore"):
        in_c = check_same(a, [x])
        in_numpy = run_planned(dataclasses.replace(plan, tail=None), a, [x])
    assert all(np.array_equal(bits(p), bits(q)) for p, q in zip(in_c, in_numpy))
    assert np.signbit(in_c[0][0]) and np.isnan(in_c[0][1]) and in_c[0][2] == np.inf
    assert (in_c[1][3] == 0) == (square_sum == F16)  # 1/sqrt(inf) where x² is inf in float16


def test_an_epilogue_the_renderer_does_not_cover_stays_in_numpy():
    """An epilogue instruction the C renderer does not cover (pow by 3) leaves the plan without
    a tail: numpy runs the epilogue, with the reference's bits."""
    shape = (2, 8, 300)
    body = list(epilogue_body(shape, F32, F32).body)
    body[14] = Instr(op="fill", dtype=F32, value=3.0)
    body[15] = Instr(op="pow", args=("t13", "t14"), dtype=F32)
    a = FusedReduceAttrs(body=tuple(body), results=("t17", "t18"), out_shapes=((8,),) * 2)
    x = np.random.default_rng(17).standard_normal(shape).astype(np.float32)
    check_same(a, [x])
    assert plan_for(a, [x]).tail is None


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", [(40, 3, 49), (20, 5, 70), (9, 4, 79), (7, 3, 95), (6, 2, 196), (3, 2, 1000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_rows_from_any_lane_bits_equal_numpy(shape, dt):
    """Rows that start at any of the 64 lanes (49, 70, 79, 95, 196 elements): the scalar steps up
    to a lane that is a multiple of the vector width, then whole chunks and vectors, then the
    scalar tail, keep each lane's order — also where a row has room for a chunk (64) but not for
    those steps and a chunk (70, 79). Large values among small ones make a changed order show
    in the bits."""
    rng = np.random.default_rng(sum(shape))
    dy = rng.standard_normal(shape).astype(DTYPES[dt])
    dy.reshape(-1)[5::613] = 3e4 if dt != "f16" else 3e3
    x = rng.standard_normal(shape).astype(DTYPES[dt])
    mean = rng.standard_normal(shape[1]).astype(np.float32).reshape(keep(shape))
    check_same(backward_body(shape, dt), [dy, x, mean])
    check_same(stats_body(shape), [x])


def _before_a_guard_page(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` whose last byte is the last of a page, the next page inaccessible."""
    page = mmap.PAGESIZE
    pages = -(-a.nbytes // page)
    buf = mmap.mmap(-1, (pages + 1) * page)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(start + pages * page), page, 0) == 0
    out = np.frombuffer(buf, np.uint8, a.nbytes, pages * page - a.nbytes).view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", [(6, 4, 49), (300, 10)], ids=["rows", "channels-innermost"])
def test_rows_read_nothing_past_the_data(dt, shape):
    """The data end where an inaccessible page starts: the last row's last lanes (a 2-d input's
    last 10 channels), taken by one masked vector on AVX-512 (reduce_c._masked), read nothing
    past them. In a forked child, so that a fault fails this test rather than ending the run."""
    rng = np.random.default_rng(3)
    dy, x = (_before_a_guard_page(rng.standard_normal(shape).astype(DTYPES[dt])) for _ in range(2))
    mean = rng.standard_normal(shape[1]).astype(np.float32).reshape(keep(shape))

    def child() -> bool:
        check_same(backward_body(shape, dt), [dy, x, mean])
        check_same(stats_body(shape), [x])
        return True
    in_forked_child(child, "reducing data that end at an inaccessible page")


@pytest.mark.parametrize("shape, axes, keepdims", [((1, 8192), (1,), True), ((1, 8192), (1,), False),
                                                   ((2, 8192), (0, 1), True)])
def test_a_lower_rank_operand_that_varies_along_the_reduced_dim(shape, axes, keepdims):
    """Σ x·ch with ch[N] broadcast against x[R, N]: ch varies along the reduced dim, so it is
    streamed like x; it was taken for a per-kept register (one value per kept index) and the
    native run failed ('could not broadcast ... into shape (1,1)'; a helper's fuzz)."""
    g = Graph("lower_rank")
    x = g.add_input("x", TensorType(shape, D.FLOAT))
    ch = g.add_input("ch", TensorType((shape[1],), D.FLOAT))
    g.outputs = [g.add_node("ReduceSum", [g.add_node("Mul", [x, ch]).outputs[0]], axes=axes,
                            keepdims=keepdims).outputs[0]]
    opt = opgraph.passes.optimize(g, 2)
    rng = np.random.default_rng(3)
    data = {"x": rng.standard_normal(shape).astype(np.float32),
            "ch": rng.standard_normal(shape[1]).astype(np.float32)}
    got = {be: np.asarray(backends.get(be).run(opt, {k: opgraph.tensor(v) for k, v in data.items()})[
        opt.outputs[0].name]) for be in ("numpy", "native")}
    assert np.array_equal(bits(got["native"]), bits(got["numpy"]))
    exact = (data["x"].astype(np.float64) * data["ch"]).sum()
    assert abs(float(got["native"].ravel()[0]) - exact) <= 1e-4 * np.abs(data["x"] * data["ch"]).sum()
