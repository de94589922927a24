"""The numpy interpreter's worker threads (l0ops.workers): a large chunked body gives the same bits
on 1, 2 or 3 threads (checked against float32 numpy written out here), an output that overlaps
an input keeps the serial order, every part runs under the caller's np.errstate, a worker's
exception reaches the caller after every part has finished, and a forked child gets a pool
that works."""
from __future__ import annotations

import os
import threading
import time
import warnings

import numpy as np
import pytest

import l0ops.interpreter as interpreter
from l0ops import workers
from l0ops import ordered
from l0ops.ordered import ordered_sum
from l0ops.primitives import FusedAttrs, Instr
from opgraph.core.config import default_threads
from opgraph.core.dtypes import DataType as D
from forked import in_forked_child
from sum_model import loop_sum

SHAPE = (16, 8, 96, 96)  # past PARALLEL_ELEMS, chunked within channels
BODY = FusedAttrs(shape=SHAPE, result="t2", out_dtype=D.FLOAT, body=(
    Instr(op="sub", args=("in0", "in1"), dtype=D.FLOAT),
    Instr(op="mul", args=("t0", "in2"), dtype=D.FLOAT),
    Instr(op="add", args=("t1", "in0"), dtype=D.FLOAT),
))


def operands(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    C = SHAPE[1]
    return [rng.standard_normal(SHAPE).astype(np.float32),
            rng.standard_normal((1, C, 1, 1)).astype(np.float32),
            rng.uniform(0.5, 2, (1, C, 1, 1)).astype(np.float32)]


def expected(ins: list[np.ndarray]) -> np.ndarray:
    return (ins[0] - ins[1]) * ins[2] + ins[0]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_any_thread_count_gives_the_same_bits(thread_count, n):
    assert np.prod(SHAPE) >= interpreter.PARALLEL_ELEMS
    thread_count(n)
    ins = operands(n)
    got = interpreter.run_fused(BODY, ins, out=np.empty(SHAPE, np.float32))
    assert np.array_equal(got.view(np.uint32), expected(ins).view(np.uint32))


def test_the_chunks_are_shared_unless_the_output_overlaps_an_input(thread_count, monkeypatch):
    thread_count(2)
    calls = []
    real = interpreter.run_split
    monkeypatch.setattr(interpreter, "run_split", lambda work, items: calls.append(len(items))
                        or real(work, items))
    ins = operands(4)
    want = expected(ins)
    interpreter.run_fused(BODY, ins, out=np.empty(SHAPE, np.float32))
    assert len(calls) == 1 and calls[0] > 1
    interpreter.run_fused(BODY, ins, out=ins[0])  # in place: the blocks' order is kept
    assert len(calls) == 1
    assert np.array_equal(ins[0].view(np.uint32), want.view(np.uint32))


def test_every_part_runs_under_the_callers_error_state():
    def divide(part):  # only the parts the pool runs divide by zero
        if part[0] != 0:
            np.float32(1) / np.zeros(len(part), np.float32)
    with np.errstate(divide="raise"), pytest.raises(FloatingPointError):
        workers.run_split(divide, range(8), parts=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="ignore"):
            workers.run_split(divide, range(8), parts=4)


def test_a_workers_exception_arrives_after_every_part_finished():
    finished = []

    def work(part):
        if part[0] == 4:
            raise KeyError("part two")
        time.sleep(0.05)
        finished.append(part[0])
    with pytest.raises(KeyError, match="part two"):
        workers.run_split(work, list(range(12)), parts=3)
    assert sorted(finished) == [0, 8]


def test_each_item_once_in_consecutive_runs():
    for n in range(0, 8):
        for parts in range(1, 6):
            runs, lock = [], threading.Lock()

            def work(part):
                with lock:
                    runs.append(list(part))
            workers.run_split(work, list(range(n)), parts=parts)
            assert sorted(x for r in runs for x in r) == list(range(n))
            assert all(r == list(range(r[0], r[0] + len(r))) for r in runs if r)


def test_a_forked_child_gets_a_working_pool(thread_count):
    thread_count(2)
    workers.run_split(lambda part: None, range(4))  # the parent's pool exists now

    def child() -> bool:  # the pool's threads did not survive the fork
        out: list = []
        workers.run_split(out.extend, list(range(6)))
        return sorted(out) == list(range(6))
    in_forked_child(child, "on the worker pool")


def test_thread_counts_from_the_caller_and_the_environment(thread_count, monkeypatch):
    thread_count(3)
    assert workers.threads() == 3
    for bad in (0, -2, 1.5, "2", True):
        with pytest.raises(ValueError, match="threads must be an integer >= 1"):
            workers.set_threads(bad)
    monkeypatch.setenv("OPGRAPH_NUM_THREADS", "5")
    assert default_threads() == 5
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("OPGRAPH_NUM_THREADS", bad)
        with pytest.raises(ValueError, match="OPGRAPH_NUM_THREADS must be an integer >= 1"):
            default_threads()
    monkeypatch.delenv("OPGRAPH_NUM_THREADS")
    assert default_threads() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ordered_sums_over_threads_keep_their_bits(thread_count, monkeypatch, n):
    """A sum this large splits its kept rows among the threads: each channel's sum is still the
    one it has alone (a smaller sum, on the caller) and the documented order's (loop model)."""
    thread_count(n)
    split = []
    monkeypatch.setattr(ordered, "run_split", lambda work, rows: split.append(rows)
                        or workers.run_split(work, rows))
    x = np.random.default_rng(7).standard_normal(SHAPE).astype(np.float32)
    assert x.size >= workers.PARALLEL_ELEMS
    got = ordered_sum(x, (0, 2, 3))
    assert split == [range(SHAPE[1])]
    alone = np.stack([ordered_sum(x[:, k], (0, 1, 2)) for k in range(SHAPE[1])])
    assert np.array_equal(got.view(np.uint32), alone.view(np.uint32))
    assert got[5].view(np.uint32) == np.float32(loop_sum(list(x[:, 5].ravel()))).view(np.uint32)


def test_a_split_inside_a_part_runs_there(thread_count):
    """No deadlock when a part asks for a split itself (the pool's one worker is busy with it)."""
    thread_count(2)
    out, lock = [], threading.Lock()

    def inner(part):
        with lock:
            out.extend(part)

    def outer(part):
        workers.run_split(inner, [10 * k + j for k in part for j in range(3)])
    done = threading.Event()
    t = threading.Thread(target=lambda: (workers.run_split(outer, range(4)), done.set()),
                         daemon=True)
    t.start()
    t.join(timeout=30)
    assert done.is_set(), "a nested split hung"
    assert sorted(out) == sorted(10 * k + j for k in range(4) for j in range(3))


def test_a_split_inside_the_callers_part_runs_on_the_caller(thread_count):
    """The caller's own part is a part too: a split inside it runs there, serially, instead of
    queueing behind the other parts on the pool (channel blocks sum inside their parts)."""
    thread_count(2)
    where = []

    def inner(part):
        where.append((threading.get_ident(), list(part)))

    def outer(part):
        if 0 in part:  # the caller's part
            workers.run_split(inner, range(6))
    workers.run_split(outer, range(2))
    assert where == [(threading.get_ident(), list(range(6)))]
