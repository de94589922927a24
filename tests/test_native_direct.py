"""The native backend's direct launch (a cached program whose nodes are all stores of fused
kernels over the caller's tensors runs them from the tensors' addresses): results stay
bit-identical to the numpy backend, and every case the direct launch cannot take (an overlap,
a size threshold, a profiled run, a read-only output) goes the node-by-node way."""
from __future__ import annotations

import concurrent.futures as futures
import sys
import threading

import numpy as np
import pytest

import opgraph
import reference as R
from backends import native
from opgraph.aclnn.cache import EXECUTOR_CACHE
from opgraph.aclnn.structure import STRUCTURE_CACHE
from opgraph.core import backend as backend_registry

pytestmark = pytest.mark.skipif(not native.available(), reason=native.availability()[1])
SHAPE = (2, 3, 4)


def numpy_result(case: R.Case) -> np.ndarray:
    with opgraph.use_backend("numpy"), opgraph.opt_level(2):
        return R.compute(case)


def executable_of(ex) -> native.NativeExecutable:
    exe = ex.program.built_executable(backend_registry.get("native"))
    assert isinstance(exe, native.NativeExecutable)
    return exe


@pytest.mark.parametrize("dtype", [R.F32, R.F16, R.BF16], ids=["f32", "f16", "bf16"])
def test_repeated_calls_with_new_tensors_match_numpy(dtype):
    """Each call gets new tensors (new data, new addresses) over the same cached program."""
    EXECUTOR_CACHE.clear()
    with opgraph.use_backend("native"), opgraph.opt_level(2):
        for seed in range(4):
            case = R.make_case(SHAPE, dtype, seed=seed)
            out = np.zeros(SHAPE, case.out_dtype)
            _, _, ex, _ = R.run_op(R.to_tensors(case), opgraph.tensor(out))
            R.assert_bits_equal(out, numpy_result(case))
    assert executable_of(ex).launches is not None  # the later calls took the direct launch


def test_first_run_launches_directly_and_a_read_only_output_is_left_alone():
    """A fresh executable prepares its launch on its first run (a new shape runs once); one
    whose bound output is read-only never takes the direct launch, so never writes it."""
    case = R.make_case(SHAPE, R.F32, seed=3)
    with opgraph.use_backend("native"), opgraph.opt_level(2):
        _, _, ex, _ = R.run_op(R.to_tensors(case), opgraph.tensor(np.zeros(SHAPE, np.float32)))
    graph, plan = ex.program.compiled, ex.program.memory_plan
    backend = backend_registry.get("native")
    names = [v.name for v in graph.inputs]

    def bindings(out: np.ndarray) -> dict:
        tensors = [t for t in R.to_tensors(case) if t is not None] + [opgraph.tensor(out)]
        return dict(zip(names, tensors))
    exe = backend.compile(graph, plan, ex.platform)
    out = np.zeros(SHAPE, np.float32)
    exe.run(bindings(out))
    assert exe.launches is not None
    R.assert_bits_equal(out, numpy_result(case))
    frozen = np.full(SHAPE, 7, np.float32)
    frozen.flags.writeable = False
    exe = backend.compile(graph, plan, ex.platform)
    with pytest.raises(ValueError):
        exe.run(bindings(frozen))
    assert exe.launches is None and (frozen == 7).all()


def test_same_tensors_new_data_is_read_afresh():
    """The pointer memo keeps addresses, not values: new data in the same buffers is read."""
    case = R.make_case(SHAPE, R.F32, seed=1)
    tensors, out = R.to_tensors(case), np.zeros(SHAPE, np.float32)
    out_t = opgraph.tensor(out)
    with opgraph.use_backend("native"), opgraph.opt_level(2):
        for step in range(3):
            tensors[0].view()[...] = np.float32(step + 1) * case.gradOut
            R.run_op(tensors, out_t)
            R.assert_bits_equal(out, numpy_result(case.with_(gradOut=tensors[0].view().copy())))


def test_output_overlapping_an_input_takes_the_numpy_path():
    """gradInput one element into gradOut's buffer: the kernel must not run over it."""
    case = R.make_case(SHAPE, R.F32, seed=2)
    n = int(np.prod(SHAPE))

    def run(backend: str) -> np.ndarray:
        buf = np.zeros(n + 1, np.float32)
        buf[:n] = case.gradOut.reshape(-1)
        tensors = R.to_tensors(case)
        tensors[0] = opgraph.Tensor(buf, SHAPE, (12, 4, 1))
        out_t = opgraph.Tensor(buf, SHAPE, (12, 4, 1), offset=1)
        with opgraph.use_backend(backend), opgraph.opt_level(2):
            R.run_op(R.to_tensors(case), opgraph.tensor(np.zeros(SHAPE, np.float32)))  # warm
            R.run_op(R.to_tensors(case), opgraph.tensor(np.zeros(SHAPE, np.float32)))
            R.run_op(tensors, out_t)
        return buf
    R.assert_bits_equal(run("native"), run("numpy"))


def test_threshold_set_later_is_honoured(monkeypatch):
    case = R.make_case(SHAPE, R.F32, seed=4)
    b = backend_registry.get("native")
    with opgraph.use_backend("native"), opgraph.opt_level(2):
        for _ in range(2):
            R.compute(case)
        monkeypatch.setattr(native.NativeBackend, "min_fused_elements", 4096)
        before = b.small
        R.assert_bits_equal(R.compute(case), numpy_result(case))
    assert b.small == before + 1


def test_profiled_run_reports_every_node():
    """A ``profile`` hook (``opgraph run --trace-json``) sees the node even after the direct
    launch is prepared."""
    case = R.make_case(SHAPE, R.F32, seed=6)
    with opgraph.use_backend("native"), opgraph.opt_level(2):
        tensors, out_t = R.to_tensors(case), opgraph.tensor(np.zeros(SHAPE, np.float32))
        for _ in range(2):
            _, _, ex, _ = R.run_op(tensors, out_t)
        exe = executable_of(ex)
        assert exe.launches is not None
        seen = []
        exe.profile = lambda node, start, stop: seen.append(node.op)
        try:
            R.run_op(tensors, out_t)
        finally:
            del exe.profile
    assert seen == ["FusedElementwise"]
    R.assert_bits_equal(out_t.view(), numpy_result(case))


def test_threads_share_one_program_and_its_direct_launch():
    """Four threads call the same cached program on their own tensors: each gets its own bits
    (the remembered pointers are per executable and replaced whole)."""
    cases = [R.make_case(SHAPE, R.F32, seed=10 + k) for k in range(4)]
    expected = [numpy_result(c) for c in cases]

    def worker(k: int) -> bool:
        with opgraph.use_backend("native"), opgraph.opt_level(2):
            for _ in range(50):
                got = R.compute(cases[k])
                if not np.array_equal(R.bits(got), R.bits(expected[k])):
                    return False
        return True
    with futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(worker, range(4)))


def test_a_thread_taking_the_launches_another_just_prepared_finds_their_pointer_memo():
    """Thread A prepares a fresh executable's direct launch and is held at its first step after
    the launches are published; a call on another thread meanwhile takes them (it found the
    pointer memo still empty: IndexError), and both get the reference's bits."""
    case = R.make_case(SHAPE, R.F32, seed=5)
    with opgraph.use_backend("native"), opgraph.opt_level(2):
        _, _, ex, _ = R.run_op(R.to_tensors(case), opgraph.tensor(np.zeros(SHAPE, np.float32)))
    exe = backend_registry.get("native").compile(ex.program.compiled, ex.program.memory_plan, ex.platform)
    names = [v.name for v in ex.program.compiled.inputs]
    outs = [np.zeros(SHAPE, np.float32) for _ in range(2)]
    binds = [dict(zip(names, [t for t in R.to_tensors(case) if t is not None] + [opgraph.tensor(o)]))
             for o in outs]
    held, go = threading.Event(), threading.Event()

    def hold(frame, event, arg):  # in thread A: wait once, in _direct, after launches are set
        if frame.f_code is native.NativeExecutable._direct.__code__ and not held.is_set():
            def line(frame, event, arg):
                if event == "line" and exe.launches is not None and not held.is_set():
                    held.set()
                    go.wait(30)
                return line
            return line
        return None

    def thread_a() -> None:
        sys.settrace(hold)
        try:
            exe.run(binds[0])
        finally:
            sys.settrace(None)
    a = threading.Thread(target=thread_a)
    a.start()
    try:
        assert held.wait(30)
        exe.run(binds[1])
    finally:
        go.set()
        a.join(30)
    expected = numpy_result(case)
    for out in outs:
        R.assert_bits_equal(out, expected)


def test_threads_calling_new_sizes_of_one_structure_get_their_own_bits():
    """Four threads call new batch sizes of one structure at once: each size's executable is
    derived from the structure's family and its direct launch resized from the seed's, while
    the other threads do the same."""
    sizes = [(n, 2, 8) for n in range(3, 60) if n != 8]  # n = 8 = W would be another structure
    cases = [R.make_case(s, R.F32, seed=s[0]) for s in sizes]
    expected = [numpy_result(c) for c in cases]
    EXECUTOR_CACHE.clear()
    STRUCTURE_CACHE.clear()
    with opgraph.use_backend("native"), opgraph.opt_level(2):
        R.compute(R.make_case((61, 2, 8), R.F32))  # records and templates the structure

    def worker(k: int) -> list[int]:
        wrong = []
        with opgraph.use_backend("native"), opgraph.opt_level(2):
            for i in range(k, len(cases), 4):
                if not np.array_equal(R.bits(R.compute(cases[i])), R.bits(expected[i])):
                    wrong.append(i)
        return wrong
    hits = STRUCTURE_CACHE.hits
    with futures.ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(worker, range(4)), []) == []
    assert STRUCTURE_CACHE.hits - hits >= len(cases)  # every size a new shape of the structure


def _elemt(x: np.ndarray, out: np.ndarray, backend: str = "native", chans=None):
    """aclnnBatchNormElemt on ``x`` into ``out`` at level 2 on ``backend``: the native
    executable (None on numpy) and the channel tensors (new random ones unless given)."""
    if chans is None:
        rng = np.random.default_rng(0)
        chans = [opgraph.tensor(rng.uniform(0.5, 2.0, x.shape[1]).astype(np.float32))
                 for _ in range(4)]
    with opgraph.use_backend(backend), opgraph.opt_level(2):
        st, ws, ex = opgraph.aclnn.aclnnBatchNormElemtGetWorkspaceSize(
            opgraph.tensor(x), *chans, 1e-5, opgraph.tensor(out))
        assert st == 0 and ws == 0, opgraph.aclnn.aclGetRecentErrMsg()
        assert opgraph.aclnn.aclnnBatchNormElemt(None, 0, ex) == 0
    return (executable_of(ex) if backend == "native" else None), chans


@pytest.mark.parametrize("shape", [(16, 8, 300), (4096, 3), (16, 8, 300, 1)],
                         ids=["3d", "2d", "4d"])
def test_elemt_on_a_2d_or_3d_input_launches_directly_through_its_reshapes(shape):
    """The 910B views a 2-d or 3-d input as 4-d (Reshape, ReFormat), the kernel's result placed
    in the output its redirected copy goes to: the launch reads and writes the caller's tensors
    through those reshapes, and the bits are the numpy backend's."""
    for seed in (1, 2):  # the second call: the same executable on new tensors
        x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
        out = np.full(shape, np.nan, np.float32)
        exe, chans = _elemt(x, out)
        assert exe.launches is not None and len(exe.launches) == 1
        want = np.empty(shape, np.float32)
        _elemt(x, want, "numpy", chans)
        R.assert_bits_equal(out, want)
    names = [v.name for v in exe.graph.inputs]  # run() names each graph output's value
    got = exe.run(dict(zip(names, [opgraph.tensor(x), *chans, opgraph.tensor(out)])))
    assert {k: v.shape for k, v in got.items()} == {v.name: v.type.shape for v in exe.graph.outputs}
    assert all(np.shares_memory(v, out) for v in got.values())


def test_a_strided_3d_input_goes_node_by_node():
    """A 3-d input whose last dim is strided is viewed as 4-d inside the kernel's body (a
    per-element view, which the direct launch does not render): that program never launches
    directly, and its bits are still the numpy backend's."""
    wide = np.random.default_rng(2).standard_normal((16, 8, 600)).astype(np.float32)
    x = wide[:, :, ::2]
    out = np.full(x.shape, np.nan, np.float32)
    exe, chans = _elemt(x, out)
    assert exe.launches is None
    want = np.empty(x.shape, np.float32)
    _elemt(x, want, "numpy", chans)
    R.assert_bits_equal(out, want)


def test_a_reshape_that_would_copy_is_refused():
    """The direct launch only reads a tensor through a reshape that keeps its memory and its
    first element's address."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.shares_memory(native._reshaped_view(x, (2, 3, 1)), x)
    assert native._reshaped_view(x.T, (6,)) is None  # a transpose flattens only by copying
    assert native._reshaped_view(x[:, 1:], (2, 2, 1)) is not None  # strided, yet a view


@pytest.mark.parametrize("missing", [("bias",), ("weight", "bias")], ids=["no-bias", "neither"])
def test_a_missing_weight_or_bias_is_read_like_the_other_per_channel_terms(missing):
    """A missing weight or bias is a per-channel constant (a fill) in the prologue. It is written
    out per channel, so on a 2-d input (the channel innermost) every per-channel operand has the
    innermost stride 1 and the kernel takes its vector path; bits are numpy's."""
    shape, C = (640, 8), 8
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(np.float32)
    chans = {n: rng.uniform(0.5, 2.0, C).astype(np.float32) for n in ("weight", "bias", "mean", "invstd")}
    args = [None if n in missing else opgraph.tensor(chans[n]) for n in ("weight", "bias", "mean", "invstd")]
    got = {}
    for backend in ("native", "numpy"):
        out = np.full(shape, np.nan, np.float32)
        with opgraph.use_backend(backend), opgraph.opt_level(2):
            st, ws, ex = opgraph.aclnn.aclnnBatchNormElemtGetWorkspaceSize(
                opgraph.tensor(x), *args, 1e-5, opgraph.tensor(out))
            assert st == 0 and opgraph.aclnn.aclnnBatchNormElemt(None, 0, ex) == 0
        got[backend] = out
        if backend == "native":
            ln, _ = executable_of(ex).launches[0]
            nd, nb = ln.ndim, len(ln.big)
            inner = [ln.strides[k * nd + nd - 1] for k in range(nb, nb + len(ln.hoisted))]
            assert inner and set(inner) == {1}, inner
    R.assert_bits_equal(got["native"], got["numpy"])


@pytest.mark.parametrize("dtype", [R.F32, R.F16, R.BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(2, 5, 3, 7), (3, 64, 9, 11)], ids=lambda s: "x".join(map(str, s)))
def test_a_channels_last_output_is_walked_in_memory_order(shape, dtype):
    """A channels_last input and output (NHWC memory): the kernel's loop walks the output's
    memory in order — [N·H·W, C], channels innermost at stride 1 — not the logical order, in
    which W steps C elements at a time and every element takes the scalar strided path; bits
    are numpy's."""
    N, C, H, W = shape
    rng = np.random.default_rng(9)

    def nhwc(fill=None):
        a = rng.standard_normal((N, H, W, C)) if fill is None else np.full((N, H, W, C), fill)
        return a.astype(dtype).transpose(0, 3, 1, 2)
    x = nhwc()
    chans = [rng.uniform(0.5, 2.0, C).astype(dtype) for _ in range(4)]
    got = {}
    for backend in ("native", "numpy"):
        out = nhwc(np.nan)
        with opgraph.use_backend(backend), opgraph.opt_level(2), opgraph.platform("Ascend950"):
            st, ws, ex = opgraph.aclnn.aclnnBatchNormElemtGetWorkspaceSize(
                opgraph.tensor(x), *map(opgraph.tensor, chans), 1e-5, opgraph.tensor(out))
            assert st == 0 and opgraph.aclnn.aclnnBatchNormElemt(None, 0, ex) == 0
        got[backend] = out
        if backend == "native":
            ln, _ = executable_of(ex).launches[0]
            nd = ln.ndim
            assert (nd, list(ln.shape)) == (2, [N * H * W, C])
            assert ln.strides[len(ln.strides) - 1] == 1  # the output's innermost stride
    R.assert_bits_equal(got["native"], got["numpy"])
