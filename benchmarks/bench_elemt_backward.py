"""Benchmark aclnnBatchNormElemtBackward on the CPU: opgraph levels 0/1/2 (numpy backend), the
native backend when a C compiler is present, a naive numpy formula, torch eager and
torch.compile when torch is installed, and three floors: ``np.add(a, b, out=c)`` in the tensor's
dtype (the floor the issue defines), the same on the raw bits (one thread; numpy's fp16/bf16
arithmetic is compute-bound) and ``c = a + b`` on the raw bits compiled with the native backend's
compiler and flags, on the native thread team with 2 threads (the memory floor: read two
tensors, write one, at the speed this machine's two cores allow). For fp16 also the floor of a
bit-faithful kernel (``floor C fp16 steps``): the body's per-element steps, each rounded to fp16
as on the NPU, in the native kernels' vector helpers (``bench_common.C_F16_STEPS``). Variants
marked ``FM*`` run level 2 under ``opgraph.fast_math()``: NOT bit-exact, shown for what the
bit-faithful roundings cost.

Variants run interleaved in one process, each repeat starting one variant later
(``bench_common.interleaved``: what the variant before leaves in the caches moves a call's time);
we report medians, the spread (min–max) and ratios to
the floors, to torch.compile and to level 0 measured in the same run. Each sample is the
per-call time of a burst (at least 5 ms) after one untimed call: runtimes that spin after a call
(torch's OpenMP workers, opgraph's native team) otherwise tax whichever variant runs next — a
single timed call after torch.compile measured the fp16 native kernel at 11.6 ms, not 3.8.
Every variant reads the same input arrays and writes the same output array (torch through
``out=`` / ``copy_``, which inductor stores into directly), all on huge pages
(``bench_common.on_huge_pages``): on this VM 4 KiB pages made the same kernel up to 2.8x slower.
Also: per-call latency for the small shape (the first call of a structure, a new shape of it,
a cached call; ``opgraph.ops`` on arrays of a seen layout, usual and direct) and peak extra memory
(tracemalloc).

    python benchmarks/bench_elemt_backward.py            # full run (a few minutes)
    python benchmarks/bench_elemt_backward.py --quick    # smaller shapes, fewer repeats
    python benchmarks/bench_elemt_backward.py --shapes 8,64,28,28 --only native,torch.compile
"""
from __future__ import annotations

import argparse
import platform as host
import statistics
import time
import tracemalloc
from typing import Callable

import ml_dtypes
import numpy as np

import backends
import opgraph
from backends.native import build, launch, team
from opgraph.aclnn import aclnnBatchNormElemtBackward as phase2
from opgraph.aclnn import aclnnBatchNormElemtBackwardGetWorkspaceSize as phase1
from opgraph.aclnn.cache import EXECUTOR_CACHE
from opgraph.aclnn.direct import NUMPY_CALLS
from opgraph.aclnn.structure import STRUCTURE_CACHE
from bench_common import (backends_here, c_f16_steps_variant, c_floor_variant, interleaved,
                          on_huge_pages)

DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
SHAPES = [(1, 2, 4), (8, 64, 28, 28), (32, 64, 56, 56)]


def make_inputs(shape, dt, seed=0):
    rng = np.random.default_rng(seed)
    C = shape[1]
    arr = [rng.standard_normal(shape).astype(dt), rng.standard_normal(shape).astype(dt)]
    arr += [rng.standard_normal(C).astype(dt), (rng.random(C) + 0.5).astype(dt),
            rng.standard_normal(C).astype(dt), rng.standard_normal(C).astype(dt),
            rng.standard_normal(C).astype(dt), np.full(2, 7, np.int32)]
    return [on_huge_pages(a) for a in arr], on_huge_pages(np.zeros(shape, dt))


def opgraph_variant(level: int, backend: str, arrays, out, fast_math: bool = False
                    ) -> Callable[[], None]:
    tensors = [opgraph.tensor(a) for a in arrays]
    out_t = opgraph.tensor(out)

    def call():
        with opgraph.opt_level(level), opgraph.use_backend(backend), opgraph.fast_math(fast_math):
            st, ws, ex = phase1(*tensors, out_t)
            st2 = phase2(bytearray(ws) if ws else None, ws, ex)
        assert st == 0 and st2 == 0
    return call


def naive_variant(arrays, out) -> Callable[[], None]:
    go, x, mu, inv, w, sdy, sdx, cnt = arrays
    b = (1, -1) + (1,) * (go.ndim - 2)

    def call():
        f = np.float32
        total = cnt.astype(f).sum()
        md, mdx = (sdy.astype(f) / total).reshape(b), (sdx.astype(f) / total).reshape(b)
        i, m, ww = inv.astype(f).reshape(b), mu.astype(f).reshape(b), w.astype(f).reshape(b)
        out[...] = (((go.astype(f) - md) - (x.astype(f) - m) * (i * i * mdx)) * i * ww).astype(out.dtype)
    return call


def floor_variant(arrays, out, raw_bits: bool) -> Callable[[], None]:
    """Read two tensors, write one: the op's minimal traffic. With ``raw_bits`` the tensors are
    added as same-width unsigned integers, so numpy's slow fp16/bf16 arithmetic does not count."""
    a, b, o = arrays[0], arrays[1], out
    if raw_bits:
        u = np.dtype(f"u{out.itemsize}")
        a, b, o = a.view(u), b.view(u), o.view(u)
    return lambda: np.add(a, b, out=o)


def torch_variants(arrays, out) -> dict[str, Callable[[], None]]:
    try:
        import torch
        from opgraph.torch.kernels import to_torch  # views the arrays (bfloat16 too), no copy
    except ImportError:
        return {}
    torch.set_num_threads(2)
    ts = [to_torch(a) for a in arrays]  # torch reads the benchmark's own arrays
    dst = to_torch(out)
    go, x, mu, inv, w, sdy, sdx, cnt = ts
    b = (1, -1) + (1,) * (go.dim() - 2)

    def f(go, x, mu, inv, w, sdy, sdx, cnt, out=None):
        total = cnt.float().sum()
        md, mdx = (sdy / total).view(b), (sdx / total).view(b)
        i = inv.view(b)
        return torch.mul(((go - md) - (x - mu.view(b)) * (i * i * mdx)) * i, w.view(b), out=out)

    def into(go, x, mu, inv, w, sdy, sdx, cnt, dst):  # writes the caller's output, as opgraph does
        dst.copy_(f(go, x, mu, inv, w, sdy, sdx, cnt))

    res = {"torch eager": lambda: f(*ts, out=dst)}
    try:
        torch._dynamo.reset()  # a fresh compile per shape and dtype (no recompile limit)
        cf = torch.compile(into, dynamic=False)
        cf(*ts, dst)
        res["torch.compile"] = lambda: cf(*ts, dst)
    except Exception as e:  # compile toolchain missing: report, don't fail
        print(f"  (torch.compile unavailable: {type(e).__name__}: {str(e).splitlines()[0][:80]})")
    return res


def peak_extra_bytes(fn: Callable[[], None]) -> int:
    fn()
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def _ratio(med: float, base: "float | None", width: int = 6) -> str:
    return f"{med / base:{width}.2f}×" if base else " " * width + "-"


def bench_shape(shape, dname, reps: int, only: "set[str] | None" = None) -> None:
    """One table: every variant (or those whose name contains a word of ``only``; the floors
    always run) interleaved ``reps`` times, medians and ratios within this run."""
    dt = DTYPES[dname]
    arrays, out = make_inputs(shape, dt)
    variants: dict[str, Callable[[], None]] = {"floor np.add": floor_variant(arrays, out, False),
                                               "floor raw bits": floor_variant(arrays, out, True)}
    c_floor = c_floor_variant(arrays, out)
    if c_floor is not None:
        variants["floor C 2 threads"] = c_floor
    steps = c_f16_steps_variant(arrays, out) if dname == "fp16" else None
    if steps is not None:  # what the five fp16 roundings alone cost (bench_common.C_F16_STEPS)
        variants["floor C fp16 steps"] = steps
    # every numpy variant before the native ones: a variant that follows a native call shares
    # the CPUs with its threads while they spin (torch's OpenMP runtime spins ~ms after a call)
    others: dict[str, Callable[[], None]] = {}
    for level in (0, 1, 2):
        others[f"opgraph L{level} numpy"] = opgraph_variant(level, "numpy", arrays, out)
    others["opgraph L2 numpy FM*"] = opgraph_variant(2, "numpy", arrays, out, True)
    others["naive numpy"] = naive_variant(arrays, out)
    if "native" in backends.available():
        others["opgraph L2 native"] = opgraph_variant(2, "native", arrays, out)
        others["opgraph L2 native FM*"] = opgraph_variant(2, "native", arrays, out, True)
    others.update(torch_variants(arrays, out))
    variants.update({k: f for k, f in others.items() if not only or any(w in k for w in only)})
    for fn in variants.values():  # warm-up (compiles, caches)
        fn()
    times = interleaved(variants, reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor, traffic = med["floor np.add"], med["floor raw bits"]
    cf, tc, l0 = (med.get(k) for k in ("floor C 2 threads", "torch.compile", "opgraph L0 numpy"))
    nbytes = out.nbytes
    print(f"\n{dname} {list(shape)}  ({reps} interleaved runs; tensor {nbytes / 2**20:.1f} MiB)")
    print(f"  {'variant':22s} {'median':>10s} {'min–max':>19s} {'/floor':>7s} {'/bits':>7s} "
          f"{'/Cfloor':>7s} {'/tcomp':>7s} {'/L0':>6s} {'peak extra':>11s}")
    for name, ts in times.items():
        m = med[name]
        peak = peak_extra_bytes(variants[name]) if not name.startswith("torch") else float("nan")
        peak_s = f"{peak / nbytes:9.2f}×T" if peak == peak else "        n/a"
        print(f"  {name:22s} {m * 1e3:8.3f}ms {min(ts) * 1e3:8.3f}–{max(ts) * 1e3:8.3f}ms "
              f"{_ratio(m, floor)} {_ratio(m, traffic)} {_ratio(m, cf)} {_ratio(m, tc)} "
              f"{_ratio(m, l0, 5)} {peak_s}")
    if any(name.endswith("FM*") for name in times):
        print("  * opgraph.fast_math(): NOT bit-exact (the per-channel affine form in float32, "
              "one rounding to the output dtype)")


def bench_latency(reps: int) -> None:
    """Per-call time at the small shape, per backend: the first call of a structure (record,
    passes, plan, and the structure cache's probe recording), a new shape of that structure (a
    structure-cache hit: no recording, no passes) and a repeated call (an executor-cache hit)."""
    shapes = [(n, 2, 4) for n in range(1, reps + 2)]  # one structure, reps + 1 sizes
    cases = []
    for shape in shapes:
        arrays, out = make_inputs(shape, np.float32)
        cases.append(([opgraph.tensor(a) for a in arrays], opgraph.tensor(out), arrays))
    print("\nper-call latency, shape [n,2,4] fp32 (phase 1 + phase 2), medians:")
    for backend in backends_here():
        for level in (0, 1, 2):
            with opgraph.opt_level(level), opgraph.use_backend(backend):
                def call(i: int) -> None:
                    st, ws, ex = phase1(*cases[i][0], cases[i][1])
                    phase2(bytearray(ws) if ws else None, ws, ex)
                first, new, cached = [], [], []
                for _ in range(reps):
                    EXECUTOR_CACHE.clear()
                    STRUCTURE_CACHE.clear()
                    t0 = time.perf_counter()
                    call(0)
                    first.append(time.perf_counter() - t0)
                for i in range(1, len(cases)):  # the structure is known, the size is not
                    t0 = time.perf_counter()
                    call(i)
                    new.append(time.perf_counter() - t0)
                for _ in range(reps * 5):
                    t0 = time.perf_counter()
                    call(0)
                    cached.append(time.perf_counter() - t0)
            print(f"  {backend:6s} level {level}: first of its structure "
                  f"{statistics.median(first) * 1e6:8.1f} µs   new shape "
                  f"{statistics.median(new) * 1e6:7.1f} µs   cached "
                  f"{statistics.median(cached) * 1e6:7.1f} µs  (shape [1,2,4])")
        usual, direct = pythonic_latency(backend, cases[0][2], reps)
        print(f"  {backend:6s} opgraph.ops, arrays of a seen layout: usual call {usual * 1e6:7.1f} µs"
              f"   direct call {direct * 1e6:7.1f} µs  (shape [1,2,4], level 2)")


def pythonic_latency(backend: str, arrays: list, reps: int) -> tuple[float, float]:
    """Medians of ``opgraph.ops.batch_norm_elemt_backward`` on numpy arrays whose layout it has
    seen: through phase 1 and 2 (direct calls off) and direct, alternating in blocks."""
    times: dict[bool, list[float]] = {False: [], True: []}
    was = NUMPY_CALLS.enabled
    try:
        with opgraph.opt_level(2), opgraph.use_backend(backend):
            for _ in range(reps):
                for on in (False, True):
                    NUMPY_CALLS.enabled = on
                    opgraph.ops.batch_norm_elemt_backward(*arrays)
                    t0 = time.perf_counter()
                    for _ in range(5):
                        opgraph.ops.batch_norm_elemt_backward(*arrays)
                    times[on].append((time.perf_counter() - t0) / 5)
    finally:
        NUMPY_CALLS.enabled = was
    return statistics.median(times[False]), statistics.median(times[True])


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return host.processor() or ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the largest shape, fewer repeats")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--dtypes", default="fp32,fp16,bf16", help="comma-separated: fp32,fp16,bf16")
    ap.add_argument("--shapes", default=None, help="e.g. 8,64,28,28;32,64,56,56 (default: all)")
    ap.add_argument("--only", default=None,
                    help="comma-separated words: run only variants whose name contains one "
                         "(the floors always run), e.g. native,torch.compile")
    ap.add_argument("--no-latency", action="store_true", help="skip the small-shape latency")
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 9)
    shapes = SHAPES[:2] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(n) for n in s.split(",")) for s in args.shapes.split(";")]
    only = set(args.only.split(",")) if args.only else None
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        ap.error(f"--dtypes: unknown {', '.join(unknown)} (choose from {', '.join(DTYPES)})")
    print(f"machine: {host.machine()} {_cpu_name()} python {host.python_version()} "
          f"numpy {np.__version__}; opgraph {opgraph.__version__}")
    if build.availability()[0]:
        team.set_threads(2)
        print(f"native: {build.describe()}; {launch.vector_isa()}; {team.threads()} threads")
    if not args.no_latency:
        bench_latency(200 if not args.quick else 50)
    for shape in shapes:
        for d in args.dtypes.split(","):
            bench_shape(shape, d, reps, only)
    if build.availability()[0]:  # torch's import (for its variants) moves them onto its threads
        print(f"\nthe native variants ran their threads on: {team.runtime()} (team.share_openmp)")


if __name__ == "__main__":
    main()
