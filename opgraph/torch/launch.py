"""Run a function on N local processes joined in a gloo process group on 127.0.0.1 — what the
tests, ``opgraph syncbn``, the example and the benchmark use. Every process is joined or
killed before :func:`run_ranks` returns; a rank that fails, dies or overruns the deadline
raises :class:`RankError` with its traceback, and the collectives time out instead of hanging.

    >>> free_port() > 0
    True
"""
from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import pickle
import socket
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

RankFn = Callable[..., Any]
AFTERMATH = 1.0  # seconds to collect the other ranks' failures after the first
# what the fork server imports once for all ranks: torch's autograd imports sympy (through
# symbolic_shapes) at the first backward, ~3 s per process otherwise
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel",
           "torch.fx.experimental.symbolic_shapes", "opgraph.torch"]


class RankError(RuntimeError):
    r"""Ranks of :func:`run_ranks` failed, died or did not finish in time: ``failures`` holds
    one text per rank (a traceback), the likely cause first; ``summary`` is one line of it.

    >>> RankError(["rank 1 failed:\nTraceback ...\nValueError: no"]).summary
    'rank 1 failed: ValueError: no'
    """

    def __init__(self, failures: Sequence[str]) -> None:
        super().__init__("\n".join(failures))
        self.failures = list(failures)

    @property
    def summary(self) -> str:
        """The first rank's failure in one line (its first and last lines for a traceback)."""
        first = self.failures[0].strip().splitlines()
        return first[0] if len(first) == 1 else f"{first[0]} {first[-1].strip()}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo(rank: int, world_size: int, port: int, timeout: float = 30.0) -> None:
    """Join the default process group: gloo, rendezvous at tcp://127.0.0.1:``port``, every
    collective bounded by ``timeout`` seconds."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))


def leave_group() -> None:
    """Leave the default process group, if this process is in one, so that it can exit cleanly.

    Unreachable objects are collected first: a ``DistributedDataParallel`` model can sit in a
    reference cycle that holds the group (the example's does), so without this the group outlives
    ``destroy_process_group`` and its gloo threads are torn down at interpreter exit, where a
    still-running ``std::thread`` aborts the process ("terminate called without an active
    exception"; measured 9 runs in 45 of the torchrun example before this).

        >>> leave_group()            # not in a group: nothing to do
        >>> dist.is_initialized()
        False
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(fn: RankFn, rank: int, world_size: int, port: int, packed_args: bytes,
               conn: Any, pg_timeout: float, threads: int, opgraph_threads: str) -> None:
    """The body of one spawned rank: join the group, run ``fn``, send back its result — before
    leaving the group, so that a failing rank reports before its peers notice it is gone."""
    try:
        args = pickle.loads(packed_args)
        torch.set_num_threads(threads)
        # opgraph's thread teams too (the native kernels', the numpy chunks'): ranks sharing the
        # cores must not each start a team as large as the machine, whose idle workers spin
        os.environ["OPGRAPH_NUM_THREADS"] = opgraph_threads
        init_gloo(rank, world_size, port, pg_timeout)
        message = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 — everything goes back to the parent as text
        message = ("error", traceback.format_exc())
    try:
        # plain pickle: torch's multiprocessing reducers would pass tensors as shared-memory
        # handles that die with this process
        try:
            data = pickle.dumps(message)
        except Exception as e:  # a result that cannot travel: say so, as an error of this rank
            data = pickle.dumps(("error", f"the rank's result could not be pickled: "
                                          f"{type(e).__name__}: {e}"))
        conn.send_bytes(data)
        conn.close()
    finally:
        leave_group()


def run_ranks(fn: RankFn, world_size: int, args: Sequence[Any] = (), *, timeout: float = 120.0,
              pg_timeout: float = 30.0, threads: Optional[int] = None) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each rank a fresh process in
    a gloo group of ``world_size``. ``fn`` must be importable (a module-level function) and its
    result picklable. ``timeout`` bounds the run from the moment every rank is started (starting
    the fork server, which imports torch once, a few seconds, is not counted), ``pg_timeout``
    each collective;
    ``threads`` is torch's intra-op thread count per rank and, unless ``$OPGRAPH_NUM_THREADS``
    is set, opgraph's (default: the cores shared out). Each rank gets its own copy of ``args``
    (plain pickle: a tensor or model is not shared between the ranks and the caller).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    # read here: a fork server's children have the environment it started with, not ours
    opgraph_threads = os.environ.get("OPGRAPH_NUM_THREADS", "").strip() or str(threads)
    # plain pickle, as the results come back: torch's multiprocessing reducers would move a
    # tensor (a model's parameters) into shared memory, one copy for the caller and every rank
    packed_args = pickle.dumps(tuple(args))
    ctx = _context()
    port = free_port()
    procs, conns, ok = [], {}, False
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, name=f"opgraph-rank{rank}", daemon=True,
                            args=(fn, rank, world_size, port, packed_args, send, pg_timeout,
                                  threads, opgraph_threads))
            p.start()
            send.close()
            procs.append(p)
            conns[recv] = rank
        results = _collect(procs, conns, time.monotonic() + timeout, timeout)
        ok = True
        return results
    finally:  # after a failure the peers may be blocked in a collective: no grace then
        _stop(procs, grace=5.0 if ok else 0.0)
        for c in conns:
            c.close()


def _context() -> Any:
    """A fork server that has imported torch and opgraph.torch once (each rank then starts in
    milliseconds, not seconds), or plain spawn where there is no fork server."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _collect(procs: list[Any], conns: dict[Any, int], deadline: float,
             timeout: float) -> list[Any]:
    """Every rank's result in rank order; RankError at the first failure (with the failures
    that follow within AFTERMATH seconds: the first one listed is usually the cause)."""
    results: dict[int, Any] = {}
    failures: list[str] = []
    pending = dict(conns)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            if not failures:
                failures.append(f"ranks {sorted(pending.values())} did not finish within "
                                f"{timeout:g} s")
            break
        for c in wait(list(pending), timeout=left):
            rank = pending.pop(c)
            try:
                status, value = pickle.loads(c.recv_bytes())
            except EOFError:
                procs[rank].join(5)
                status, value = "died", f"exit code {procs[rank].exitcode}"
            if status == "ok":
                results[rank] = value
            elif status == "died":
                failures.append(f"rank {rank} died ({value}) without a result")
            else:
                failures.append(f"rank {rank} failed:\n{value}")
        if failures:
            deadline = min(deadline, time.monotonic() + AFTERMATH)
    if failures:
        raise RankError(failures)
    return [results[r] for r in range(len(procs))]


def _stop(procs: list[Any], grace: float) -> None:
    """Join every process; kill the ones still running after ``grace`` seconds."""
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


__all__ = ["RankError", "free_port", "init_gloo", "leave_group", "run_ranks"]
