"""run_ranks: gloo ranks on 127.0.0.1 whose results come back in rank order, and whose failures,
deaths, hangs and dead peers end in a RankError within a bounded time, every process stopped."""
from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
import weakref

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")

import torch.distributed as dist  # noqa: E402

from backends import native  # noqa: E402
from opgraph.torch import RankError, leave_group, run_ranks  # noqa: E402


def who(rank, world, tag):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world, dist.get_rank(), dist.get_world_size(), tag, float(t), os.getpid()


def threads_here(rank, world):
    """torch's threads, what opgraph's read, and the native team's size (None without a compiler)."""
    team = native.team.threads() if native.available() else None
    return torch.get_num_threads(), os.environ.get("OPGRAPH_NUM_THREADS"), team


def fail_on_1(rank, world):
    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # blocked: its peer is gone


def die_on_1(rank, world):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def unpicklable_on_1(rank, world):
    return threading.Lock() if rank == 1 else rank


def hang_on_1(rank, world):
    if rank == 1:
        time.sleep(60)


def skip_a_collective_on_1(rank, world):
    if rank == 0:
        dist.all_reduce(torch.zeros(3))  # rank 1 never joins: gloo times out
    else:
        time.sleep(30)                   # alive, but elsewhere


def ddp_freed_by_leave_group(rank, world):
    gc.disable()                    # no collection but leave_group's
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        model(torch.ones(1, 2)).sum().backward()
        alive = weakref.ref(model)
        del model                   # only a reference cycle still holds it (and the group)
        held_before = alive() is not None
        leave_group()
        return held_before, alive() is None, dist.is_initialized()
    finally:
        gc.enable()


def add_in_place(rank, world, x, model):
    dist.barrier()                  # every rank has its arguments before any changes them
    x.add_(10 ** rank)
    with torch.no_grad():
        model.weight.add_(10 ** rank)
    dist.barrier()                  # every rank has changed them before any reads them
    return x.tolist(), model.weight.flatten().tolist()


def no_children_left():
    return not [p for p in multiprocessing.active_children() if p.name.startswith("opgraph-rank")]


def test_results_come_back_in_rank_order():
    out = run_ranks(who, 3, ("x",), timeout=60)
    assert [o[:5] for o in out] == [(r, 3, r, 3, "x") for r in range(3)]
    assert all(o[5] == 6.0 for o in out)                     # 1 + 2 + 3 over gloo
    assert len({o[6] for o in out} | {os.getpid()}) == 4     # separate processes
    assert no_children_left()


@pytest.mark.parametrize("fn,message", [
    (fail_on_1, r"rank 1 failed:(.|\n)*ValueError: rank one refuses"),
    (die_on_1, r"rank 1 died \(exit code 3\)"),
    (unpicklable_on_1, r"rank 1 failed:(.|\n)*result could not be pickled: TypeError"),
], ids=["raises", "dies", "unpicklable result"])
def test_a_failing_rank_is_reported_and_its_peers_stopped(fn, message):
    start = time.monotonic()
    with pytest.raises(RankError, match=message):
        run_ranks(fn, 2, timeout=60, pg_timeout=30)
    assert time.monotonic() - start < 20          # the blocked peer is killed, not waited for
    assert no_children_left()


def test_a_hanging_rank_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[1\] did not finish within 3 s"):
        run_ranks(hang_on_1, 2, timeout=3)
    assert time.monotonic() - start < 15
    assert no_children_left()


def test_a_collective_without_its_peer_times_out():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 0 failed(.|\n)*[Tt]imed out"):
        run_ranks(skip_a_collective_on_1, 2, timeout=60, pg_timeout=2)
    assert 2 <= time.monotonic() - start < 20     # pg_timeout, not the 30 s nap nor the 60 s
    assert no_children_left()


def test_leave_group_frees_ddp_before_leaving():
    # a DDP model left in its reference cycle would keep the group (and its gloo threads) alive
    # until interpreter exit, where tearing them down can abort the process
    assert run_ranks(ddp_freed_by_leave_group, 2, timeout=60) == [(True, True, False)] * 2
    assert no_children_left()


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_ranks(who, 0)


def test_ranks_share_the_cores_with_opgraphs_threads_too(monkeypatch):
    monkeypatch.delenv("OPGRAPH_NUM_THREADS", raising=False)
    shared = max(1, (os.cpu_count() or 1) // 2)
    out = run_ranks(threads_here, 2, timeout=60)
    team = shared if out[0][2] is not None else None
    assert out == [(shared, str(shared), team)] * 2
    monkeypatch.setenv("OPGRAPH_NUM_THREADS", "3")  # the user's choice is kept
    out = run_ranks(threads_here, 2, timeout=60, threads=1)
    assert [o[:2] for o in out] == [(1, "3")] * 2 and out[0][2] in (3, None)


def test_each_rank_gets_its_own_copy_of_the_arguments():
    """torch's multiprocessing reducers moved a tensor argument (a model's parameters) into
    shared memory: every rank saw the others' in-place changes, and so did the caller."""
    x, model = torch.zeros(2), torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    got = run_ranks(add_in_place, 2, (x, model), timeout=60.0, pg_timeout=20.0)
    assert got == [([1.0, 1.0], [1.0, 1.0]), ([10.0, 10.0], [10.0, 10.0])]
    assert x.tolist() == [0.0, 0.0] and not x.is_shared() and not model.weight.is_shared()
    assert no_children_left()
