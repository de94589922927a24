"""Blocks of rows in the numpy interpreter (l0ops.chunking.row_blocks, used by
l0ops.interpreter.run_fused): the blocks cover the iteration space exactly once, each part of a
row's per-channel terms is written out once per thread and part, the path is taken only where it
applies (rows that repeat, C-order rows, an output apart from the inputs), and it gives the bits
of the body evaluated directly, on any thread count."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from l0ops import chunking, interpreter as P
from l0ops.primitives import FusedAttrs, Instr
from opgraph.core.dtypes import DataType as D

NP = {D.FLOAT: np.float32, D.FLOAT16: np.float16, D.BF16: ml_dtypes.bfloat16}


def body(dt: D, shape: tuple[int, ...]) -> FusedAttrs:
    """(x - a)·b - y per element, a and b per channel (float32, cast to dt)."""
    c = (1, shape[1]) + (1,) * (len(shape) - 2)
    return FusedAttrs(shape=shape, result="t6", out_dtype=dt, body=(
        Instr(op="view", args=("in0",), dtype=D.FLOAT, shape=c),
        Instr(op="cast", args=("t0",), dtype=dt),
        Instr(op="view", args=("in1",), dtype=D.FLOAT, shape=c),
        Instr(op="cast", args=("t2",), dtype=dt),
        Instr(op="sub", args=("in2", "t1"), dtype=dt),
        Instr(op="mul", args=("t4", "t3"), dtype=dt),
        Instr(op="sub", args=("t5", "in3"), dtype=dt)))


def operands(dt: D, shape: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape[1]).astype(np.float32),
            rng.uniform(0.5, 2, shape[1]).astype(np.float32),
            rng.standard_normal(shape).astype(NP[dt]), rng.standard_normal(shape).astype(NP[dt])]


def direct(dt: D, ins: list[np.ndarray]) -> np.ndarray:
    """The body in dt, one rounding per operation (numpy / ml_dtypes arithmetic)."""
    a, b, x, y = ins
    c = (1, -1) + (1,) * (x.ndim - 2)
    t = NP[dt]
    return (x - a.astype(t).reshape(c)) * b.astype(t).reshape(c) - y


@pytest.mark.parametrize("shape,limit,part", [
    ((4, 6, 100), 600, 300), ((4, 6, 100), 1 << 30, 1 << 30), ((3, 5, 9, 13), 200, 50),
    ((3, 5, 9, 13), 7, 7), ((2, 3, 4, 5, 6), 100, 40), ((5, 7, 11), 1, 1)])
def test_the_blocks_cover_the_space_once_and_lie_in_their_part(shape, limit, part):
    x = np.zeros(shape, np.float32)
    start, blocks = chunking.row_blocks(shape, [np.ones((1, shape[1]) + (1,) * (len(shape) - 2))],
                                        [x], limit, part)
    assert start == 1
    count = np.zeros(shape, np.int64)
    parts = distinct_parts(blocks)  # in the order the blocks take them
    for idx, row in blocks:
        count[idx] += 1
        assert idx[start:] == row + (slice(None),) * (len(shape) - start - len(row))
        assert count[idx].size <= max(limit, np.empty(shape[start:])[row].size)
    rows = np.zeros(shape[start:], np.int64)  # how often each row element is in a part
    for row in parts:
        rows[row] += 1
    assert (count == 1).all() and (rows == 1).all()
    runs = [row for k, (_, row) in enumerate(blocks) if k == 0 or blocks[k - 1][1] != row]
    assert runs == parts  # part by part: each part's blocks together


def distinct_parts(blocks: list) -> list:
    """The row parts of ``blocks``, each once, in order (slices are not hashable before 3.12)."""
    parts: list = []
    for _, row in blocks:
        if row not in parts:
            parts.append(row)
    return parts


def test_rows_apply_only_where_they_repeat_and_lie_in_one_run():
    per_channel = [np.ones((1, 3, 1, 1), np.float32)]
    nchw = np.zeros((2, 3, 40, 40), np.float32)
    nhwc = np.zeros((2, 40, 40, 3), np.float32).transpose(0, 3, 1, 2)
    strided = np.zeros((2, 3, 40, 80), np.float32)[..., ::2]
    assert chunking.row_blocks(nchw.shape, per_channel, [nchw, nchw], 100, 100)[0] == 1
    assert chunking.row_blocks(nchw.shape, per_channel, [nchw, nhwc], 100, 100) is None
    assert chunking.row_blocks(nchw.shape, per_channel, [strided], 100, 100) is None
    one = np.zeros((1, 3, 40, 40), np.float32)  # one row: nothing to reuse
    assert chunking.row_blocks(one.shape, per_channel, [one], 100, 100) is None
    every = [np.ones((2, 1, 1, 1), np.float32)]  # varies along the first dim: rows of the space
    assert chunking.row_blocks(nchw.shape, every, [nchw], 100, 100) is None


@pytest.mark.parametrize("dt", [D.FLOAT, D.FLOAT16, D.BF16])
@pytest.mark.parametrize("limits", [dict(row_limit=1 << 30, part_limit=1 << 30),
                                    dict(row_limit=2000, part_limit=400),
                                    dict(row_limit=30, part_limit=30)],
                         ids=["whole-rows", "row-parts", "row-lines"])
def test_blocks_of_rows_give_the_direct_bits_writing_each_part_out_once(monkeypatch, dt, limits):
    shape = (6, 5, 9, 40)
    ins = operands(dt, shape)
    made: list = []
    real = P.expand_part
    monkeypatch.setattr(P, "expand_part", lambda *a: made.append(a[3]) or real(*a))
    got = P.run_fused(body(dt, shape), ins, whole_limit=0, limit=100, **limits)
    assert np.array_equal(got.view(np.uint8), direct(dt, ins).view(np.uint8))
    _, blocks = chunking.row_blocks(shape, [np.ones((1, 5, 1, 1))], [ins[2]],
                                    limits["row_limit"], limits["part_limit"])
    # each part once, for each of the two per-channel registers
    assert made == [p for p in distinct_parts(blocks) for _ in range(2)]


@pytest.mark.parametrize("layout", ["in-place", "channels_last", "one-row"])
def test_where_rows_do_not_apply_the_other_chunkings_give_the_same_bits(monkeypatch, layout):
    shape = (1, 5, 9, 40) if layout == "one-row" else (6, 5, 9, 40)
    ins = operands(D.FLOAT, shape, seed=2)
    if layout == "channels_last":
        ins[2] = np.ascontiguousarray(ins[2].transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    want = direct(D.FLOAT, ins)
    monkeypatch.setattr(P, "expand_part", lambda *a: pytest.fail("rows taken"))
    out = ins[3] if layout == "in-place" else np.empty(shape, np.float32)
    P.run_fused(body(D.FLOAT, shape), ins, out=out, whole_limit=0, row_limit=300, part_limit=100,
                limit=300, channel_limit=300)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("count", [1, 2, 3])
def test_rows_shared_among_threads_give_the_same_bits(monkeypatch, thread_count, count):
    shape = (15, 8, 96, 96)  # past PARALLEL_ELEMS: the blocks are shared
    assert np.prod(shape) >= P.PARALLEL_ELEMS
    made: list = []
    real = P.expand_part
    monkeypatch.setattr(P, "expand_part", lambda *a: made.append(a[3]) or real(*a))
    thread_count(count)
    for dt in (D.FLOAT, D.BF16):
        ins = operands(dt, shape, seed=count)
        got = P.run_fused(body(dt, shape), ins, part_limit=20000)
        assert np.array_equal(got.view(np.uint8), direct(dt, ins).view(np.uint8))
    assert len(distinct_parts([(None, row) for row in made])) == 4  # 2 channels a part


def test_the_buffers_a_thread_keeps_are_bounded(monkeypatch):
    """Row parts and temporaries are kept per thread between calls; past SCRATCH_BYTES they are
    dropped before the next call (so many shapes in one process do not pile them up), and the
    results keep the direct bits either way."""
    monkeypatch.setattr(P, "run_split", lambda work, items: work(items))  # this thread's buffers
    monkeypatch.setattr(P, "SCRATCH_BYTES", 40_000)
    P._SCRATCH.buffers = {}
    kept = []
    for h in (9, 10, 11, 12):  # a new row shape each call: two new row parts of 5·h·40 floats
        shape = (6, 5, h, 40)
        ins = operands(D.FLOAT, shape, seed=h)
        got = P.run_fused(body(D.FLOAT, shape), ins, whole_limit=0, limit=100)
        assert np.array_equal(got.view(np.uint32), direct(D.FLOAT, ins).view(np.uint32))
        kept.append(sum(b.nbytes for b in P._SCRATCH.buffers.values()))
    assert kept == [14400, 14400 + 16000, 14400 + 16000 + 17600, 19200]  # dropped past 40000
