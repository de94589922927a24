"""aclnnSyncBatchNormGatherStats (syncbn-family.md §6): the vendor's check table and order, the
empty cases, the l0 graph on both SoC families and its launch counts (the kernel's numerics:
test_sync_batch_norm_gather_stats_numerics.py)."""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import aclnn, passes
from opgraph.core.dtypes import PRIVATE_FORMATS
from opgraph.aclnn.sync_batch_norm_gather_stats import (aclnnSyncBatchNormGatherStats,
                                                        aclnnSyncBatchNormGatherStatsGetWorkspaceSize)

OP = "aclnnSyncBatchNormGatherStats"
F32, F16, BF16, I32 = np.float32, np.float16, ml_dtypes.bfloat16, np.int32
TENSORS = ("totalSum", "totalSquareSum", "sampleCount", "mean", "variance", "batchMean", "batchInvstd")
ORDER = TENSORS[:5] + ("momentum", "eps") + TENSORS[5:]
WRITTEN = ("mean", "variance", "batchMean", "batchInvstd")
NULLPTR, INVALID, NO_KERNEL = 161001, 161002, 561003
f32 = np.float32


# --- arguments ----------------------------------------------------------------------------------
def valid(n=3, c=4, dtype=F32, count=I32, batch=None, seed=0, momentum=0.1, eps=1e-5) -> dict:
    rng = np.random.default_rng(seed)
    cnt = rng.integers(1, 20, n)
    mu = rng.normal(0, 1, (n, c))
    return dict(totalSum=(cnt[:, None] * mu).astype(dtype),
                totalSquareSum=(cnt[:, None] * (mu * mu + rng.uniform(0.5, 2, (n, c)))).astype(dtype),
                sampleCount=cnt.astype(count), mean=rng.normal(0, 0.5, c).astype(dtype),
                variance=rng.uniform(0.5, 1.5, c).astype(dtype),
                batchMean=np.full(c, 7, batch or dtype), batchInvstd=np.full(c, 7, batch or dtype),
                momentum=momentum, eps=eps)


def fresh(a: dict) -> dict:
    return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in a.items()}


def wrap(v):
    return opgraph.tensor(v) if isinstance(v, np.ndarray) else v


def phase1(args: dict, soc="Ascend910B"):
    with opgraph.platform(soc):
        st, ws, ex = aclnnSyncBatchNormGatherStatsGetWorkspaceSize(*[wrap(args[k]) for k in ORDER])
    return int(st), ws, ex, aclnn.aclGetRecentErrMsg()


def run(args: dict, soc="Ascend910B", level=2) -> dict:
    with opgraph.platform(soc), opgraph.opt_level(level):
        st, ws, ex, msg = phase1(args, soc)
        assert st == 0, msg
        assert int(aclnnSyncBatchNormGatherStats(bytearray(ws) if ws else None, ws, ex)) == 0
    return {k: np.asarray(args[k]) for k in WRITTEN}


def snapshot(args: dict) -> dict:
    return {k: (args[k].storage if isinstance(args[k], opgraph.Tensor) else args[k]).tobytes()
            for k in WRITTEN if args[k] is not None}


_NAME = re.compile(r"(?<![A-Za-z])(" + "|".join(sorted(TENSORS, key=len, reverse=True)) + r")(?![A-Za-z])")


def expect_error(args: dict, status: int, name: str, soc="Ascend910B", *words: str) -> str:
    before = snapshot(args)
    st, ws, ex, msg = phase1(args, soc)
    assert st == status, msg
    assert ex is None and ws == 0
    found = _NAME.search(msg)
    assert found and found.group(1) == name, f"message should name {name} first: {msg!r}"
    for w in words:
        assert w in msg, msg
    assert snapshot(args) == before, "a failing call wrote an output or a running statistic"
    return msg


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}")


def assert_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    same = (bits(got) == bits(want)) | (np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64)))
    assert same.all(), f"{got} != {want}"


# --- the check table ----------------------------------------------------------------------------
def change(**kw):
    """A mutation of valid() arguments: each name gets f(old value), or the value given."""
    return lambda a: a.update({k: f(a[k]) if callable(f) else f for k, f in kw.items()})


def to(dtype):
    return lambda x: x.astype(dtype)


def fmt(name):
    return lambda x: opgraph.tensor(x, format=name)


def resized(*shape):
    return lambda x: np.resize(x, shape)


BAD_DTYPES = dict(totalSum=I32, totalSquareSum=np.float64, sampleCount=np.int64, mean=np.int8,
                  variance=np.uint8, batchMean=I32, batchInvstd=np.float64)
EQUALITIES = [("totalSquareSum", (2, 4), "N = 3"), ("totalSquareSum", (3, 5), "C = 4"),
              ("sampleCount", (4,), "N = 3"), ("mean", (5,), "C = 4"), ("variance", (3,), "C = 4"),
              ("batchMean", (1,), "C = 4"), ("batchInvstd", (8,), "C = 4")]
CHECKS = {  # id: (mutation of valid(), status, the argument named first, words in the message)
    **{f"null-{n}": (change(**{n: None}), NULLPTR, n, "NULL") for n in TENSORS},
    **{f"dtype-{n}": (change(**{n: to(d)}), INVALID, n, "not supported") for n, d in BAD_DTYPES.items()},
    **{f"bf16-{n}": (change(**{n: to(BF16)}), INVALID, n, "BF16") for n in TENSORS},  # 910B
    **{f"group-{n}": (change(**{n: to(F16)}), INVALID, n, "must equal")
       for n in ("totalSquareSum", "mean", "variance", "batchInvstd")},
    **{f"private-{n}-{f}": (change(**{n: fmt(f)}), INVALID, n, f)
       for n in TENSORS[:5] for f in ("NC1HWC0", "FRACTAL_NZ")},
    **{f"rank-{n}": (change(**{n: (lambda x: x[..., None]) if n != "totalSum" else (lambda x: x.ravel())}),
                     INVALID, n, "rank") for n in TENSORS},
    **{f"{w[0]}-{n}": (change(**{n: resized(*shape)}), INVALID, n, w) for n, shape, w in EQUALITIES},
    "null-before-dtype": (change(totalSum=to(np.int64), batchInvstd=None), NULLPTR, "batchInvstd", "NULL"),
    "dtype-before-format": (change(totalSum=lambda x: opgraph.tensor(x[:, :, None], format="NC1HWC0"),
                                   batchInvstd=to(I32)), INVALID, "batchInvstd", "dtype"),
    "format-before-shape": (change(sampleCount=fmt("FRACTAL_NZ"), mean=lambda x: x[:2]), INVALID,
                            "sampleCount", "private"),
    "equalities-in-order": (change(batchInvstd=resized(2), sampleCount=resized(2)), INVALID,
                            "sampleCount", "N = 3"),
}


@pytest.mark.parametrize("case", CHECKS)
def test_check_table_and_order(case):
    mutate, status, name, *words = CHECKS[case]
    args = valid()
    mutate(args)
    expect_error(args, status, name, "Ascend910B", *words)


@pytest.mark.parametrize("name", TENSORS)
def test_bf16_passes_the_dtype_lists_on_950(name):
    args = valid()
    args[name] = args[name].astype(BF16)
    if name == "sampleCount":
        run(args, "Ascend950")
    else:  # supported there, but it no longer matches its dtype group (named: the later one)
        partner = {"totalSum": "totalSquareSum", "batchMean": "batchInvstd"}.get(name, name)
        assert "not supported" not in expect_error(args, INVALID, partner, "Ascend950", "must equal")


@pytest.mark.parametrize("mutate", [change(), change(sampleCount=to(F32)), change(sampleCount=to(F16)),
                                    change(batchMean=to(F16), batchInvstd=to(F16))])
def test_accepted_dtype_mixes(mutate):
    args = valid()
    mutate(args)
    assert all(np.isfinite(v).all() for v in run(args).values())
    assert run(valid(dtype=BF16), "Ascend950")["batchMean"].dtype == BF16


@pytest.mark.parametrize("f", sorted(f.name for f in PRIVATE_FORMATS))
def test_private_format_is_not_checked_on_batch_outputs(f):
    args = valid()  # CheckFormat looks at the five inputs only
    args["batchMean"] = opgraph.tensor(args["batchMean"], format=f)
    assert phase1(args)[0] == 0


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_no_ranks_is_161002_after_the_other_checks(soc):
    args = valid(n=0)
    expect_error(args, INVALID, "totalSum", soc, "dim 0")
    args["batchMean"] = None
    expect_error(args, NULLPTR, "batchMean", soc)


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950", "Ascend910"])
def test_no_channels_succeeds_and_launches_nothing(soc):
    args = valid(c=0)
    st, ws, ex, msg = phase1(args, soc)
    assert st == 0 and ws == 0 and ex.graph.nodes == [], msg
    assert int(aclnnSyncBatchNormGatherStats(None, 0, ex)) == 0


@pytest.mark.parametrize("soc", ["Ascend910", "Ascend310P", "Ascend310B"])
def test_soc_without_the_kernel_is_561003_after_the_checks(soc):
    args = valid()
    before = snapshot(args)
    st, ws, ex, msg = phase1(args, soc)
    assert st == NO_KERNEL and ex is None and "SyncBatchNormGatherStats" in msg and soc in msg
    assert snapshot(args) == before
    args["mean"] = args["mean"].astype(I32)
    expect_error(args, INVALID, "mean", soc)


def test_phase1_writes_nothing_and_phase2_updates_in_place():
    args = valid()
    before = snapshot(args)
    st, ws, ex, msg = phase1(args)
    assert st == 0 and snapshot(args) == before
    aclnnSyncBatchNormGatherStats(bytearray(ws) if ws else None, ws, ex)
    assert all(snapshot(args)[k] != before[k] for k in WRITTEN)


# --- the graph ----------------------------------------------------------------------------------
def listing(ex) -> list[str]:
    return [f"{n.op}:{','.join(str(o.type) for o in n.outputs)}" for n in ex.graph.nodes]


@pytest.mark.parametrize("soc,arch", [("Ascend910B", 2201), ("Ascend910_93", 2201), ("Ascend950", 3510)])
@pytest.mark.parametrize("dtype,t", [(F32, "f32"), (F16, "f16"), (BF16, "bf16")])
def test_graph_op_by_op(soc, arch, dtype, t):
    if dtype is BF16 and arch != 3510:
        return
    st, _, ex, msg = phase1(valid(n=3, c=4, dtype=dtype), soc)
    assert st == 0, msg
    v = f"{t}[4]"
    assert listing(ex) == [f"Contiguous:{t}[3,4]", f"Contiguous:{t}[3,4]", "Contiguous:s32[3]",
                           "Cast:s32[3]", f"Contiguous:{v}", f"Contiguous:{v}",
                           f"SyncBatchNormGatherStats:{v},{v},{v},{v}",
                           f"Cast:{v}", f"ViewCopy:{v}", f"Cast:{v}", f"ViewCopy:{v}",
                           f"Cast:{v}", f"ViewCopy:{v}", f"Cast:{v}", f"ViewCopy:{v}"]
    nodes = ex.graph.nodes
    kern = nodes[6]
    assert [i.name for i in kern.inputs] == [nodes[k].outputs[0].name for k in (0, 1, 3, 4, 5)]
    assert kern.attrs.arch == arch and kern.attrs.momentum == float(f32(0.1))
    assert kern.attrs.eps == float(f32(1e-5))
    if arch == 3510:
        assert (kern.attrs.cores, kern.attrs.ub_size) == (64, 245760)
    written = [n.inputs[1].name for n in nodes if n.op == "ViewCopy"]
    assert written == ["batchMean", "batchInvstd", "mean", "variance"]
    assert [n.inputs[0] for n in nodes[7::2]] == list(kern.outputs)


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_graph_real_casts_for_float_counts_and_other_batch_dtypes(soc):
    st, _, ex, _ = phase1(valid(count=F16, batch=F16), soc)
    casts = [(str(n.inputs[0].type), n.attrs.to.short) for n in ex.graph.nodes if n.op == "Cast"]
    assert casts == [("f16[3]", "s32"), ("f32[4]", "f16"), ("f32[4]", "f16"), ("f32[4]", "f32"),
                     ("f32[4]", "f32")]


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("count,batch,launches", [(I32, None, 1), (F32, None, 2), (I32, F16, 3)])
def test_level1_launch_counts(soc, count, batch, launches):
    st, _, ex, _ = phase1(valid(count=count, batch=batch), soc)
    stats = [passes.graph_stats(passes.optimize(ex.graph, n)).launches for n in (0, 1)]
    assert stats == [launches + 4, launches]  # level 0 also copies into the four user tensors
