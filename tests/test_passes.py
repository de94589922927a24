"""Passes: pruning (level 1 = what CANN launches), fusion (level 2), the pass manager and its
instruments, the memory planner, the executor cache and the opt-in fast-math rewrite."""
from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

import l0ops
from l0ops.interpreter import CHUNK_ELEMS
import backends
import opgraph
from backends import get as get_backend, native
from opgraph import passes
from opgraph.aclnn import aclnnBatchNormElemtBackward as run_phase2
from opgraph.aclnn import aclnnBatchNormElemtBackwardGetWorkspaceSize as phase1
from opgraph.aclnn.cache import EXECUTOR_CACHE
from opgraph.cli import main
from opgraph.core.dtypes import DataType
from opgraph.core.ir import Graph, TensorType
from opgraph.core.memory import plan_memory
from opgraph.passes.prune import merged_unsqueeze_dims

F32, F16 = DataType.FLOAT, DataType.FLOAT16


def record(shape=(2, 3, 4, 5), dtype=np.float32, pdtype=None, weight=True, counter=np.int32,
           out_dtype=None, platform="Ascend910B", seed=0):
    rng = np.random.default_rng(seed)
    pdtype = pdtype or dtype
    C = shape[1]
    arrays = [rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype),
              rng.standard_normal(C).astype(pdtype), (rng.random(C) + 0.5).astype(pdtype),
              rng.standard_normal(C).astype(pdtype) if weight else None,
              rng.standard_normal(C).astype(pdtype), rng.standard_normal(C).astype(pdtype),
              np.asarray([3, 4], dtype=counter)]
    out = np.zeros(shape, out_dtype or dtype)
    with opgraph.platform(platform), opgraph.opt_level(0):
        st, _, ex = phase1(*[None if a is None else opgraph.tensor(a) for a in arrays], opgraph.tensor(out))
    assert st == 0, opgraph.aclnn.aclGetRecentErrMsg()
    return ex, arrays, out


def launched(g: Graph) -> list[str]:
    return [n.op for n in g.nodes if not n.opdef.is_free(n)]


def run_graph(g: Graph, ex) -> None:
    backends.get("numpy").run(g, ex.bindings)


# --- level 1 ---------------------------------------------------------------------------------
def test_level1_launches_exactly_the_ten_cann_kernels():
    ex, _, _ = record()
    g1 = passes.optimize(ex.graph, 1)
    assert launched(g1) == ["Cast", "ReduceSum", "RealDiv", "RealDiv"] + ["BroadcastTo"] * 5 + \
        ["SyncBatchNormBackwardElemt"]
    viewcopy = [n for n in g1.nodes if n.op == "ViewCopy"]
    assert len(viewcopy) == 1 and viewcopy[0].attrs.redirect
    assert not any(n.op == "Contiguous" for n in g1.nodes)
    assert sum(n.op == "UnsqueezeNd" for n in g1.nodes) == 5  # each chain merged into one view
    # level 0 also launches the ViewCopy (a TensorMove), level 1 does not
    assert len(launched(passes.optimize(ex.graph, 0))) == 11


def test_strided_input_keeps_its_contiguous_copy():
    ex, arrays, _ = record()
    x = np.ascontiguousarray(np.swapaxes(arrays[0], 2, 3)).swapaxes(2, 3)  # same values, strided
    st, _, ex2 = phase1(opgraph.tensor(x), *[opgraph.tensor(a) for a in arrays[1:]],
                        opgraph.tensor(np.zeros_like(arrays[0])))
    assert st == 0
    g1 = passes.optimize(ex2.graph, 1)
    assert launched(g1).count("Contiguous") == 1


def test_null_weight_fill_is_a_kernel_at_level1_and_folded_at_level2():
    ex, _, _ = record(weight=False)
    g1 = passes.optimize(ex.graph, 1)  # what CANN launches: FillScalar(C, 1), then its broadcast
    fills = [n for n in g1.nodes if n.op == "Fill"]
    assert len(fills) == 1 and fills[0].outputs[0].shape == (3,)
    assert launched(g1).count("BroadcastTo") == 5
    g2 = passes.optimize(ex.graph, 2)
    assert "fill(1.0)" in str(g2) and "Fill" not in [n.op for n in g2.nodes]


def test_merged_unsqueeze_dims():
    assert merged_unsqueeze_dims(1, (0,), (2, 3)) == (0, 2, 3)
    assert merged_unsqueeze_dims(2, (1,), (0,)) == (0, 2)
    assert merged_unsqueeze_dims(1, (-1,), (0,)) == (0, 2)


def test_cse_merges_duplicates_and_dce_keeps_effects():
    g = Graph("cse")
    x = g.add_input("x", TensorType((4,), F32))
    y = g.add_input("y", TensorType((4,), F16))
    a = l0ops.Cast(g, x, to=F16)
    b = l0ops.Cast(g, x, to=F16)
    l0ops.ViewCopy(g, b, y)  # an effect whose result nobody uses
    g.outputs = [a]
    out, stats = passes.cse.run(g)
    assert stats.counts["merged"] == 1
    assert [n.op for n in out.nodes] == ["Cast", "ViewCopy"]
    out2, _ = passes.dce.run(out)
    assert [n.op for n in out2.nodes] == ["Cast", "ViewCopy"]


# --- level 2 ---------------------------------------------------------------------------------
def test_level2_is_one_fused_kernel_with_zero_workspace():
    ex, _, _ = record()
    g2 = passes.optimize(ex.graph, 2)
    assert [n.op for n in g2.nodes] == ["FusedElementwise"]
    node = g2.nodes[0]
    assert node.attrs.store and node.inputs[-1].name == "gradInput"
    text = str(g2)
    assert "sum(" in text and "div(" in text and "store" in text
    assert plan_memory(g2).size == 0
    stats = [passes.graph_stats(passes.optimize(ex.graph, n)) for n in (0, 1, 2)]
    assert stats[2].bytes_moved < stats[1].bytes_moved < stats[0].bytes_moved
    assert stats[1].workspace > 0 and stats[2].workspace == 0


def test_per_channel_terms_are_hoisted():
    ex, _, _ = record(shape=(2, 3, 40, 50))
    node = passes.optimize(ex.graph, 2).nodes[0]
    h = l0ops.interpreter.Hoisted(node.attrs, [ex.bindings[v.name].view() for v in node.inputs[:-1]])
    live_ops = [ins.op for _, ins in h.live]
    assert live_ops.count("mul") == 3 and live_ops.count("sub") == 3  # invstd²·meanDyXmu hoisted
    assert all(ins.op not in ("sum", "div", "view") for _, ins in h.live)


def test_mixed_variant_cast_folding_keeps_bits():
    ex, _, out = record(dtype=np.float16, pdtype=np.float32)
    g1 = passes.optimize(ex.graph, 1)
    g1v, stats = passes.op_rewrites().run(g1)
    assert stats.counts["f16-f32-variant"] == 1
    k = next(n for n in g1v.nodes if n.op == "SyncBatchNormBackwardElemt")
    assert (k.inputs[0].dtype, k.inputs[2].dtype, k.outputs[0].dtype) == (F16, F32, F16)
    run_graph(g1, ex)
    want = out.copy()
    out[...] = 0
    run_graph(g1v, ex)
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("platform", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_levels_bit_identical_with_strided_output(platform, dtype):
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    ex, arrays, _ = record(shape=(3, 4, 5, 6), dtype=dt, platform=platform)
    results = []
    for level in (0, 1, 2):
        storage = np.full(3 * 4 * 6 * 5 * 2, 7, dt)
        view = opgraph.Tensor(storage, (3, 4, 5, 6), (240, 60, 2, 10), offset=1)
        with opgraph.platform(platform), opgraph.opt_level(level):
            st, ws, ex2 = phase1(*[None if a is None else opgraph.tensor(a) for a in arrays], view)
            assert st == 0 and run_phase2(bytearray(ws) if ws else None, ws, ex2) == 0
        touched = np.zeros(storage.size, bool)
        touched[1 + np.add.outer(np.add.outer(np.add.outer(np.arange(3) * 240, np.arange(4) * 60),
                                              np.arange(5) * 2), np.arange(6) * 10).ravel()] = True
        assert np.all(storage[~touched] == dt(7))
        results.append(storage.view(np.uint8).copy())
    assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2])


# --- pass manager ----------------------------------------------------------------------------
def test_verify_instrument_names_the_failing_pass():
    def corrupt(g):
        node = g.nodes[0]
        node.outputs[0].type = node.outputs[0].type.with_(dtype=DataType.INT8)
        return {"corrupted": 1}
    ex, _, _ = record()
    bad = passes.FunctionPass("corrupt-types", corrupt)
    with pytest.raises(passes.PassError, match=r"pass 1 \(corrupt-types\)"):
        passes.PassManager([passes.identities, bad]).run(ex.graph)


def test_dump_print_and_timing_instruments(tmp_path, capsys):
    ex, _, _ = record()
    dump = passes.DumpInstrument(str(tmp_path))
    timing = passes.TimingInstrument()
    out, stats = passes.PassManager(passes.pipeline(2), [dump, timing, passes.PrintInstrument()]).run(ex.graph)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0] == "00-input.dot" and "01-prune-identities.json" in names
    assert len(names) == 3 * (len(passes.pipeline(2)) + 1)
    assert Graph.from_json((tmp_path / "01-prune-identities.json").read_text()) is not None
    assert [t[0] for t in timing.times] == [p.name for p in passes.pipeline(2)]
    printed = capsys.readouterr().out
    assert "// after pass 00 prune-identities: identity-contiguous=8," in printed
    assert stats[0].counts["identity-cast"] > 0


def test_default_pipelines_are_bit_exact_and_fast_math_is_opt_in():
    for level in passes.LEVELS:
        assert all(p.bit_exact for p in passes.pipeline(level))
    fm = passes.fast_math_pass()
    assert not fm.bit_exact and "fast-math" in fm.name
    assert [p.name for p in passes.pipeline(2, fast_math=True)].count("fast-math") == 1
    assert all(p.name != "fast-math" for level in passes.LEVELS for p in passes.pipeline(level))


def test_fast_math_error_within_documented_bound():
    ex, arrays, out = record(shape=(4, 3, 8, 8))
    g = passes.optimize(ex.graph, 2, fast_math=True)
    run_graph(g, ex)
    go, x, mu, inv, w, sdy, sdx, cnt = [a.astype(np.float64) for a in arrays]
    b = (1, -1, 1, 1)
    total = cnt.sum()
    A = (inv * w).reshape(b)
    B = -(inv ** 2 * (sdx / total)).reshape(b) * A
    D = ((mu * inv ** 2 * (sdx / total)).reshape(b) - (sdy / total).reshape(b)) * A
    exact = go * A + x * B + D
    parts = np.abs(mu.reshape(b) * B) + np.abs((sdy / total).reshape(b) * A)  # D's, apart
    bound = 8 * np.finfo(np.float32).eps * (np.abs(go * A) + np.abs(x * B) + parts)
    assert np.all(np.abs(out - exact) <= bound)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_fast_math_compiles_half_precision_graphs(dtype):
    """The affine body of a float16/bfloat16 kernel ends with its cast back (once defined after
    the body was taken, so the result register was undefined); tests/test_fast_math.py bounds
    its error."""
    ex, arrays, out = record(shape=(4, 3, 8, 8), dtype=dtype)
    g = passes.optimize(ex.graph, 2, fast_math=True)
    fused = [n for n in g.nodes if n.op == "FusedElementwise"]
    assert len(fused) == 1 and fused[0].attrs.body[-1].op == "cast"
    run_graph(g, ex)
    assert out.dtype == dtype and np.all(np.isfinite(out.astype(np.float32)))


# --- memory planner --------------------------------------------------------------------------
def test_memory_planner_reuses_dead_buffers_and_aligns():
    g = Graph("chain")
    x = g.add_input("x", TensorType((100,), F32))
    a = l0ops.Cast(g, x, to=F16)            # 200 B -> 512
    b = l0ops.Cast(g, a, to=F32)            # 400 B -> 512, a still live
    c = l0ops.Cast(g, b, to=F16)            # a is dead now: c may reuse a's slot
    g.outputs = [l0ops.Cast(g, c, to=F32)]
    plan = plan_memory(g)
    assert all(off % 512 == 0 for off, _ in plan.offsets.values())
    assert plan.offsets[a.name][0] != plan.offsets[b.name][0]
    assert plan.offsets[c.name][0] == plan.offsets[a.name][0]
    assert plan.size == 1024


# --- executor cache --------------------------------------------------------------------------
def test_executor_cache_hits_and_rebinds_data():
    EXECUTOR_CACHE.clear()
    ex, arrays, out = record()
    with opgraph.opt_level(0):
        run_phase2(bytearray(ex.workspace_size), ex.workspace_size, ex)
    ref = out.copy()
    results = []
    for scale in (1.0, 2.0):
        data = [None if a is None else (a * scale).astype(a.dtype) if a.dtype.kind == "f" else a
                for a in arrays]
        o = np.zeros_like(out)
        st, ws, ex2 = phase1(*[None if a is None else opgraph.tensor(a) for a in data], opgraph.tensor(o))
        assert st == 0 and run_phase2(bytearray(ws) if ws else None, ws, ex2) == 0
        results.append(o)
    assert EXECUTOR_CACHE.hits == 1 and EXECUTOR_CACHE.misses == 2  # level 0 miss, level 2 miss+hit
    assert np.array_equal(results[0], ref)
    assert not np.array_equal(results[1], ref)
    # a different NULL pattern or different strides is a different entry
    data = [opgraph.tensor(a) for a in arrays]
    data[4] = None
    phase1(*data, opgraph.tensor(np.zeros_like(out)))
    assert EXECUTOR_CACHE.misses == 3


def test_executor_cache_is_thread_safe():
    EXECUTOR_CACHE.clear()
    ex, arrays, out = record()
    expected = {}
    errors = []

    def worker(k):
        try:
            data = [a if a is None or a.dtype.kind != "f" else (a + k).astype(a.dtype) for a in arrays]
            o = np.zeros_like(out)
            for _ in range(20):
                st, ws, e = phase1(*[opgraph.tensor(a) for a in data], opgraph.tensor(o))
                assert st == 0 and run_phase2(bytearray(ws) if ws else None, ws, e) == 0
            expected[k] = (data, o)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k, (data, o) in expected.items():
        single = opgraph.ops.batch_norm_elemt_backward(*data)
        assert np.array_equal(single, o)


# --- CLI -------------------------------------------------------------------------------------
def test_cli_dump_stats_passes_and_dump_dir(capsys, tmp_path):
    args = ["dump", "aclnnBatchNormElemtBackward", "--shape", "4,8,5,5", "--counter-dtype", "int32"]
    assert main(args + ["--stats"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["level", "nodes", "launches", "bytes", "moved", "workspace"]
    assert [r[0] for r in rows[1:]] == ["0", "1", "2"]
    assert rows[2][2] == "10" and rows[3][2] == "1" and rows[3][4] == "0"  # CANN's 10; fused: 1, 0 B
    assert main(args + ["--level", "2", "--passes"]) == 0
    out = capsys.readouterr().out
    stems = [f"{i + 1:02d}-{p.name}" for i, p in enumerate(passes.pipeline(2))]  # --dump-dir's
    assert sum(f"// {s}:" in out or s in out.split("// unchanged: ")[-1] for s in stems) == len(stems)
    assert "+++ 03-fuse-elementwise.txt" in out and "FusedElementwise" in out
    assert main(args + ["--level", "1", "--dump-dir", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 3 * (len(passes.pipeline(1)) + 1) and files[-1].startswith(f"{len(passes.pipeline(1)):02d}-viewcopy-redirect")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_chunked_fused_execution_matches_level0_and_leaves_inputs_alone(dtype):
    """A shape several chunks large: the chunk loop, temporaries reused in place and the direct
    store into the output give level 0's bits and never write an input."""
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    shape = (3, 5, 70, 130)
    assert np.prod(shape) > 3 * CHUNK_ELEMS
    ex, arrays, _ = record(shape=shape, dtype=dt)
    before = [None if a is None else a.copy() for a in arrays]
    outs = []
    for level in (0, 2):
        out = np.zeros(shape, dt)
        with opgraph.opt_level(level):
            st, ws, e = phase1(*[None if a is None else opgraph.tensor(a) for a in arrays], opgraph.tensor(out))
            assert st == 0 and run_phase2(bytearray(ws) if ws else None, ws, e) == 0
        outs.append(out.view(np.uint8))
    assert np.array_equal(outs[0], outs[1])
    for a, b in zip(arrays, before):
        assert a is None or np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("first", [0.0, -0.0])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_signed_zero_constants_stay_apart(first, level):
    """``-0.0 == 0.0``, but x / -0.0 is -inf: neither the attribute memo nor CSE may take one
    constant for the other (they did: the second Fill got the first one's attrs)."""
    g = Graph("zeros")
    x = g.add_input("x", TensorType((4,), DataType.FLOAT))
    zeros = (first, -first)
    g.outputs = [g.add_node("RealDiv", [x, g.add_node("Fill", [], shape=(4,), value=v,
                                                        dtype=DataType.FLOAT).outputs[0]]).outputs[0]
                 for v in zeros]
    assert [n.attrs.value for n in g.nodes if n.op == "Fill"] == list(zeros)
    assert [str(n.attrs.value) for n in g.nodes if n.op == "Fill"] == [str(v) for v in zeros]
    opt = passes.optimize(g, level)
    for name in ["numpy"] + (["native"] if native.available() else []):
        got = get_backend(name).run(opt, {"x": opgraph.tensor(np.ones(4, np.float32))})
        want = [np.full(4, np.copysign(np.inf, v), np.float32) for v in zeros]
        assert all(np.array_equal(got[v.name], w) for v, w in zip(opt.outputs, want)), (name, got)
