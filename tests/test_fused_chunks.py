"""The numpy interpreter's chunked paths (:func:`l0ops.interpreter.run_fused`): whole, C-order
chunks, chunks within one channel, channels_last and strided operands, per-thread scratch buffers
reused across bodies and sizes — every path bit-identical to the body evaluated directly in its
dtype with numpy / ml_dtypes arithmetic (one rounding per operation)."""
from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from l0ops import chunking, interpreter as P
from l0ops.primitives import FusedAttrs, Instr, Sig
from opgraph.core.dtypes import DataType as D

NP = {D.FLOAT: np.float32, D.FLOAT16: np.float16, D.BF16: ml_dtypes.bfloat16}
# one whole chunk; C-order chunks; chunks within a channel; tiny C-order chunks; blocks of rows
# (whole rows; parts of a row, a channel's lines and single lines; row_limit=0: no rows)
PATHS = [dict(limit=1 << 30, channel_limit=1 << 30, whole_limit=1 << 30),
         dict(limit=700, channel_limit=1 << 30, whole_limit=0, row_limit=0),
         dict(limit=1 << 30, channel_limit=900, whole_limit=0, row_limit=0),
         dict(limit=50, channel_limit=50, whole_limit=0, row_limit=0),
         dict(whole_limit=0, row_limit=1 << 30, part_limit=1 << 30),
         dict(whole_limit=0, row_limit=3000, part_limit=300),
         dict(whole_limit=0, row_limit=50, part_limit=50)]
PATH_IDS = ["whole", "c-order", "per-channel", "tiny", "rows", "row-parts", "row-lines"]


def I(op, *args, dtype=D.FLOAT, **kw):  # noqa: E743 - short name for body listings
    return Instr(op=op, args=args, dtype=dtype, **kw)


def body(dt: D, c: int) -> FusedAttrs:
    """((x - a) - y·b)·a per element, a (float32, cast to dt) and b per channel."""
    return (I("view", "in0", shape=(1, c, 1, 1)), I("cast", "t0", dtype=dt),
            I("view", "in1", dtype=dt, shape=(1, c, 1, 1)), I("sub", "in2", "t1", dtype=dt),
            I("mul", "in3", "t2", dtype=dt), I("sub", "t3", "t4", dtype=dt),
            I("mul", "t5", "t1", dtype=dt))


def direct(dt: D, a, b, x, y):
    t = NP[dt]
    a4, b4 = a.astype(t).reshape(1, -1, 1, 1), b.reshape(1, -1, 1, 1)
    return ((x - a4) - y * b4) * a4


def operands(dt: D, shape, layout: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    t = NP[dt]
    n, c, h, w = shape
    a = rng.standard_normal(c).astype(np.float32)
    b = rng.standard_normal(c).astype(t)

    def big():
        if layout == "channels_last":
            return rng.standard_normal((n, h, w, c)).astype(t).transpose(0, 3, 1, 2)
        if layout == "strided":
            return rng.standard_normal((n, c, h, 2 * w)).astype(t)[..., ::2]
        return rng.standard_normal(shape).astype(t)
    return a, b, big(), big()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
@pytest.mark.parametrize("dt", [D.FLOAT, D.FLOAT16, D.BF16])
@pytest.mark.parametrize("limits", PATHS, ids=PATH_IDS)
def test_every_chunking_gives_the_direct_bits(dt, layout, limits):
    shape = (3, 5, 9, 130)  # a channel's run (9·130) is longer than MIN_RUN
    assert shape[2] * shape[3] >= chunking.MIN_RUN
    a, b, x, y = operands(dt, shape, layout)
    attrs = FusedAttrs(shape=shape, body=body(dt, shape[1]), result="t6", out_dtype=dt)
    expected = direct(dt, a, b, x, y)
    got = P.run_fused(attrs, [a, b, x, y], **limits)
    assert got.dtype == expected.dtype
    assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))
    out = np.full(shape, 7, NP[dt])  # written in place, every element
    P.run_fused(attrs, [a, b, x, y], out=out, **limits)
    assert np.array_equal(out.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))
    y_too = y.copy()  # out is the input y (read by an earlier step)
    P.run_fused(attrs, [a, b, x, y_too], out=y_too, **limits)
    assert np.array_equal(y_too.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))


def test_chunks_within_a_channel_only_where_memory_is_channel_major():
    shape = (2, 3, 40, 40)
    per_channel = [np.ones((1, 3, 1, 1), np.float32)]
    nchw = np.zeros(shape, np.float32)
    nhwc = np.zeros((2, 40, 40, 3), np.float32).transpose(0, 3, 1, 2)
    assert chunking.per_block_dims(shape, per_channel, [nchw, nchw]) == (1,)
    assert chunking.per_block_dims(shape, per_channel, [nchw, nhwc]) == ()
    assert chunking.per_block_dims((2, 3, 4, 4), per_channel, [np.zeros((2, 3, 4, 4))]) == ()


def test_scratch_buffers_carry_nothing_between_bodies_sizes_and_threads():
    """Two bodies and two sizes alternate on two threads; each result stays the direct one."""
    cases = []
    for k, (dt, shape) in enumerate([(D.FLOAT, (2, 4, 8, 160)), (D.FLOAT, (3, 4, 8, 150)),
                                     (D.FLOAT16, (2, 4, 8, 160))]):
        a, b, x, y = operands(dt, shape, "contiguous", seed=k)
        attrs = FusedAttrs(shape=shape, body=body(dt, shape[1]), result="t6", out_dtype=dt)
        cases.append((attrs, [a, b, x, y], direct(dt, a, b, x, y)))
    failures: list[str] = []

    def work(order):
        for _ in range(5):
            for k in order:
                attrs, ins, expected = cases[k]
                got = P.run_fused(attrs, ins, limit=300, channel_limit=700, whole_limit=0)
                if not np.array_equal(got.view(np.uint8), expected.view(np.uint8)):
                    failures.append(f"case {k}")
    threads = [threading.Thread(target=work, args=(o,)) for o in ([0, 1, 2], [2, 1, 0])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


def test_chunks_of_two_shapes_reuse_their_scratch_from_call_to_call(monkeypatch):
    """Blocks of 3 and 2 rows alternate (a remainder): each shape keeps its buffers, so a second
    call allocates nothing (in a process without steady malloc settings every fresh buffer of a
    real size is an mmap and its page faults: 48x64x56x56 ran 29 ms, 16 ms with this)."""
    monkeypatch.setattr(P, "run_split", lambda work, items: work(items))  # this thread's scratch
    shape = (5, 4, 8, 160)
    a, b, x, y = operands(D.FLOAT, shape, "contiguous")
    attrs = FusedAttrs(shape=shape, body=body(D.FLOAT, shape[1]), result="t6", out_dtype=D.FLOAT)
    P._SCRATCH.buffers = {}
    limits = dict(limit=1000, channel_limit=3 * 8 * 160, whole_limit=0, row_limit=0)  # in a channel
    got = P.run_fused(attrs, [a, b, x, y], **limits)
    assert np.array_equal(got.view(np.uint8), direct(D.FLOAT, a, b, x, y).view(np.uint8))
    kept = {k: id(v) for k, v in P._SCRATCH.buffers.items()}
    assert {v.shape[0] for v in P._SCRATCH.buffers.values()} == {3, 2}
    P.run_fused(attrs, [a, b, x, y], **limits)
    assert {k: id(v) for k, v in P._SCRATCH.buffers.items()} == kept


def test_the_chunked_plan_is_built_once_on_first_use_and_never_seen_half_built():
    shape = (2, 4, 8, 160)
    a, b, x, y = operands(D.FLOAT, shape, "contiguous")
    attrs = FusedAttrs(shape=shape, body=body(D.FLOAT, shape[1]), result="t6", out_dtype=D.FLOAT)
    prog = P.Program(attrs, [Sig(D.FLOAT, v.shape) for v in (a, b, x, y)])
    assert prog.__dict__["_pending"] is not None           # run_flat alone needs no chunk plan
    seen: list = []
    barrier = threading.Barrier(4)

    def read():
        barrier.wait()
        seen.append((prog.steps, prog.hoisted, prog.live_reads, prog.chunkable))
    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(seen) == 4 and all(s[0] is seen[0][0] and s[1] is seen[0][1] for s in seen)
    assert [name for _, _, name, _, _ in seen[0][0]] == ["t3", "t4", "t5", "t6"]
    assert seen[0][3] is True and prog.__dict__["_pending"] is None


def test_a_lookup_that_missed_the_plan_another_thread_then_published_finds_it():
    """A thread whose attribute lookup missed (the plan unbuilt) reaches ``__getattr__`` after
    another thread published the plan: it returns the published attribute (it raised
    AttributeError: 'live', phase 2 361001, in ~3 of 200 first calls on four threads)."""
    shape = (2, 4, 8, 160)
    a, b, x, y = operands(D.FLOAT, shape, "contiguous")
    attrs = FusedAttrs(shape=shape, body=body(D.FLOAT, shape[1]), result="t6", out_dtype=D.FLOAT)
    prog = P.Program(attrs, [Sig(D.FLOAT, v.shape) for v in (a, b, x, y)])
    published = prog.live  # the other thread's first use builds and publishes the plan
    assert P.Program.__getattr__(prog, "live") is published  # the late thread's own call


@pytest.mark.parametrize("paths", PATHS[1:], ids=PATH_IDS[1:])
def test_a_view_per_element_runs_the_body_whole(paths):
    """A body that views a full-size input into its iteration space (BatchNormElemt's [N,C,L]
    input as [N,C,L,1], here also strided) cannot be cut into chunks of its inputs: it runs
    whole, with the bits of the direct evaluation, at sizes that would be chunked."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 3, 2 * 50)).astype(np.float32)[..., ::2]
    a = rng.standard_normal(3).astype(np.float32)
    attrs = FusedAttrs(shape=(4, 3, 50, 1), body=(
        I("view", "in0", shape=(4, 3, 50, 1)), I("view", "in1", shape=(1, 3, 1, 1)),
        I("sub", "t0", "t1")), result="t2", out_dtype=D.FLOAT)
    got = P.run_fused(attrs, [x, a], **paths)
    want = x.reshape(4, 3, 50, 1) - a.reshape(1, 3, 1, 1)
    assert got.shape == (4, 3, 50, 1) and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not P.program(attrs, [x, a]).chunkable


@pytest.mark.parametrize("dt", [D.FLOAT, D.FLOAT16, D.BF16])
def test_a_small_body_stores_its_last_step_into_out_even_in_place(dt):
    """Up to FLAT_ELEMS elements the body runs straight through; a float32 body computes its last
    step straight into ``out`` (f16/bf16 round first, then store). Either way, and with ``out``
    one of the body's own inputs, every element gets the direct bits."""
    shape = (2, 3, 4, 5)
    assert np.prod(shape) <= P.FLAT_ELEMS
    a, b, x, y = operands(dt, shape, "contiguous", seed=3)
    attrs = FusedAttrs(shape=shape, body=body(dt, shape[1]), result="t6", out_dtype=dt)
    expected = direct(dt, a, b, x, y)
    assert P.program(attrs, [a, b, x, y]).flat_store is (dt == D.FLOAT)
    out = np.full(shape, 7, NP[dt])
    P.run_fused(attrs, [a, b, x, y], out=out)
    assert np.array_equal(out.view(np.uint8), expected.view(np.uint8))
    P.run_fused(attrs, [a, b, x, y], out=y)  # in place: y is read by the step that writes it
    assert np.array_equal(y.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("int_dtype", [np.int32, np.int64, np.uint8, np.bool_])
def test_an_integer_cast_to_float32_in_a_body_rounds_once_to_nearest_even(int_dtype):
    """A counter cast (int → f32) in a fused body: one round-to-nearest-even from the exact
    integer. The expected values are exact ints rounded by hand (ties to even at 2^24)."""
    if int_dtype in (np.int32, np.int64):
        ints = [3, -7, 2**24 + 1, 2**24 + 3, 2**31 - 1, -2**31]
        want = [3.0, -7.0, 2.0**24, 2.0**24 + 4, 2.0**31, -2.0**31]
        if int_dtype is np.int64:
            ints, want = ints + [2**40 + 2**16 + 1], want + [2.0**40 + 2**17]
    else:
        ints = [0, 1, 255] if int_dtype is np.uint8 else [False, True]
        want = [float(v) for v in ints]
    x = np.array(ints, int_dtype)
    attrs = FusedAttrs(shape=x.shape, body=(I("cast", "in0"),), result="t0", out_dtype=D.FLOAT)
    got = P.run_fused(attrs, [x])
    assert np.array_equal(got.view(np.uint32), np.float32(want).view(np.uint32))


@pytest.mark.parametrize("dt", [D.FLOAT, D.FLOAT16])
def test_the_result_chain_runs_in_the_output_chunk_when_it_is_apart(dt):
    """((x - a) - y·b)·a: the float32 result's chain (x - a, then its buffer reused) is computed
    in the output chunk itself, no scratch temporary for it, when the output shares no memory
    with an operand; an output over y (read after the chain starts) keeps the scratch buffer.
    float16 results round before the store: no chain in the output."""
    shape = (3, 5, 9, 130)
    a, b, x, y = operands(dt, shape, "contiguous")
    attrs = FusedAttrs(shape=shape, body=body(dt, shape[1]), result="t6", out_dtype=dt)
    prog = P.program(attrs, [a, b, x, y])
    assert prog.into_out == ("t3" if dt == D.FLOAT else None)
    expected = np.ascontiguousarray(direct(dt, a, b, x, y))
    for out, apart in ((np.full(shape, 7, NP[dt]), True), (y.copy(), False)):
        P._SCRATCH.buffers = {}  # this thread's temporaries, as the run leaves them
        ins = [a, b, x, out if not apart else y]
        P.run_fused(attrs, ins, out=out, limit=700, channel_limit=1 << 30, whole_limit=0)
        assert np.array_equal(out.view(np.uint8), expected.view(np.uint8))
        kept = {key[0] for key in P._SCRATCH.buffers}
        assert ("t3" in kept) == (not apart or dt != D.FLOAT)


@pytest.mark.parametrize("limits", PATHS, ids=PATH_IDS)
def test_pow_takes_its_path_from_the_exponent_register_not_from_a_chunk(limits):
    """Pow special-cases a one-element exponent tensor (−0.5: 1/sqrt in float32); a per-channel
    exponent takes the general path (float64 power, rounded once) in every chunk, even where a
    chunk of it holds one element."""
    rng = np.random.default_rng(5)
    x = rng.uniform(0.1, 10, (4, 3, 40, 40)).astype(np.float32)
    general = (x.astype(np.float64) ** -0.5).astype(np.float32)
    special = np.float32(1) / np.sqrt(x)
    assert not np.array_equal(general, special)  # the two paths differ on this data
    for e, want in ((np.full((1, 3, 1, 1), -0.5, np.float32), general),
                    (np.full((1, 1, 1, 1), -0.5, np.float32), special)):
        attrs = FusedAttrs(shape=x.shape, result="t0", out_dtype=D.FLOAT,
                           body=(I("pow", "in0", "in1"),))
        got = P.run_fused(attrs, [x, e], **limits)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("limits", PATHS, ids=PATH_IDS)
def test_a_sum_of_per_element_values_runs_the_body_whole(limits):
    """x − Σx: the sum needs every element, so the body is not cut into chunks (it crashed on
    chunks: a chunk is not the register the sum reads). Small integers: the sum is exact in
    any order."""
    x = np.random.default_rng(6).integers(-8, 9, (4, 3, 40, 40)).astype(np.float32)
    attrs = FusedAttrs(shape=x.shape, result="t1", out_dtype=D.FLOAT,
                       body=(I("sum", "in0"), I("sub", "in0", "t0")))
    got = P.run_fused(attrs, [x], **limits)
    want = x - np.float32(x.astype(np.float64).sum())
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not P.program(attrs, [x]).chunkable
