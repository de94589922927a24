"""Pieces the benchmarks share: which backends run here, the compiled memory floor, steady
per-call timing and arrays on huge pages.

    >>> "numpy" in backends_here()
    True
"""
from __future__ import annotations

import ctypes
import mmap
import time
from typing import Callable, Optional

import numpy as np

from backends.native import build, c_text, render, team
from opgraph.core.backend import BackendUnavailable, get


def steady_malloc() -> None:
    """Keep freed memory in the process (glibc): large temporaries (numpy's, torch's) then
    reuse pages already mapped, as in a long-running process, instead of a fresh mmap and a
    page fault per 4 KiB on every call until glibc's adaptive threshold happens to rise — which
    moved the same numpy BatchNormStats call between 0.86 and 2.6 ms depending on what the
    benchmark had freed before. A no-op where glibc's ``mallopt`` is missing."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: allocations below 1 GiB come from the heap
    mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap


steady_malloc()


def backends_here() -> list[str]:
    """numpy, and native when it can run here (a C compiler)."""
    out = ["numpy"]
    try:
        get("native")
        out.append("native")
    except BackendUnavailable:
        pass
    return out


C_FLOOR = r"""#include <stdint.h>
{decl}
struct opg_abc {{ const {t} *a, *b; {t} *c; }};
static void opg_add(void *ctx, int64_t begin, int64_t end) {{
    const struct opg_abc *p = (const struct opg_abc *)ctx;
    for (int64_t i = begin; i < end; ++i) p->c[i] = ({t})(p->a[i] + p->b[i]);
}}
void opg_kernel(opg_run run, const void *a, const void *b, void *c, int64_t n, int64_t grain) {{
    const struct opg_abc p = {{(const {t} *)a, (const {t} *)b, ({t} *)c}};
    run(opg_add, (void *)&p, n, grain);
}}
"""


# The bit-faithful fp16 body's per-element work at its least: the arithmetic of
# aclnnBatchNormElemtBackward's fused body (bench_elemt_backward's fp16 kernel) with its
# per-channel terms held constant — two loads, five steps each rounded to fp16 as on the NPU (an
# F16C round trip on AVX2), a sixth step rounded by the store — in the native kernels' own
# vector helpers. On AVX2 these roundings, not memory, bound the kernel.
C_F16_STEPS = r"""{helpers}{v_helpers}
{decl}
struct opg_abc {{ const uint16_t *a, *b; uint16_t *c; }};
static void opg_steps(void *ctx, int64_t begin, int64_t end) {{
    const struct opg_abc *p = (const struct opg_abc *)ctx;
    int64_t i = begin;
#if defined(OPG_VEC)
    const opg_v k0 = opg_v_set1(0.25f), k1 = opg_v_set1(-0.5f), k2 = opg_v_set1(1.5f);
    const opg_v k3 = opg_v_set1(0.75f), k4 = opg_v_set1(1.25f);
    for (; i + OPG_W <= end; i += OPG_W) {{
        const opg_v x = opg_v_rnd_f16(opg_v_sub(opg_v_ld_f16(&p->a[i]), k0));
        const opg_v y = opg_v_rnd_f16(opg_v_sub(opg_v_ld_f16(&p->b[i]), k1));
        const opg_v d = opg_v_rnd_f16(opg_v_sub(x, opg_v_rnd_f16(opg_v_mul(y, k2))));
        opg_v_st_f16(&p->c[i], opg_v_mul(opg_v_rnd_f16(opg_v_mul(d, k3)), k4));
    }}
#endif
    for (; i < end; ++i) {{
        const float x = opg_rnd_f16(opg_ld_f16(p->a[i]) - 0.25f);
        const float y = opg_rnd_f16(opg_ld_f16(p->b[i]) + 0.5f);
        const float d = opg_rnd_f16(x - opg_rnd_f16(y * 1.5f));
        p->c[i] = opg_st_f16(opg_rnd_f16(d * 0.75f) * 1.25f);
    }}
}}
void opg_kernel(opg_run run, const void *a, const void *b, void *c, int64_t n, int64_t grain) {{
    const struct opg_abc p = {{(const uint16_t *)a, (const uint16_t *)b, (uint16_t *)c}};
    run(opg_steps, (void *)&p, n, grain);
}}
"""


def c_floor_variant(arrays, out) -> "Callable[[], None] | None":
    """``c = a + b`` over the raw bits as compiled C on the native thread team (None without a
    C compiler). Same compiler, flags and threads as the native kernels, plus ``-O3``: the
    kernels write their vector loops with intrinsics, the floor leaves it to the compiler."""
    return _team_kernel(C_FLOOR.format(decl=team.C_DECL, t=f"uint{out.itemsize * 8}_t"), arrays, out)


def c_f16_steps_variant(arrays, out) -> "Callable[[], None] | None":
    """:data:`C_F16_STEPS` on float16 ``arrays[0]``, ``arrays[1]`` into ``out``, on the native
    thread team (None without a C compiler): the floor of a bit-faithful fp16 kernel."""
    src = C_F16_STEPS.format(helpers=c_text.HELPERS, v_helpers=c_text.V_HELPERS, decl=team.C_DECL)
    return _team_kernel(src, arrays, out)


def _team_kernel(src: str, arrays, out) -> "Callable[[], None] | None":
    """``opg_kernel(run, a, b, c, n, grain)`` of ``src`` over ``arrays[0]``, ``arrays[1]`` and
    ``out`` (contiguous), built like the native kernels plus ``-O3``."""
    if not build.availability()[0]:
        return None
    fn = build.load(src, extra=("-O3",)).fn
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
    fn.restype = None
    a, b = np.ascontiguousarray(arrays[0]), np.ascontiguousarray(arrays[1])
    run, n, grain = team.runner(), out.size, render.GRAIN
    pa, pb, pc = a.ctypes.data, b.ctypes.data, out.ctypes.data
    return lambda: fn(run, pa, pb, pc, n, grain)


def steady_time(fn: Callable[[], None], min_seconds: float = 0.005) -> float:
    """Seconds per call of ``fn`` in a burst of calls lasting at least ``min_seconds``, after
    one untimed call (which absorbs whatever the previous variant left spinning)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def interleaved(fns: "dict[str, Callable[[], None]]", reps: int,
                sample: "Callable[[Callable[[], None]], float]" = steady_time
                ) -> "dict[str, list[float]]":
    """``reps`` samples of each variant of ``fns`` (``sample(fn)``: seconds per call), the
    variants interleaved, each repeat starting one variant later than the one before: a call's
    time depends on what the variant before it left in the caches (at 32x64x56x56 bf16, whose
    three tensors about fill this VM's L3, by a fifth or more), so that no variant always follows
    the same one. The order is the same in every process, as ranks that meet in collectives need.

        >>> calls = []
        >>> _ = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2,
        ...                 sample=lambda fn: fn() or 0.0)
        >>> calls
        ['a', 'b', 'b', 'a']
    """
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(reps):
        k = rep % len(names) if names else 0
        for name in names[k:] + names[:k]:
            times[name].append(sample(fns[name]))
    return times


def on_huge_pages(a: np.ndarray) -> np.ndarray:
    """A dense copy of ``a`` (same memory order) in fresh private anonymous memory advised onto
    huge pages (where the kernel offers them). Whether numpy's or torch's allocator hands out
    huge or 4 KiB pages depends on what the process freed before, and on this VM the kind
    matters (nested paging makes TLB misses dear: np.sum over 25 MB took 3.0 ms on 4 KiB pages,
    2.3 ms on huge ones) — so every array a benchmark times goes through here. Private, not
    ``mmap``'s default shared mapping: shared anonymous memory is shmem, which gets no
    transparent huge pages unless ``shmem_enabled`` allows them (``never`` on this VM).

        >>> on_huge_pages(np.arange(3, dtype=np.float32)).tolist()
        [0.0, 1.0, 2.0]
    """
    nbytes = max(a.nbytes, 1)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    flat = np.frombuffer(buf, dtype=a.dtype, count=a.size)
    strides = np.empty_like(a).strides  # the layout of ``a`` (channels_last stays so), dense
    out = np.lib.stride_tricks.as_strided(flat, a.shape, strides)
    out[...] = a
    return out


def held_floor(shape: tuple[int, ...], dtype: "np.dtype | str") -> Optional[Callable[[], None]]:
    """:func:`c_floor_variant` (compiled 2-thread ``c = a + b``) over ``shape`` (3 tensor passes)
    on arrays it keeps alive (the kernel holds raw pointers); None without a C compiler."""
    arrays = [on_huge_pages(np.ones(shape, dtype)) for _ in range(3)]
    fn = c_floor_variant(arrays[:2], arrays[2])
    if fn is None:
        return None

    def floor(keep: list = arrays) -> None:
        fn()
    return floor
