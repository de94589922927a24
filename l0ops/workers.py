"""Worker threads for the numpy interpreter: numpy releases the GIL inside its loops, so the chunks
of a large fused body (each ~10^5 elements, tens of µs of numpy work per step) run side by side
on a few Python threads. Which thread runs a chunk never changes what the chunk computes:
results are identical for any thread count.

* ``$OPGRAPH_NUM_THREADS`` (else the CPUs this process may use) sets the count, the caller
  included; :func:`set_threads` changes it (1: everything on the caller).
* The pool is made on first use and again in a forked child (whose copy has no threads).
* Every part runs under the caller's ``np.errstate``; a part's exception reaches the caller,
  after every part has finished. A split asked for inside a part (the caller's included) runs
  there, serially (the pool's threads are busy with the other parts).

    >>> out = []
    >>> run_split(out.extend, range(5), parts=2)
    >>> sorted(out)
    [0, 1, 2, 3, 4]
"""
from __future__ import annotations

import concurrent.futures as futures
import os
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from opgraph.core.config import default_threads

PARALLEL_ELEMS = 1 << 20  # work this large is shared among the threads (smaller: the caller)
_STATE: dict[str, Any] = {"threads": None, "pool": None, "size": 0, "pid": None}
_LOCK = threading.Lock()
_LOCAL = threading.local()  # in_pool: this thread is running a part for run_split


def threads() -> int:
    """How many threads (the caller included) :func:`run_split` uses."""
    n = _STATE["threads"]
    if n is None:
        n = _STATE["threads"] = default_threads()
    return n


def set_threads(n: int) -> None:
    """Use ``n`` >= 1 threads (the caller included) from now on."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"threads must be an integer >= 1, got {n!r}")
    _STATE["threads"] = n


def _pool(workers: int) -> futures.ThreadPoolExecutor:
    with _LOCK:
        pool = _STATE["pool"]
        if pool is None or _STATE["pid"] != os.getpid() or _STATE["size"] < workers:
            if pool is not None and _STATE["pid"] == os.getpid():
                pool.shutdown(wait=False)  # a smaller one: its threads end when idle
            pool = futures.ThreadPoolExecutor(workers, thread_name_prefix="opgraph-numpy")
            _STATE.update(pool=pool, size=workers, pid=os.getpid())
        return pool


def run_split(work: Callable[[Sequence[Any]], None], items: Sequence[Any],
              parts: Optional[int] = None) -> None:
    """``work(part)`` for ``parts`` (default :func:`threads`) consecutive runs of ``items``: the
    first on the calling thread, the others on the pool."""
    n = min(parts or threads(), len(items))
    if n <= 1 or getattr(_LOCAL, "in_pool", False):  # nested in a part: the pool may be full
        work(items)
        return
    cuts = [len(items) * k // n for k in range(n + 1)]
    runs = [items[cuts[k]:cuts[k + 1]] for k in range(n)]
    state = np.geterr()

    def part(run: Sequence[Any]) -> None:
        _LOCAL.in_pool = True
        try:
            with np.errstate(**state):
                work(run)
        finally:
            _LOCAL.in_pool = False
    pending = [_pool(n - 1).submit(part, run) for run in runs[1:]]
    _LOCAL.in_pool = True  # the caller's part too: a split inside it would wait for the pool
    try:
        work(runs[0])
    finally:
        _LOCAL.in_pool = False
        futures.wait(pending)
    for f in pending:
        f.result()  # a worker's exception, raised here


__all__ = ["PARALLEL_ELEMS", "run_split", "set_threads", "threads"]
