"""A persistent thread team for native kernels: threads are started once and reused, and a call
never waits for a thread that has not started working.

A kernel splits its work into ``n`` items and calls ``run(body, ctx, n, grain)`` (the address
:func:`runner` returns, passed to the kernel as an argument): the calling thread and the team's
workers claim ``grain`` consecutive items at a time from one atomic counter until none are left,
and the call returns once every claimed item is finished. The caller works too, so a worker that
the OS has not scheduled (another process on the core, another thread team spinning) only loses
its share instead of holding up the call, as a fork-join barrier would. Which thread runs an item
never changes what the item computes: results are identical for any thread count.

* Idle workers spin for ``$OPGRAPH_SPIN_US`` microseconds of their own CPU time (default
  :data:`SPIN_US`) after a job, then sleep on a condition variable; back-to-back calls find them
  awake.
* One job at a time: a call made while the team is busy (another Python thread, a nested call)
  runs on its own thread, serially.
* ``$OPGRAPH_NUM_THREADS`` (else the CPUs this process may use) sets the team size;
  :func:`set_threads` changes it (1: every call runs on the caller). A forked child starts with
  no workers and creates them on its first parallel call.

**Sharing an OpenMP runtime.** When the process already runs an OpenMP runtime (libgomp, e.g.
torch's CPU ops), two spinning thread pools on the same cores tax each other: torch's idle
workers spin on the core this team's worker needs, and this team's on torch's. :func:`share_openmp`
(called on the first parallel call when one is already loaded, and by :mod:`opgraph.torch`
on import, unless ``$OMP_WAIT_POLICY`` is ``passive``: :func:`share_openmp_if_spinning`)
then runs the same claims on that runtime's threads instead (``omp parallel for
schedule(dynamic, 1)``, :func:`threads` of them): the items and their results are the same, and
``$OPGRAPH_SPIN_US`` no longer applies (the runtime's own wait policy does). A forked child
cannot use the parent's OpenMP threads (libgomp hangs there, torch's ops included), so there the
calls go back to this team. ``$OPGRAPH_RUNTIME=team`` keeps the team regardless.

From C: ``typedef void (*opg_body)(void *ctx, int64_t begin, int64_t end);`` and
``void opg_team_run(opg_body body, void *ctx, int64_t n, int64_t grain)`` (:data:`C_DECL`).

    >>> ok = __import__("backends.native.build", fromlist=["_"]).availability()[0]
    >>> set_threads(2) if ok else None
    >>> threads() if ok else 2
    2
"""
from __future__ import annotations

import ctypes
import os
import re
from typing import Any, Optional

from opgraph.core.config import default_threads, env_number
from . import build

SPIN_US = 2000  # µs idle workers poll for the next job before they sleep (OpenMP runtimes spin ms too)

C_DECL = """typedef void (*opg_body)(void *ctx, int64_t begin, int64_t end);
typedef void (*opg_run)(opg_body body, void *ctx, int64_t n, int64_t grain);
"""

SOURCE = r"""#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
""" + C_DECL + r"""
#define OPG_MAX_THREADS 256
#define OPG_SETUP 0xFFFFFFFFu  /* low half of `word` while a job is being published */

/* `word` = generation << 32 | index of the next claim. A worker reads the job's fields after
   seeing a generation and claims with a CAS on `word`: the CAS fails if the caller has begun
   publishing another job since (it first stores OPG_SETUP), so a claim always runs the job whose
   fields were read. `done` counts finished claims; the caller returns when all are done. */
static struct {
    _Atomic uint64_t word;
    _Atomic(opg_body) body;
    _Atomic(void *) ctx;
    _Atomic int64_t n, grain, claims, done;
    _Atomic int sleepers, active, busy;
    _Atomic int64_t spin_ns;
    int workers;                     /* threads created (guarded by `mu`) */
    uint32_t born[OPG_MAX_THREADS];  /* per worker: the generation before its first job */
    pthread_mutex_t mu;
    pthread_cond_t cv;
} T = {.active = 1, .spin_ns = 2000000, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static inline void opg_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* This thread's CPU time: a worker that the OS deschedules keeps its spin budget, so it does
   not fall asleep unseen and get woken onto the caller's CPU. */
static int64_t opg_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claim and run items of generation `gen` until none are left or a new job is published. */
static void opg_work(uint32_t gen) {
    opg_body body = atomic_load(&T.body);
    void *ctx = atomic_load(&T.ctx);
    const int64_t n = atomic_load(&T.n), grain = atomic_load(&T.grain), claims = atomic_load(&T.claims);
    uint64_t w = atomic_load(&T.word);
    for (;;) {
        const uint32_t i = (uint32_t)w;
        if ((uint32_t)(w >> 32) != gen || i == OPG_SETUP || (int64_t)i >= claims) return;
        if (!atomic_compare_exchange_weak(&T.word, &w, w + 1)) continue;
        const int64_t b = (int64_t)i * grain, e = b + grain < n ? b + grain : n;
        body(ctx, b, e);
        atomic_fetch_add(&T.done, 1);
        w = atomic_load(&T.word);
    }
}

static void *opg_worker(void *arg) {
    const int index = (int)(intptr_t)arg;    /* 1 .. workers; the caller is 0 */
    uint32_t seen = T.born[index];           /* the job being published when it was created */
    for (;;) {
        uint64_t w = atomic_load(&T.word);
        const int64_t until = opg_now() + atomic_load(&T.spin_ns);
        for (int k = 0; (uint32_t)(w >> 32) == seen || (uint32_t)w == OPG_SETUP; ++k) {
            if ((k & 255) == 255 && opg_now() > until) {
                pthread_mutex_lock(&T.mu);
                atomic_fetch_add(&T.sleepers, 1);
                while ((uint32_t)(atomic_load(&T.word) >> 32) == seen)
                    pthread_cond_wait(&T.cv, &T.mu);
                atomic_fetch_sub(&T.sleepers, 1);
                pthread_mutex_unlock(&T.mu);
                k = 0;
            }
            opg_relax();
            w = atomic_load(&T.word);
        }
        seen = (uint32_t)(w >> 32);
        if (index < atomic_load(&T.active)) opg_work(seen);
    }
    return 0;
}

static void opg_after_fork(void) {  /* the child has only the forking thread */
    pthread_mutex_init(&T.mu, 0);
    pthread_cond_init(&T.cv, 0);
    T.workers = 0;
    atomic_store(&T.sleepers, 0);
    atomic_store(&T.busy, 0);
}

/* Make sure `active - 1` workers exist; returns how many may take part. */
static int opg_start(void) {
    static int registered;
    const int want = atomic_load(&T.active) - 1;
    if (T.workers >= want) return want;
    pthread_mutex_lock(&T.mu);
    if (!registered) { pthread_atfork(0, 0, opg_after_fork); registered = 1; }
    while (T.workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        T.born[T.workers + 1] = (uint32_t)(atomic_load(&T.word) >> 32);  /* the job to come is new */
        const int bad = pthread_create(&t, &attr, opg_worker, (void *)(intptr_t)(T.workers + 1));
        pthread_attr_destroy(&attr);
        if (bad) break;
        T.workers += 1;
    }
    const int n = T.workers < want ? T.workers : want;
    pthread_mutex_unlock(&T.mu);
    return n;
}

void opg_team_run(opg_body body, void *ctx, int64_t n, int64_t grain) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    int expected = 0;
    const int64_t claims = (n + grain - 1) / grain;
    if (claims < 2 || atomic_load(&T.active) < 2 || claims >= (int64_t)OPG_SETUP
        || !atomic_compare_exchange_strong(&T.busy, &expected, 1)) {
        body(ctx, 0, n);              /* one claim, one thread, or the team is busy */
        return;
    }
    if (opg_start() < 1) { atomic_store(&T.busy, 0); body(ctx, 0, n); return; }
    const uint32_t gen = (uint32_t)(atomic_load(&T.word) >> 32) + 1;
    atomic_store(&T.word, ((uint64_t)gen << 32) | OPG_SETUP);
    atomic_store(&T.body, body);
    atomic_store(&T.ctx, ctx);
    atomic_store(&T.n, n);
    atomic_store(&T.grain, grain);
    atomic_store(&T.claims, claims);
    atomic_store(&T.done, 0);
    atomic_store(&T.word, (uint64_t)gen << 32);
    if (atomic_load(&T.sleepers) > 0) {
        pthread_mutex_lock(&T.mu);
        pthread_cond_broadcast(&T.cv);
        pthread_mutex_unlock(&T.mu);
    }
    opg_work(gen);
    for (int k = 0; atomic_load(&T.done) < claims; ++k) {
        if (k < 4096) opg_relax(); else sched_yield();
    }
    atomic_store(&T.busy, 0);
}

void opg_team_set(int64_t threads, int64_t spin_ns) {
    if (threads >= 1) atomic_store(&T.active, threads > OPG_MAX_THREADS ? OPG_MAX_THREADS : (int)threads);
    if (spin_ns >= 0) atomic_store(&T.spin_ns, spin_ns);
}

int64_t opg_team_threads(void) { return atomic_load(&T.active); }
"""

OPENMP_SOURCE = r"""#include <omp.h>
#include <pthread.h>
#include <stdint.h>
""" + C_DECL + r"""
static opg_run team_run;                  /* the team: what a forked child uses */
static int64_t (*team_threads)(void);     /* the team's thread count, set_threads() included */
static volatile int forked;
static void opg_omp_child(void) { forked = 1; }

void opg_omp_init(opg_run run, int64_t (*threads)(void)) {
    static int registered;
    team_run = run;
    team_threads = threads;
    if (!registered) { pthread_atfork(0, 0, opg_omp_child); registered = 1; }
}

/* The team's contract on the OpenMP runtime: the same claims of `grain` items, any thread. */
void opg_omp_run(opg_body body, void *ctx, int64_t n, int64_t grain) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (forked) { team_run(body, ctx, n, grain); return; }
    const int64_t claims = (n + grain - 1) / grain, want = team_threads();
    if (claims < 2 || want < 2 || omp_in_parallel()) { body(ctx, 0, n); return; }
    const int threads = (int)(want < claims ? want : claims);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < claims; ++i) {
        const int64_t b = i * grain, e = b + grain < n ? b + grain : n;
        body(ctx, b, e);
    }
}
"""

_STATE: dict[str, Any] = {}
MAX_THREADS = int(re.search(r"#define OPG_MAX_THREADS (\d+)", SOURCE)[1])  # more are this many
_MAX_SPIN_NS = (1 << 63) - 1


def _spin_ns(us: float) -> int:
    """``us`` microseconds as the team's int64 nanoseconds, at most ~292 years (ctypes wraps a
    larger int silently: 1e30 µs came out as a few years, some values negative, then ignored).

        >>> _spin_ns(2.5), _spin_ns(1e30) == (1 << 63) - 1
        (2500, True)
    """
    return int(max(us, 0.0) * 1000) if us < 9e15 else _MAX_SPIN_NS


def spin_us() -> float:
    """``$OPGRAPH_SPIN_US`` (else :data:`SPIN_US`); ValueError naming the variable for a value
    that is not a finite number of microseconds >= 0.

        >>> spin_us() >= 0
        True
    """
    return env_number("OPGRAPH_SPIN_US", float(SPIN_US), "microseconds")


def _library() -> Any:
    """The team's shared library, compiled or loaded once and configured from the environment."""
    lib = _STATE.get("lib")
    if lib is None:
        kernel = build.load(SOURCE, symbol="opg_team_run")
        lib = kernel.handle
        lib.opg_team_set.argtypes, lib.opg_team_set.restype = [ctypes.c_int64, ctypes.c_int64], None
        lib.opg_team_threads.argtypes, lib.opg_team_threads.restype = [], ctypes.c_int64
        lib.opg_team_set(min(default_threads(), MAX_THREADS), _spin_ns(spin_us()))
        _STATE["serial"] = lib.opg_team_threads() < 2
        _STATE["team"] = _STATE["run"] = ctypes.cast(kernel.fn, ctypes.c_void_p).value
        _STATE["lib"] = lib
        if openmp_libraries():  # another library started an OpenMP runtime: share its threads
            share_openmp_if_spinning()
    return lib


def runner() -> int:
    """The address of the ``opg_run`` kernels call: ``opg_team_run``, or its OpenMP twin while
    :func:`share_openmp` is on (pass it to a kernel as a ``c_void_p``)."""
    if "run" not in _STATE:
        _library()
    return _STATE["run"]


def runner_or_null() -> int:
    """:func:`runner`, or 0 (NULL: run serially) while one thread is set, for a kernel that
    lays its work out differently for one (its results are the same either way).

        >>> ok = __import__("backends.native.build", fromlist=["_"]).availability()[0]
        >>> before = threads() if ok else 1
        >>> set_threads(1) if ok else None
        >>> runner_or_null() if ok else 0
        0
        >>> set_threads(before) if ok else None
    """
    if "run" not in _STATE:
        _library()
    return 0 if _STATE["serial"] else _STATE["run"]


# file names of OpenMP runtimes: GNU's, LLVM's, Intel's
OPENMP_RUNTIMES = re.compile(r"/lib(gomp|omp|iomp5)[-.][^/]*$")


def openmp_libraries() -> set[str]:
    """The paths of the OpenMP runtimes (:data:`OPENMP_RUNTIMES`) mapped into this process
    (Linux; else empty): a second one after :func:`share_openmp` built its code means that code
    did not join the first.

        >>> OPENMP_RUNTIMES.search("/x/torch/lib/libgomp-a34b3233.so.1") is not None
        True
        >>> OPENMP_RUNTIMES.search("/usr/lib/libompl.so") is None
        True
    """
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f}
    except OSError:
        return set()
    return {p for p in paths if OPENMP_RUNTIMES.search(p)}


def share_openmp(on: bool = True) -> bool:
    """Run parallel calls on the process's OpenMP runtime (``on``) or on the team (``False``);
    returns whether they now run on OpenMP. Declined (False) without a loaded OpenMP runtime,
    when the compiler cannot build OpenMP code, when that would load a second OpenMP runtime, or
    with ``$OPGRAPH_RUNTIME=team``.

        >>> share_openmp(False)
        False
        >>> runtime()
        'team'
    """
    if not on or os.environ.get("OPGRAPH_RUNTIME", "").strip() == "team":
        if "team" in _STATE:
            _STATE["run"] = _STATE["team"]
        return False
    if "lib" not in _STATE:
        _library()
    if "openmp" not in _STATE:
        before = openmp_libraries()
        if not before:  # not remembered: a runtime may be loaded later
            return False
        _STATE["openmp"] = _join_openmp(before)
    if _STATE["openmp"] is None:
        return False
    _STATE["run"] = _STATE["openmp"]
    return True


def _join_openmp(loaded: set[str]) -> Optional[int]:
    """The address of ``opg_omp_run`` built against the OpenMP runtime already ``loaded``, or
    None when it cannot be built or brought a runtime of its own (no shared threads)."""
    try:
        kernel = build.load(OPENMP_SOURCE, extra=("-fopenmp",), symbol="opg_omp_run")
    except build.NativeBuildError:
        return None
    if openmp_libraries() != loaded:
        return None
    kernel.handle.opg_omp_init(ctypes.c_void_p(_STATE["team"]),
                               ctypes.cast(_STATE["lib"].opg_team_threads, ctypes.c_void_p))
    return ctypes.cast(kernel.fn, ctypes.c_void_p).value


def share_openmp_if_spinning() -> bool:
    """:func:`share_openmp`, unless ``$OMP_WAIT_POLICY`` is ``passive``: then the runtime's idle
    threads sleep, so they do not spin against the team, and waking them for every call would
    cost more than the team's short spin (the automatic choice: a team started while an OpenMP
    runtime is loaded, and :mod:`opgraph.torch`'s import).

        >>> saved = os.environ.get("OMP_WAIT_POLICY")
        >>> os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        >>> share_openmp_if_spinning()
        False
        >>> _ = os.environ.pop("OMP_WAIT_POLICY") if saved is None else os.environ.update(
        ...     OMP_WAIT_POLICY=saved)
    """
    if os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive":
        return False
    return share_openmp()


def started() -> bool:
    """Whether the team's library is loaded (a parallel call has been made, or a setting read)."""
    return "lib" in _STATE


def runtime() -> str:
    """``"openmp"`` while parallel calls run on the process's OpenMP runtime, else ``"team"``."""
    return "openmp" if _STATE.get("run") not in (None, _STATE.get("team")) else "team"


def set_threads(n: int, spin_us: Optional[float] = None) -> None:
    """Use ``n`` >= 1 threads (the caller included; more than :data:`MAX_THREADS` are that
    many) from now on; optionally change the spin."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be an integer >= 1, got {n!r}")
    lib = _library()
    lib.opg_team_set(min(n, MAX_THREADS), -1 if spin_us is None else _spin_ns(spin_us))
    _STATE["serial"] = lib.opg_team_threads() < 2


def threads() -> int:
    """How many threads (the caller included) a parallel call uses."""
    return int(_library().opg_team_threads())


__all__ = ["C_DECL", "OPENMP_RUNTIMES", "SPIN_US", "openmp_libraries", "runner", "runner_or_null",
           "runtime", "set_threads", "share_openmp", "share_openmp_if_spinning", "started",
           "threads"]
