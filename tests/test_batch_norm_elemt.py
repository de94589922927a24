"""aclnnBatchNormElemt and its kernels BNInfer (910B) / BatchNormV3 inference (950): the vendor's
check table row by row (status, a message naming the argument, the output untouched), the l0
graph op by op on both SoC families, the quirks (561103 for another output dtype), empty tensors,
the ranks viewed as 4-D/5-D, what level 1 launches and level 2 fuses (the numerics:
test_batch_norm_elemt_numerics.py)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import aclnn, passes
from opgraph.aclnn.batch_norm_elemt import aclnnBatchNormElemt, aclnnBatchNormElemtGetWorkspaceSize
from opgraph.core.dtypes import DataType

F32, F16, BF16, I32 = np.float32, np.float16, np.dtype(ml_dtypes.bfloat16), np.int32
INVALID, INNER_NULLPTR, NO_KERNEL = 161002, 561103, 561003
B910, A950 = ("Ascend910B", "Ascend910_93"), "Ascend950"
SOCS = ("Ascend910B", "Ascend910_93", "Ascend950")
NAMES = ("input", "weight", "bias", "mean", "invstd", "output")
SENTINEL = 0x5A


def make(shape=(2, 3, 4, 5), dtype=F32, sdtype=None, weight=True, bias=True, out_dtype=None, seed=0):
    rng = np.random.default_rng(seed)
    C, sd = shape[1], sdtype or dtype
    out = np.full(int(np.prod(shape)) * np.dtype(out_dtype or dtype).itemsize, SENTINEL, np.uint8)
    return {"input": (rng.standard_normal(shape) * 2 + 0.3).astype(dtype),
            "weight": rng.uniform(0.5, 1.5, C).astype(dtype) if weight else None,
            "bias": rng.normal(0, 0.5, C).astype(dtype) if bias else None,
            "mean": rng.normal(0.3, 0.5, C).astype(sd), "invstd": rng.uniform(0.5, 2, C).astype(sd),
            "output": out.view(out_dtype or dtype).reshape(shape)}


def tens(a, fmt="ND"):
    return a if a is None or isinstance(a, opgraph.Tensor) else opgraph.tensor(a, format=fmt)


def phase1(a, eps=1e-5, soc="Ascend910B", fmt="ND"):
    with opgraph.platform(soc):
        st, ws, ex = aclnnBatchNormElemtGetWorkspaceSize(
            *[tens(a[n], fmt if n in ("input", "output") else "ND") for n in NAMES[:5]], eps,
            tens(a["output"], fmt))
    return int(st), ws, ex, aclnn.aclGetRecentErrMsg()


def run(a, eps=1e-5, soc="Ascend910B", fmt="ND"):
    st, ws, ex, msg = phase1(a, eps, soc, fmt)
    assert st == 0, msg
    with opgraph.platform(soc):
        assert aclnnBatchNormElemt(bytearray(ws) if ws else None, ws, ex) == 0
    return ex


def expect_error(a, status, name, *words, soc="Ascend910B", fmt="ND", eps=1e-5):
    out = a["output"]
    before = None if out is None else np.asarray(out).tobytes()
    st, ws, ex, msg = phase1(a, eps, soc, fmt)
    assert st == status, f"expected {status}, got {st}: {msg}"
    assert ex is None and ws == 0
    body = msg.split("): ", 1)[1]
    assert body.split(":")[0] == name if name.isidentifier() else body.startswith(name), msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert out is None or np.asarray(out).tobytes() == before, "the output was written"


def u(a):
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.itemsize])


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    nan = np.isnan(a.astype(np.float64)) & np.isnan(b.astype(np.float64))
    return a.dtype == b.dtype and a.shape == b.shape and bool(((u(a) == u(b)) | nan).all())


# check table (ELT: NULL → 161002, dtype, format, shape; empty; ViewCopy; kernel gate)
@pytest.mark.parametrize("name", ["input", "mean", "invstd", "output"])
def test_null_is_161002_not_the_documented_161001(name):
    a = make()
    a[name] = None
    expect_error(a, INVALID, name, "NULL")


def test_nulls_in_argument_order_before_dtype():
    a = make(dtype=F16)
    a["input"] = a["input"].astype(np.float64)
    a["mean"], a["output"] = None, None
    expect_error(a, INVALID, "mean")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.float64, I32])
def test_dtype_outside_the_list(name, bad):
    a = make()
    a[name] = np.zeros_like(a[name], bad)
    expect_error(a, INVALID, name, np.dtype(bad).name.upper() if bad is I32 else "DOUBLE")


def test_dtype_checked_in_argument_order():
    a = make()
    a["bias"], a["output"] = a["bias"].astype(I32), a["output"].astype(np.float64)
    expect_error(a, INVALID, "bias")


@pytest.mark.parametrize("name", NAMES)
def test_bf16_rejected_on_ascend910_accepted_on_bf16_socs(name):
    a = make(dtype=F16)
    a[name] = a[name].astype(BF16)
    expect_error(a, INVALID, name, "BF16", soc="Ascend910")
    for soc in SOCS:  # input and output of different dtypes pass the checks, fail at ViewCopy
        st, _, _, msg = phase1(make(dtype=F16) | {name: a[name]}, soc=soc)
        assert st == (INNER_NULLPTR if name in ("input", "output") else 0), msg


def test_format_rows():
    a = make()
    st, _, _, msg = phase1(a, fmt="NHWC")  # any plain format, channel stays dim 1
    assert st == 0, msg
    with opgraph.platform("Ascend910B"):
        st, _, _ = aclnnBatchNormElemtGetWorkspaceSize(*[tens(a[n]) for n in NAMES[:5]], 1e-5,
                                                       tens(a["output"], "NCHW"))
    assert st == INVALID and aclnn.aclGetRecentErrMsg().split("): ")[1].startswith("output:")
    expect_error(make(), INVALID, "input", "private", fmt="NC1HWC0")


@pytest.mark.parametrize("name,shape,word", [
    ("input", (2,) * 9, "greater than 8"), ("input", (4,), "less than 2"),
    ("output", (2, 3, 4, 5, 1, 1, 1, 1, 1), "greater than 8"), ("output", (120,), "less than 2")])
def test_ranks_input_first_then_output(name, shape, word):
    a = make()
    a[name] = np.zeros(shape, F32)
    expect_error(a, INVALID, name, word)


def test_output_shape_then_channel_zero_then_channel_params():
    a = make()
    a["output"] = np.zeros((2, 3, 4, 6), F32)
    expect_error(a, INVALID, "output", "must equal input's")
    a = make()
    a["input"] = a["output"] = np.zeros((2, 0, 4), F32)
    expect_error(a, INVALID, "input", "channel dim")
    a = make()
    a["input"], a["output"], a["weight"] = np.zeros((2, 0, 4), F32), np.zeros((2, 0, 5), F32), None
    expect_error(a, INVALID, "output", "must equal")  # output shape before C == 0


@pytest.mark.parametrize("name", ["weight", "bias", "mean", "invstd"])
def test_channel_params_must_be_1d_of_size_c(name):
    a = make()
    a[name] = a[name].reshape(1, 3)
    expect_error(a, INVALID, name, "1-D")
    a = make()
    a[name] = np.ones(4, F32)
    expect_error(a, INVALID, name, "[C] = [3]")


def test_all_rank_checks_come_before_size_checks():
    a = make()
    a["weight"], a["invstd"] = np.ones(5, F32), np.ones((3, 1), F32)
    expect_error(a, INVALID, "invstd", "1-D")


def test_empty_input_succeeds_with_no_kernel_and_leaves_output_untouched():
    for soc in SOCS + ("Ascend910",):
        a = make((0, 3, 4), out_dtype=F16)  # another output dtype is not caught when empty
        ex = run(a, soc=soc)
        assert ex.graph.nodes == [] and ex.workspace_size == 0


def test_output_dtype_other_than_input_passes_checks_and_fails_at_viewcopy():
    for soc in SOCS:
        a = make(out_dtype=F16)
        a["output"] = np.full((2, 3, 4, 5), 7, F16)
        expect_error(a, INNER_NULLPTR, "an l0 op returned NULL", "ViewCopy", soc=soc)


@pytest.mark.parametrize("soc", ["Ascend310P", "Ascend310B"])
def test_socs_without_the_kernel_fail_after_the_checks(soc):
    expect_error(make(), NO_KERNEL, "BNInfer has no kernel on " + soc, soc=soc)
    a = make(dtype=BF16)
    expect_error(a, INVALID, "input", "BF16", soc=soc)


def test_ascend910_models_ranks_2_to_4_and_refuses_the_transpose_path():
    run(make((2, 3, 4, 5)), soc="Ascend910")
    run(make((2, 3)), soc="Ascend910")
    expect_error(make((2, 3, 2, 2, 2)), NO_KERNEL, "input", "Transpose", soc="Ascend910")


def test_python_level_bad_arguments_are_161002():
    with opgraph.platform("Ascend910B"):
        a = make()
        st, _, ex = aclnnBatchNormElemtGetWorkspaceSize(*[tens(a[n]) for n in NAMES[:5]], "1e-5",
                                                        tens(a["output"]))
    assert st == INVALID and ex is None and "eps" in aclnn.aclGetRecentErrMsg()


# the l0 graph, op by op
def ops(ex):
    return [n.op for n in ex.graph.nodes]


PREFIX = ["Contiguous", "Contiguous", "Mul", "OnesLike", "Div", "ConvertToTensor", "Sub",
          "Contiguous", "Contiguous", "Contiguous"]
RESIZE_1D = ["Contiguous", "Cast", "UnsqueezeNd", "ReFormat"]
REGBASE = ["Contiguous", "Cast", "Contiguous", "Cast", "Contiguous", "Contiguous", "Cast",
           "Contiguous", "Cast", "BatchNormV3", "Cast"]


@pytest.mark.parametrize("soc", B910)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_910b_graph(soc, dtype):
    with opgraph.opt_level(0):
        ex = run(make(dtype=dtype), eps=0.1, soc=soc)
    assert ops(ex) == PREFIX + RESIZE_1D * 4 + ["BNInfer", "ViewCopy"]
    g = ex.graph.nodes
    d = DataType.FLOAT if dtype is F32 else DataType.FLOAT16 if dtype is F16 else DataType.BF16
    assert g[1].inputs[0].name == "invstd" and g[2].inputs == [g[1].outputs[0]] * 2
    assert g[5].attrs.value == float(F32(0.1)) and g[5].attrs.dtype == d and g[5].outputs[0].shape == ()
    assert [v.dtype for v in g[6].outputs] == [d]  # the variance lives in invstd's dtype
    assert [g[k].inputs[0].name for k in (7, 8, 9)] == ["weight", "bias", "mean"]
    for k in range(4):
        cast, unsq, ref = g[11 + 4 * k], g[12 + 4 * k], g[13 + 4 * k]
        assert cast.attrs.to == DataType.FLOAT and unsq.attrs.dims == (0, 2, 3)
        assert str(ref.outputs[0].type) == "f32[1,3,1,1]@NCHW"
    assert g[26].inputs[0] is g[0].outputs[0] and g[26].inputs[4] is g[25].outputs[0]
    assert g[22].inputs[0] is g[6].outputs[0]  # the rebuilt variance → ResizeFrom1D → BNInfer
    assert g[26].attrs.eps == float(F32(0.1)) and g[26].outputs[0].dtype == d


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_950_graph(dtype):
    with opgraph.opt_level(0):
        ex = run(make(dtype=dtype), eps=0.1, soc=A950)
    assert ops(ex) == PREFIX + REGBASE + ["ViewCopy"]
    bn = ex.graph.nodes[19]
    assert bn.attrs.eps == float(F32(0.1)) and bn.attrs.momentum == 0.0 and not bn.attrs.training
    assert [v.shape for v in bn.inputs[1:]] == [(3,)] * 4  # no ResizeFrom1D on 950


def test_null_weight_and_bias_are_float_fills_before_the_variance():
    for soc in (B910[0], A950):
        with opgraph.opt_level(0):
            ex = run(make(dtype=F16, weight=False, bias=False), soc=soc)
        fills = ex.graph.nodes[1:3]
        assert [(n.op, n.attrs.value, n.attrs.dtype, n.attrs.shape) for n in fills] == \
            [("Fill", 1.0, DataType.FLOAT, (3,)), ("Fill", 0.0, DataType.FLOAT, (3,))]
        assert ops(ex)[3:5] == ["Contiguous", "Mul"]


@pytest.mark.parametrize("case,weight,wb,run_t", [
    (dict(dtype=F16), None, F16, F16),
    (dict(dtype=F16, weight=False), None, F32, F32),              # the FLOAT fill forces FLOAT
    (dict(dtype=F16, sdtype=F32), None, F16, F32),
    (dict(dtype=F32, sdtype=F16), None, F32, F32),
    (dict(dtype=BF16), None, BF16, BF16),
    (dict(dtype=BF16), F16, F32, F32),                            # PromoteType(f16, bf16) = f32
])
def test_950_promotion_of_weight_bias_and_running_stats(case, weight, wb, run_t):
    a = make(**case)
    if weight is not None:
        a["weight"] = a["weight"].astype(weight)
    with opgraph.opt_level(0):
        ex = run(a, soc=A950)
    bn = next(n for n in ex.graph.nodes if n.op == "BatchNormV3")
    assert [v.dtype.np for v in bn.inputs[1:]] == [np.dtype(wb)] * 2 + [np.dtype(run_t)] * 2
    assert ex.graph.nodes[-2].attrs.to.np == np.dtype(case["dtype"])  # Cast(y → input dtype)


@pytest.mark.parametrize("shape,x_shape,dims", [((2, 3), (2, 3, 1, 1), (0, 2, 3)),
                                                ((2, 3, 4), (2, 3, 4, 1), (0, 2, 3)),
                                                ((2, 3, 2, 2, 2), (2, 3, 2, 2, 2), (0, 2, 3, 4)),
                                                ((2, 3, 2, 1, 2, 3, 1, 2), (2, 3, 2, 1, 12), (0, 2, 3, 4))])
def test_ranks_are_viewed_as_4d_or_5d_and_back(shape, x_shape, dims):
    for soc in (B910[0], A950):
        with opgraph.opt_level(0):
            ex = run(make(shape), soc=soc)
        g = ex.graph.nodes
        bn = next(n for n in g if n.op in ("BNInfer", "BatchNormV3"))
        assert bn.inputs[0].shape == x_shape
        fmt = "NCDHW" if len(shape) > 5 else "NCHW" if len(shape) < 4 else "ND"
        assert bn.inputs[0].type.format.name == fmt
        if soc in B910:
            assert {n.attrs.dims for n in g if n.op == "UnsqueezeNd"} == {dims}
        back = ["Reshape", "ReFormat"] if len(shape) not in (4, 5) else [bn.op if soc in B910 else "Cast"]
        assert ops(ex)[-1 - len(back):] == back + ["ViewCopy"]
        assert ("Reshape" in ops(ex)) == (len(shape) not in (4, 5))
        assert g[-1].inputs[0].shape == shape


@pytest.mark.parametrize("soc", [B910[0], A950])
def test_level1_launches_what_cann_launches(soc):
    for weight, want in ((True, 5), (False, 7)):
        with opgraph.opt_level(0):
            ex = run(make(weight=weight, bias=weight), soc=soc)
        g1 = passes.optimize(ex.graph, 1)
        kernel = "BatchNormV3" if soc == A950 else "BNInfer"
        launched = [n.op for n in g1.nodes if not n.opdef.is_free(n)]
        assert sorted(launched) == sorted(["Fill"] * (want - 5) + ["Mul", "OnesLike", "Div", "Sub", kernel])
        assert passes.graph_stats(g1).launches == want
        assert next(n for n in g1.nodes if n.op == "ViewCopy").attrs.redirect
    with opgraph.opt_level(0):
        ex = run(make(dtype=F16, sdtype=F32), soc=soc)
    casts = [n for n in passes.optimize(ex.graph, 1).nodes if n.op == "Cast"]
    assert len(casts) == (0 if soc == A950 else 2)  # 950: w/b stay f16, mean/var f32; 910B: w/b → f32


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 2, 2, 2)])
@pytest.mark.parametrize("soc", [B910[0], A950])
def test_level2_is_one_fused_kernel_storing_into_the_output(shape, soc):
    for out in (None, np.zeros(shape[:-1] + (2 * shape[-1],), F32)[..., ::2]):
        a = make(shape, weight=False)
        if out is not None:
            a["output"] = out
        with opgraph.opt_level(2):
            ex = run(a, soc=soc)
        nodes = ex.compiled.nodes
        assert [n.op for n in nodes] == ["FusedElementwise"] and nodes[0].attrs.store
        assert nodes[0].inputs[-1].name == "output" and ex.workspace_size == 0
