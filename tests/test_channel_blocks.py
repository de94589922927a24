"""Reducing bodies run by blocks of channels (l0ops/channel_blocks.py, evaluate_body): the same
bits as on whole arrays — for the family's op_apis in every dtype and layout and for random
bodies — and bodies that do not separate along the channel are refused (they run whole)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import opgraph
from l0ops import channel_blocks as CB, expansion
from l0ops.expansion import array_types, evaluate_body
from l0ops.primitives import Instr
from opgraph import ops
from opgraph.core.dtypes import DataType as D
from opgraph.core.platform import platform as use_platform
from opgraph.core.types import TensorType

F32, F16, BF16 = np.float32, np.float16, np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def forced(monkeypatch):
    """Blocks for any size, of at most ``blocks(elements)`` elements; counts the blocked runs."""
    runs = []
    real = expansion._by_channels

    def counted(*args):
        runs.append(args[4])
        return real(*args)
    monkeypatch.setattr(expansion, "_by_channels", counted)

    def blocks(elements: int) -> list:
        monkeypatch.setattr(expansion, "MIN_ELEMS", 0)
        monkeypatch.setattr(CB, "BLOCK_ELEMS", elements)
        return runs
    return blocks


def bits(arrays) -> list[bytes]:
    return [np.ascontiguousarray(a).view(np.uint8).tobytes() for a in arrays]


def family_calls(x, dy, dtype):
    C = x.shape[1]
    with opgraph.use_backend("numpy"):
        mean, invstd = ops.batch_norm_stats(x, 1e-5)
        out = [mean, invstd]
        out += ops.batch_norm_backward_reduce(dy, x, mean, invstd, np.ones(C, dtype), True, True, True)
        if x.ndim == 4:
            out += ops.batch_norm_reduce(x)
    return out


def layouts(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    last = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    wide = np.zeros(shape[:-1] + (shape[-1] * 2,), dtype)
    wide[..., ::2] = x
    return {"contiguous": x, "channels_last": np.moveaxis(last, -1, 1), "strided": wide[..., ::2]}


@pytest.mark.parametrize("soc, dtype", [("Ascend910B", F32), ("Ascend910B", F16),
                                        ("Ascend950", F32), ("Ascend950", BF16)])
@pytest.mark.parametrize("shape", [(3, 5, 4, 7), (6, 6, 2, 6), (2, 9, 33), (2, 3, 2, 2, 5)])
def test_family_reductions_keep_their_bits_by_blocks(forced, thread_count, monkeypatch, soc, dtype, shape):
    for k, (name, x) in enumerate(layouts(shape, dtype, seed=len(shape)).items()):
        dy = layouts(shape, dtype, seed=k + 10)[name]
        with use_platform(soc):
            monkeypatch.setattr(expansion, "MIN_ELEMS", 1 << 62)
            whole = family_calls(x, dy, dtype)
            runs = forced(2 * x.size // shape[1])  # two channels a block (the last may be one)
            for n in (1, 2, 3):
                thread_count(n)
                runs.clear()
                assert bits(family_calls(x, dy, dtype)) == bits(whole), (name, n)
                assert len(runs) >= 2  # stats and the backward sums ran by blocks


def test_a_large_body_takes_blocks_by_default_and_a_small_one_does_not(monkeypatch):
    runs = []
    real = expansion._by_channels
    monkeypatch.setattr(expansion, "_by_channels", lambda *a: runs.append(a[4]) or real(*a))
    with opgraph.use_backend("numpy"):
        ops.batch_norm_stats(np.ones((2, 4, 8, 8), F32), 1e-5)
        assert runs == []
        x = np.random.default_rng(0).standard_normal((4, 16, 128, 129)).astype(F32)
        mean, invstd = ops.batch_norm_stats(x, 1e-5)
    assert len(runs) == 1 and runs[0].summed == x.size >= CB.MIN_ELEMS
    want = x.astype(np.float64).mean(axis=(0, 2, 3))
    assert np.allclose(mean, want, rtol=1e-5, atol=1e-6)
    assert np.allclose(invstd, 1 / np.sqrt(x.astype(np.float64).var(axis=(0, 2, 3)) + 1e-5),
                       rtol=1e-4)


def test_channel_ranges_cover_the_channels_once_in_blocks_of_the_limit():
    for C, per, threads_, limit in [(64, 100352, 2, 1 << 19), (5, 10, 2, 20), (3, 1 << 20, 4, 1 << 19),
                                    (7, 1, 1, 100), (64, 6272, 2, 1 << 19)]:
        ranges = CB.channel_ranges(C, per, threads_, limit)
        assert [c for lo, hi in ranges for c in range(lo, hi)] == list(range(C))
        k = ranges[0][1] - ranges[0][0]
        assert all(hi - lo <= k for lo, hi in ranges) and k >= 1
        assert k * per <= limit or k == 1
        assert len(ranges) >= min(C, threads_)


# --- the split: which bodies separate along the channel -------------------------------------

N, C, H, W = 3, 4, 2, 5
FULL, VEC, CHAN = (N, C, H, W), (C,), (1, C, 1, 1)


def I(op, *args, dtype=D.FLOAT, **kw):  # noqa: E743 (an instruction, as the bodies print them)
    return Instr(op=op, args=args, dtype=dtype, **kw)


def split(body, shapes, results):
    return CB.channel_split(tuple(body), [TensorType(s, D.FLOAT) for s in shapes], results)


MEAN_SQUARE = [I("mul", "in0", "in0"), I("sum", "t0", shape=CHAN, over=FULL),
               I("view", "t1", shape=VEC), I("sub", "in1", "t2")]


def test_the_split_labels_every_register_with_its_channel_axis():
    s = split(MEAN_SQUARE, [FULL, VEC], ("t3", "t1"))
    assert (s.channels, s.in_axes, s.result_axes, s.renamed) == (C, (1, 0), (0, 1), (None, 1, 0, None))
    body = tuple(MEAN_SQUARE)
    renamed = CB.block_body(body, s, 3)
    assert [i.render("r") for i in renamed[1:3]] == ["r: f32[1,3,1,1] = sum(t0) over [3,3,2,5]",
                                                   "r: f32[3] = view(t1)"]
    assert renamed[0] is body[0] and CB.block_body(body, s, 3) is renamed  # made once per body


@pytest.mark.parametrize("body, shapes, why", [
    ([I("sum", "in0", shape=(1, 1, 1, 1), over=FULL)], [FULL], "no kept dim"),
    ([I("sum", "in0", shape=(1, C, H, 1), over=FULL)], [FULL], "two kept dims"),
    (MEAN_SQUARE[:2] + [I("sum", "t1")], [FULL], "the channel summed away"),
    (MEAN_SQUARE[:2] + [I("pow", "in0", "t1")], [FULL], "a per-channel exponent"),
    (MEAN_SQUARE[:2] + [I("fill", shape=CHAN, value=1.0), I("mul", "in0", "t2")], [FULL], "a constant of C"),
    (MEAN_SQUARE[:2] + [I("view", "t1", shape=(2, C // 2))], [FULL], "a view across channels"),
    ([I("sum", "in0", shape=(1, C, 1, 1), over=(N, C, H, C)), I("add", "in0", "in1")],
     [(N, C, H, C), VEC], "a channel vector along the last dim"),
    ([I("sum", "in0", shape=CHAN, over=(N, C, H, C)), I("mul", "in0", "in1")],
     [(N, C, H, C), (1, 1, 1, C)], "an input with C elsewhere"),
    ([I("sum", "in0", shape=CHAN, over=FULL), I("sum", "in0", shape=(1, 1, 1, W), over=FULL)],
     [FULL], "two sums keeping different dims"),
])
def test_bodies_that_do_not_separate_are_refused_and_run_whole(forced, body, shapes, why):
    assert split(body, shapes, (f"t{len(body) - 1}",)) is None, why
    runs = forced(1)
    inputs = [np.random.default_rng(1).uniform(0.5, 2, s).astype(F32) for s in shapes]
    types = array_types(inputs)
    results = (f"t{len(body) - 1}",)
    got = evaluate_body(tuple(body), results, inputs, types)
    assert runs == [] and bits(got) == bits(evaluate_body(tuple(body), results, inputs, types, False))


def test_a_separable_body_with_an_unlabelled_input_and_a_scalar_exponent_takes_blocks(forced):
    body = tuple(MEAN_SQUARE[:2] + [I("pow", "t1", "in1"), I("add", "t2", "in2")])
    shapes = [FULL, (1,), ()]
    assert split(body, shapes, ("t3",)).in_axes == (1, None, None)
    runs = forced(N * H * W)
    inputs = [np.float32(np.random.default_rng(2).uniform(0.5, 2, FULL)), np.float32([-0.5]),
              np.float32(0.25)]
    got = evaluate_body(body, ("t3", "t2"), inputs, array_types(inputs))
    assert len(runs) == 1
    assert bits(got) == bits(evaluate_body(body, ("t3", "t2"), inputs, array_types(inputs), False))
    sq = (inputs[0].astype(np.float64) ** 2).sum(axis=(0, 2, 3), keepdims=True)
    assert np.allclose(got[1], 1 / np.sqrt(sq), rtol=1e-5)


# --- random bodies ---------------------------------------------------------------------------

def random_body(rng, dtype, shape):
    """A random reducing body on a full tensor, a channel vector, a [1,C,1,1] tensor and a
    scalar; about one in five also does something that does not separate."""
    n, c, h, w = shape
    kinds = {"in0": "full", "in1": "vec", "in2": "chan", "in3": "const", "in4": "full"}
    body: list[Instr] = []

    def emit(op, args, kind, **kw):
        body.append(Instr(op=op, args=tuple(args), dtype=dtype, **kw))
        kinds[f"t{len(body) - 1}"] = kind
        return f"t{len(body) - 1}"

    def pick(*wanted):
        return str(rng.choice([r for r, k in kinds.items() if k in wanted]))
    emit("sum", [pick("full")], "chan", shape=(1, c, 1, 1), over=shape)
    for _ in range(rng.integers(3, 12)):
        roll = rng.random()
        if roll < 0.35:
            a, b = pick("full", "chan", "const"), pick("full", "chan", "const")
            kind = "full" if "full" in (kinds[a], kinds[b]) else "chan" if "chan" in (kinds[a], kinds[b]) else "const"
            emit(str(rng.choice(["add", "sub", "mul", "div", "max"])), [a, b], kind)
        elif roll < 0.5:
            emit("sum", [pick("full")], "chan", shape=(1, c, 1, 1), over=shape)
        elif roll < 0.6:
            emit("view", [pick("chan")], "vec", shape=(c,))
        elif roll < 0.7:
            emit("view", [pick("vec")], "chan", shape=(1, c, 1, 1))
        elif roll < 0.78:
            emit(str(rng.choice(["add", "mul"])), [pick("vec"), pick("vec", "const")], "vec")
        elif roll < 0.84:
            base = pick("full", "chan")
            exponent = emit("fill", [], "const", value=float(rng.choice([-0.5, 2.0, 1.5])))
            emit("pow", [base, exponent], kinds[base])
        elif roll < 0.88:
            emit("sum", [pick("full")], "const")  # the channel summed away: refused
        elif roll < 0.92:
            emit("pow", [pick("full"), pick("chan")], "full")  # per-channel exponent: refused
        elif roll < 0.96 and w == c:
            emit("add", [pick("full"), pick("vec")], "full")  # a vector along W: refused
        else:
            a = pick("full", "chan")
            emit("sqrt", [a], kinds[a])
    results = tuple(sorted({f"t{len(body) - 1}", str(rng.choice([r for r in kinds if r.startswith("t")]))}))
    return tuple(body), results


def test_random_bodies_keep_their_bits_by_blocks(forced, thread_count):
    rng = np.random.default_rng(20261206)
    accepted = 0
    for case in range(150):
        dtype = [D.FLOAT, D.FLOAT16, D.BF16][case % 3]
        c = int(rng.integers(2, 7))
        shape = (int(rng.integers(1, 4)), c, int(rng.integers(1, 4)), int(rng.choice([c, 3, 5])))
        body, results = random_body(rng, dtype, shape)
        npd = dtype.np
        inputs = [rng.uniform(-2, 2, shape).astype(npd), rng.uniform(0.5, 2, (shape[1],)).astype(npd),
                  rng.uniform(0.5, 2, (1, shape[1], 1, 1)).astype(npd), np.asarray(rng.uniform(0.5, 2), npd),
                  rng.uniform(-2, 2, shape).astype(npd)]
        types = array_types(inputs)
        with np.errstate(all="ignore"):
            whole = evaluate_body(body, results, inputs, types, False)
        runs = forced(int(rng.integers(1, 3)) * shape[0] * shape[2] * shape[3])
        runs.clear()
        thread_count(int(rng.integers(1, 4)))
        with np.errstate(all="ignore"):
            got = evaluate_body(body, results, inputs, types)
        assert bits(got) == bits(whole), (case, [i.render(f"t{k}") for k, i in enumerate(body)])
        accepted += bool(runs)
    assert accepted >= 60  # most bodies separate, so the blocks were exercised
