"""The ascend-sim backend: hand-derived tilings, coverage, UB and padding findings, bit-equality
with the numpy backend, the unmodelled-platform errors and the ``opgraph tiling`` command.

Every expected tiling below was worked out on paper from the issue's rules; the comment above
each row shows the derivation (E = 512/sizeof(T), L = N rounded up to E, tileMax, cores, per,
doubling, buffers, tile, blocks/small/big, tile counts and tails).
"""
from __future__ import annotations

import math
import threading

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
import opgraph
from backends.ascend_sim import (AscendSimBackend, NotModelledError, TilingData, compute_tiling,
                                 run_kernel, simulate)
from opgraph.aclnn import aclnnBatchNormElemtBackward, aclnnBatchNormElemtBackwardGetWorkspaceSize
from opgraph.cli import main
from opgraph.core.ir import Graph, TensorType

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
UB_910B = 196608

# (N, T, T1, R) -> (TilingData fields in order, blockDim)
HAND = [
    # N=8 fp32, one block: E=128 L=128 tileMax=3072; cores=min(40, ceil(128/6144))=1, per=128;
    # no doubling (128 <= 768); 128 < 1536 -> one buffer; tile=128; blocks=1 small=128 tail=0
    # big=256; small: 1 tile, tail 128; big: ceil(256/128)=2 tiles, tail 256-128=128.
    ((8, "float32", None, 40), ((128, 256, 2, 1, 128, 128, 128, 0, 0), 1)),
    # shape 2,3,1,4 fp16: N=24 E=256 L=256 tileMax=6144; cores=1 per=256; one buffer; tile=256;
    # small=256 big=512 -> (1 tile, 256), (2 tiles, 256).
    ((24, "float16", None, 40), ((256, 512, 2, 1, 256, 256, 256, 0, 0), 1)),
    # exact multiple, doubled: N=5120 fp32: L=5120; cores=ceil(5120/6144)=1 per=5120; 1 < 40/4
    # and 5120 > 768 -> cores=2 per=2560; 2560 >= 1536 -> two buffers; tile=roundup(1280,128)
    # =1280; blocks=40 small=20*128=2560 tail=0 big=2688; small 2 tiles tail 1280; big
    # ceil(2688/1280)=3 tiles, tail 2688-2560=128.
    ((5120, "float32", None, 40), ((2560, 2688, 3, 2, 1280, 1280, 128, 0, 1), 2)),
    # same N, R=4: cores=1 is not < 4/4=1 -> no doubling; per=5120, two buffers,
    # tile=min(3072, 2560)=2560; small=5120 (2 tiles, 2560) big=5248 (3 tiles, 128).
    ((5120, "float32", None, 4), ((5120, 5248, 3, 2, 2560, 2560, 128, 0, 1), 1)),
    # doubling threshold: N=768 fp32 -> per=768 is not > 3072/4=768: no doubling; one buffer;
    # tile=768; small=768 (1, 768) big=896 (2, 128).
    ((768, "float32", None, 40), ((768, 896, 2, 1, 768, 768, 128, 0, 0), 1)),
    # N=896 fp32 -> per=896 > 768: cores=2 per=448; one buffer; tile=roundup(448,128)=512;
    # blocks=7 small=3*128=384 tail=1 big=512; (1 tile, 384), (1 tile, 512).
    ((896, "float32", None, 40), ((384, 512, 1, 1, 512, 384, 512, 1, 0), 2)),
    # double-buffer threshold, R=1 (never doubles): N=1408 -> per=1408 < 1536: one buffer,
    # tile=1408; small=1408 (1, 1408) big=1536 (2, 128).
    ((1408, "float32", None, 1), ((1408, 1536, 2, 1, 1408, 1408, 128, 0, 0), 1)),
    # N=1536 -> per=1536 is not < 1536: two buffers, tile=roundup(768,128)=768;
    # small=1536 (2, 768) big=1664 (3, 128).
    ((1536, "float32", None, 1), ((1536, 1664, 3, 2, 768, 768, 128, 0, 1), 1)),
    # tails: N=100000 fp16: E=256, 391 blocks, L=100096; cores=ceil(100096/12288)=9
    # per=ceil(100096/9)=11122; 9 < 10 and 11122 > 1536 -> cores=18 per=ceil(100096/18)=5561;
    # two buffers; tile=roundup(2781,256)=2816; small=(391//18)*256=21*256=5376 tail=391-378=13
    # big=5632; small ceil(5376/2816)=2 tiles, tail 2560; big 2 tiles, tail 2816.
    ((100000, "float16", None, 40), ((5376, 5632, 2, 2, 2816, 2560, 2816, 13, 1), 18)),
    # tile caps, R=1, N=65536. fp16/fp16: E=256, tile=min(6144, 32768)=6144; blocks=256
    # small=65536: ceil(65536/6144)=11 tiles, tail 65536-10*6144=4096; big=65792: 11, 4352.
    ((65536, "float16", None, 1), ((65536, 65792, 11, 11, 6144, 4096, 4352, 0, 1), 1)),
    # fp32/fp32: E=128, tile=3072; small=65536: 22 tiles, tail 65536-21*3072=1024;
    # big=65664: 22 tiles, tail 1152.
    ((65536, "float32", None, 1), ((65536, 65664, 22, 22, 3072, 1024, 1152, 0, 1), 1)),
    # fp16/fp32 (mixed): E=256 (from T) but tileMax=3072; small 22 tiles tail 1024;
    # big=65792: 22 tiles, tail 65792-64512=1280.  bf16/bf16: the same numbers.
    ((65536, "float16", "float32", 1), ((65536, 65792, 22, 22, 3072, 1024, 1280, 0, 1), 1)),
    ((65536, "bfloat16", None, 1), ((65536, 65792, 22, 22, 3072, 1024, 1280, 0, 1), 1)),
    # very large, 32*64*56*56 = 6422528 fp32: E=128, L=N (50176 blocks); cores=min(40, 1046)=40;
    # no doubling (40 is not < 10); two buffers; tile=3072; small=(50176//40)*128=1254*128
    # =160512, tail=50176-50160=16, big=160640; small ceil(160512/3072)=53 tiles, tail
    # 160512-52*3072=768; big 53 tiles, tail 896.
    ((32 * 64 * 56 * 56, "float32", None, 40), ((160512, 160640, 53, 53, 3072, 768, 896, 16, 1), 40)),
    # same N in fp16: E=256, 25088 blocks; cores=40; tile=6144; small=627*256=160512, tail=8,
    # big=160768; small ceil(160512/6144)=27 tiles, tail 768; big 27 tiles, tail 1024.
    ((32 * 64 * 56 * 56, "float16", None, 40), ((160512, 160768, 27, 27, 6144, 768, 1024, 8, 1), 40)),
]


@pytest.mark.parametrize("args,expected", HAND, ids=[f"{a[0]}-{a[1]}-{a[2]}-R{a[3]}" for a, _ in HAND])
def test_hand_computed_tilings(args, expected):
    n, t, t1, r = args
    tiling = compute_tiling(n, t, t1, cores=r)
    assert (tiling.data.as_tuple(), tiling.block_dim) == expected
    assert tiling.key == 0


def test_tiling_data_field_order():
    assert [k for k, _ in TilingData(*range(9)).items()] == [
        "smallCoreDataNum", "bigCoreDataNum", "finalBigTileNum", "finalSmallTileNum", "tileDataNum",
        "smallTailDataNum", "bigTailDataNum", "tailBlockNum", "usedDb"]


def test_core_ranges_big_cores_first():
    # N=100000 fp16: 13 big cores of 5632 from 0, then 5 small ones of 5376 packed after them.
    t = compute_tiling(100000, "float16", cores=40)
    cores = t.cores()
    assert [c.big for c in cores] == [True] * 13 + [False] * 5
    assert (cores[12].start, cores[12].stop) == (12 * 5632, 73216)
    assert (cores[13].start, cores[13].elements) == (73216, 5376)
    assert (cores[17].start, cores[17].stop) == (17 * 5632 - 256 * 4, 100096)


def test_ub_plan_fills_910b_exactly_at_the_cap():
    # At tileMax with two buffers each variant reserves exactly 192 KiB, e.g. fp32:
    # 2*(2*3072*4) + 2*(5*3072*4) + 2*(3072*4) = 49152 + 122880 + 24576 = 196608;
    # bf16: 24576 + 61440 + 12288 + 8*3072*4 = 196608; fp16/fp32: 24576 + 122880 + 12288 + 3*12288.
    for t, t1 in (("float16", None), ("float32", None), ("bfloat16", None), ("float16", "float32")):
        tiling = compute_tiling(65536, t, t1, cores=1)
        assert tiling.ub_bytes() == UB_910B, (t, t1)
    plan = {b.name: b.total for b in compute_tiling(65536, "bfloat16", cores=1).ub_plan()}
    assert plan == {"inQueueX": 24576, "inQueueParams": 61440, "outQueue": 12288, "floatTmp": 98304}


def test_bad_arguments():
    with pytest.raises(ValueError, match="no kernel for"):
        compute_tiling(8, "bfloat16", "float32", cores=1)
    with pytest.raises(ValueError, match="empty"):
        compute_tiling(0, "float32", cores=1)


# --- coverage property ---------------------------------------------------------------------------
PAIRS = [("float16", None), ("float32", None), ("bfloat16", None), ("float16", "float32")]


@settings(max_examples=150, deadline=None)
@given(n=st.one_of(st.integers(1, 5000), st.integers(1, 3_000_000)),
       pair=st.sampled_from(PAIRS), r=st.integers(1, 64))
def test_every_element_written_exactly_once(n, pair, r):
    t = compute_tiling(n, *pair, cores=r)
    d = t.data
    assert 1 <= t.block_dim <= r and t.padded % t.block_elems == 0
    assert 0 < d.tileDataNum <= t.tile_max and d.tileDataNum % t.block_elems == 0
    # the per-core ranges tile [0, L) with no gap and no overlap ...
    pos = 0
    for c in t.cores():
        assert c.start == pos and c.elements > 0
        assert 0 < c.tail <= d.tileDataNum and (c.tiles - 1) * d.tileDataNum + c.tail == c.elements
        pos = c.stop
    assert pos == t.padded
    # ... and the simulated kernel's write counter agrees: no double-write, nothing unwritten
    _, trace = run_kernel(t, None, ub_size=10**9)
    assert not trace.of("double-write") and not trace.of("unwritten")
    past = trace.of("write-past-end")
    assert [(f.start, f.stop) for f in past] == ([(n, t.padded)] if n % t.block_elems else [])
    assert len(trace.of("read-past-end")) == (7 if n % t.block_elems else 0)


def test_coverage_catches_a_broken_tiling():
    t = compute_tiling(896, "float32", cores=40)           # (384, 512, 1, 1, 512, 384, 512, 1, 0)
    broken = TilingData(384, 512, 1, 1, 512, 384, 512, 0, 0)  # tailBlockNum 1 -> 0
    _, trace = simulate(t, broken, 2, None, ub_size=UB_910B)
    # both cores small: [0, 384) and [384, 768); the last block is never written
    assert [(f.start, f.stop) for f in trace.of("unwritten")] == [(768, 896)]
    # bigTailDataNum 512 -> 640: core 0 writes [0, 640), core 1 still starts at 512
    _, trace = simulate(t, TilingData(384, 512, 1, 1, 512, 384, 640, 1, 0), 2, None, ub_size=UB_910B)
    assert [(f.start, f.stop) for f in trace.of("double-write")] == [(512, 640)]
    assert "written up to 2 times" in str(trace)
    _, trace = simulate(t, TilingData(512, 512, 1, 1, 512, 512, 512, 0, 0), 2, None, ub_size=UB_910B)
    assert trace.of("unwritten") == [] and trace.of("write-past-end")[0].stop == 1024


# --- bit equality with the numpy backend --------------------------------------------------------
def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def bn_arrays(shape, dtypes, out_dtype, seed=0):
    rng = np.random.default_rng(seed)
    C = shape[1]
    vals = {"gradOut": rng.standard_normal(shape), "input": rng.standard_normal(shape),
            "mean": rng.normal(0, 0.5, C), "invstd": rng.uniform(0.5, 2, C),
            "weight": rng.uniform(0.5, 1.5, C), "sumDy": rng.standard_normal(C),
            "sumDyXmu": rng.standard_normal(C), "counter": rng.integers(1, 9, C)}
    out = {k: np.asarray(v).astype(dtypes.get(k, dtypes["*"])) for k, v in vals.items()}
    out["counter"] = out["counter"].astype(np.int32)
    out["gradInput"] = np.zeros(shape, out_dtype)
    return out


def run_aclnn(arrays, backend: "str | AscendSimBackend") -> np.ndarray:
    """Both phases on copies of ``arrays``; phase 2 on a registered backend name, or straight on
    a backend instance (``instance.run(executor.compiled, ...)``)."""
    a = {k: v.copy() for k, v in arrays.items()}
    names = ("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter", "gradInput")
    st_, ws, ex = aclnnBatchNormElemtBackwardGetWorkspaceSize(*(opgraph.tensor(a[k]) for k in names))
    assert st_ == 0 and any(n.op == "SyncBatchNormBackwardElemt" for n in ex.compiled.nodes)
    if isinstance(backend, str):
        with opgraph.use_backend(backend):
            assert aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex) == 0
    else:
        backend.run(ex.compiled, ex.bindings, bytearray(ws) if ws else None)
    return a["gradInput"]


@pytest.mark.parametrize("lvl", [0, 1])
@pytest.mark.parametrize("name,dtypes,out_dtype", [
    ("fp32", {"*": F32}, F32),
    ("fp16", {"*": F16}, F16),
    ("bf16", {"*": BF16}, BF16),
    ("mixed", {"*": F16, "weight": F32, "mean": BF16}, BF16),
])
@pytest.mark.parametrize("shape", [(2, 3, 1, 4), (4, 16, 40, 41), (3, 7, 1000)])
def test_bit_identical_to_numpy_via_aclnn(lvl, name, dtypes, out_dtype, shape):
    arrays = bn_arrays(shape, dtypes, out_dtype)
    with opgraph.opt_level(lvl):
        ref = run_aclnn(arrays, "numpy")
        got = run_aclnn(arrays, "ascend-sim")
    np.testing.assert_array_equal(bits(got), bits(ref))
    trace = backends.get("ascend-sim").last_trace
    assert trace is not None and trace.tiling.numel == math.prod(shape)
    assert not trace.of("double-write") and not trace.of("unwritten") and not trace.of("ub-overflow")


def kernel_graph(n: int, t: np.dtype, t1: np.dtype) -> Graph:
    """A graph with one SyncBatchNormBackwardElemt node of (T, T1) — including the bf16/bf16 and
    fp16/fp32 variants the op_api never emits — and its output as the graph output."""
    g = Graph("kernel")
    ins = [g.add_input(k, TensorType((n,), opgraph.dtype_of(t if i < 2 else t1)))
           for i, k in enumerate(("go", "x", "mean", "invstd", "w", "mdy", "mdyx"))]
    g.outputs = [g.add_node("SyncBatchNormBackwardElemt", ins, arch=2201).outputs[0]]
    return g


@pytest.mark.parametrize("t,t1", [(F16, F16), (F32, F32), (BF16, BF16), (F16, F32)])
@pytest.mark.parametrize("n", [1, 300, 12345, 70001])
def test_template_paths_bit_identical(t, t1, n):
    rng = np.random.default_rng(n)
    vals = [rng.standard_normal(n) * s for s in (1, 1, 0.5, 1, 1, 0.1, 0.1)]
    vals[3] = rng.uniform(0.5, 2, n)
    binds = {k: opgraph.tensor(v.astype(t if i < 2 else t1)) for i, (k, v) in
             enumerate(zip(("go", "x", "mean", "invstd", "w", "mdy", "mdyx"), vals))}
    g = kernel_graph(n, t, t1)
    ref = backends.get("numpy").evaluate(g, binds)
    sim = AscendSimBackend()
    got = sim.evaluate(g, binds)
    (k,) = ref
    assert got[k].dtype == t
    np.testing.assert_array_equal(bits(got[k]), bits(ref[k]))
    assert sim.traces[-1].tiling.path == ("float" if (t, t1) in ((BF16, BF16), (F16, F32)) else "direct")


def test_very_large_tensor_bit_identical():
    n = 32 * 64 * 56 * 56
    rng = np.random.default_rng(7)
    binds = {k: opgraph.tensor(rng.uniform(0.5, 2, n).astype(F16))
             for k in ("go", "x", "mean", "invstd", "w", "mdy", "mdyx")}
    g = kernel_graph(n, F16, F16)
    (ref,) = backends.get("numpy").evaluate(g, binds).values()
    sim = AscendSimBackend()
    (got,) = sim.evaluate(g, binds).values()
    np.testing.assert_array_equal(bits(got), bits(ref))
    trace = sim.last_trace
    assert len(sim.traces) == 1 and trace.ok and trace.tiling.block_dim == 40
    assert sum(c.tiles for c in trace.cores) == 40 * 27


# --- findings ------------------------------------------------------------------------------------
def test_padded_reads_are_findings():
    # shape 2,3,1,4 fp32: N=24, E=128 -> the one tile reads [24, 128) of all seven inputs and
    # writes [24, 128) of gradInput; 104 elements * 4 B = 416 B each.
    arrays = bn_arrays((2, 3, 1, 4), {"*": F32}, F32)
    with opgraph.opt_level(0):
        run_aclnn(arrays, "ascend-sim")
    trace = backends.get("ascend-sim").last_trace
    reads = trace.of("read-past-end")
    assert [f.tensor for f in reads] == ["gradOut", "input", "mean", "invstd", "weight", "meanDy",
                                         "meanDyXmu"]
    assert {(f.start, f.stop, f.nbytes, f.core, f.tile) for f in reads} == {(24, 128, 416, 0, 0)}
    (w,) = trace.of("write-past-end")
    assert (w.tensor, w.start, w.stop) == ("gradInput", 24, 128)
    assert "read-past-end" in str(trace) and "beyond the tensor's end" in str(trace)


def test_exact_multiple_has_no_findings():
    arrays = bn_arrays((2, 4, 16, 16), {"*": F16}, F16)        # N=2048 = 8 blocks of 256
    with opgraph.opt_level(1):
        run_aclnn(arrays, "ascend-sim")
    trace = backends.get("ascend-sim").last_trace
    assert trace.ok and "findings: none" in str(trace)


def test_ub_overflow_is_reported_not_raised():
    arrays = bn_arrays((4, 8, 32, 32), {"*": F32}, F32)
    with opgraph.opt_level(0):
        ref = run_aclnn(arrays, "numpy")
        sim = AscendSimBackend(cores=3, ub_size=1024)
        got = run_aclnn(arrays, sim)
    np.testing.assert_array_equal(bits(got), bits(ref))
    trace = sim.last_trace
    assert trace.tiling.cores_available == 3 and trace.tiling.block_dim == 3
    (f,) = trace.of("ub-overflow")
    assert "1024 B" in str(f) and all(c.peak_ub > 1024 for c in trace.cores)


def test_trace_per_core_accounting():
    # N=5120 fp32 on 40 cores: 2 cores x 2560 elements; 2 tiles of 1280 each; bytes in per core
    # = 2560 * 7 * 4, out = 2560 * 4; UB = 2*(2*1280*4) + 2*(5*1280*4) + 2*(1280*4) = 81920.
    t = compute_tiling(5120, "float32", cores=40)
    _, trace = run_kernel(t, None, ub_size=UB_910B, soc="Ascend910B")
    assert [(c.start, c.elements, c.tiles, c.bytes_in, c.bytes_out, c.peak_ub) for c in trace.cores] == \
        [(0, 2560, 2, 71680, 10240, 81920), (2560, 2560, 2, 71680, 10240, 81920)]
    text = str(trace)
    assert "blockDim 2 of R=40" in text and "findings: none" in text


# --- platforms -----------------------------------------------------------------------------------
def test_ascend950_run_is_a_clear_error():
    arrays = bn_arrays((2, 3, 4), {"*": F32}, F32)
    names = ("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter", "gradInput")
    with opgraph.platform("Ascend950"), opgraph.opt_level(0):
        st_, ws, ex = aclnnBatchNormElemtBackwardGetWorkspaceSize(*(opgraph.tensor(arrays[k]) for k in names))
        with opgraph.use_backend("ascend-sim"):
            status = aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex)
    # phase 2 turns the backend's NotModelledError into a runtime-error status with its message
    assert status == opgraph.Status.ACLNN_ERR_RUNTIME_ERROR
    msg = opgraph.aclnn.aclGetRecentErrMsg()
    assert f"{NotModelledError.__name__}: ascend-sim models the DAV_2201 kernel only; " \
           "Ascend950's DAV_3510 kernel is not modelled" in msg
    assert not arrays["gradInput"].any()  # refused before any side effect


def test_ascend910_uses_its_own_cores():
    arrays = bn_arrays((8, 16, 64, 64), {"*": F16}, F16)
    with opgraph.platform("Ascend910"), opgraph.opt_level(0):
        ref = run_aclnn(arrays, "numpy")
        got = run_aclnn(arrays, "ascend-sim")
    np.testing.assert_array_equal(bits(got), bits(ref))
    trace = backends.get("ascend-sim").last_trace
    assert (trace.soc, trace.tiling.cores_available, trace.ub_size) == ("Ascend910", 32, 262144)


# --- CLI -----------------------------------------------------------------------------------------
def cli(capsys, *argv):
    code = main(["tiling", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_tiling_printout(capsys):
    code, out, _ = cli(capsys, "--shape", "100000", "--dtype", "float16")
    assert code == 0
    fields = [line.split() for line in out.splitlines() if line.startswith("  ") and
              line.split()[0] in dict(TilingData(*range(9)).items())]
    assert fields == [["smallCoreDataNum", "5376"], ["bigCoreDataNum", "5632"],
                      ["finalBigTileNum", "2"], ["finalSmallTileNum", "2"], ["tileDataNum", "2816"],
                      ["smallTailDataNum", "2560"], ["bigTailDataNum", "2816"],
                      ["tailBlockNum", "13"], ["usedDb", "1"]]
    assert "blockDim 18, tiling key 0" in out
    assert "[94720, 100096)" in out and "UB per core: 90112 B of 196608 B" in out
    assert "read-past-end" in out and "[100000, 100096)" in out


def test_cli_overrides_and_ub_overflow(capsys):
    code, out, _ = cli(capsys, "--shape", "2,3,1,4", "--dtype", "float16", "--param-dtype",
                       "float32", "--cores", "8", "--ub", "64")
    assert code == 0
    assert "8 vector cores, UB 64 B (cores override) (UB override)" in out
    assert "OVERFLOW" in out and "ub-overflow" in out


@pytest.mark.parametrize("soc,msg", [
    ("Ascend950", "ascend-sim models the DAV_2201 kernel only; Ascend950's DAV_3510 kernel is not modelled"),
    ("Ascend310P", "Ascend310P (DAV_2002) has no SyncBatchNormBackwardElemt kernel"),
])
def test_cli_unmodelled_platforms(capsys, soc, msg):
    code, out, err = cli(capsys, "--shape", "2,3,1,4", "--platform", soc)
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and msg in err


def test_cli_run_trace(capsys):
    code = main(["run", "aclnnBatchNormElemtBackward", "--shape", "2,3,1,4", "--dtype", "float16",
                 "--backend", "ascend-sim", "--level", "1", "--trace"])
    out = capsys.readouterr().out
    assert code == 0
    assert "ascend-sim SyncBatchNormBackwardElemt f16/f16 (direct path) on Ascend910B" in out
    assert "smallCoreDataNum=256" in out and "findings: 8" in out


def test_cli_run_on_ascend_sim_defaults_to_what_cann_launches(capsys):
    assert main(["run", "aclnnBatchNormElemtBackward", "--shape", "8,16,7,7",
                 "--backend", "ascend-sim", "--trace"]) == 0
    out = capsys.readouterr().out
    assert "opt level 1" in out and "blockDim 4 of R=40" in out and "findings: none" in out


def test_coverage_counts_writes_past_a_cores_range():
    # finalSmallTileNum 1 -> 2 on N=896 fp32: the small core 1 writes 512 + 384 elements from 512,
    # past its range and past the padded end, and nothing is double-written.
    t = compute_tiling(896, "float32", cores=40)
    _, trace = simulate(t, TilingData(384, 512, 1, 2, 512, 384, 512, 1, 0), 2, None, ub_size=UB_910B)
    assert [(w.start, w.stop, w.core, w.tile) for w in trace.of("write-past-end")] == [
        (896, 1024, 1, 0), (1024, 1408, 1, 1)]
    assert not trace.of("double-write") and not trace.of("unwritten")


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_level_2_fuses_the_kernel_away_and_runs_numpys_bits_without_a_trace(soc):
    """As the README says: the simulation needs the vendor kernel in the graph (levels 0 and 1);
    level 2's fused kernel has no vendor counterpart, so the graph runs on numpy, untraced — on
    the Ascend950 too, whose DAV_3510 kernel levels 0 and 1 refuse as unmodelled."""
    rng = np.random.default_rng(3)
    x, dy = (rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(2))
    c = [rng.random(3).astype(np.float32) + 0.5 for _ in range(5)]
    args = (dy, x, *c, np.full(1, 8, np.int32))
    with opgraph.platform(soc), opgraph.opt_level(2):
        with opgraph.use_backend("numpy"):
            want = opgraph.ops.batch_norm_elemt_backward(*args)
        with opgraph.use_backend("ascend-sim"):
            got = opgraph.ops.batch_norm_elemt_backward(*args)
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))
    assert backends.get("ascend-sim").last_trace is None
    with opgraph.platform(soc), opgraph.opt_level(1), opgraph.use_backend("ascend-sim"):
        if soc == "Ascend950":
            with pytest.raises(opgraph.AclnnError, match="NotModelledError"):
                opgraph.ops.batch_norm_elemt_backward(*args)
        else:
            assert np.array_equal(opgraph.ops.batch_norm_elemt_backward(*args).view(np.uint32),
                                  want.view(np.uint32))
            assert backends.get("ascend-sim").last_trace is not None


def test_traces_are_each_threads_last_run():
    """A run on another thread leaves this thread's traces be (runs on two threads at once put
    their traces into one another's lists, or emptied them)."""
    sim = backends.get("ascend-sim")
    arrays = {shape: bn_arrays(shape, {"*": F32}, F32) for shape in [(2, 3, 1, 4), (3, 5, 77)]}

    def run(shape) -> None:
        with opgraph.opt_level(1):  # (a context variable: each thread sets its own)
            run_aclnn(arrays[shape], "ascend-sim")
    run((2, 3, 1, 4))
    other = threading.Thread(target=run, args=((3, 5, 77),))
    other.start()
    other.join()
    assert [t.tiling.numel for t in sim.traces] == [24] and sim.last_trace is sim.traces[0]
    seen = []
    other = threading.Thread(target=lambda: seen.append((sim.traces, sim.last_trace)))
    other.start()
    other.join()
    assert seen == [([], None)]  # a thread that ran nothing has no trace
