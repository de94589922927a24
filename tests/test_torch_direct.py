"""Direct calls (opgraph.torch.direct): a primitive called again with the metadata of a call seen
before runs its compiled program straight from the torch tensors' addresses on native. Checked
against the op_api's usual two-phase call (direct calls off) bit for bit, with every output
pre-filled with NaN (so an output the direct run skipped shows), at both sizes of the native
reductions (the serial C call and the passes), fp32/fp16/bf16, channels_last and 2-d; that the
direct run skips phase 1; and every case that must take the usual call: another backend, an
active capture, in-out tensors sharing memory, a tensor opgraph cannot view, bad input, threads."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")

import opgraph  # noqa: E402
from backends import native  # noqa: E402
from backends.numpy_backend import NumpyBackend  # noqa: E402
from opgraph.aclnn.cache import EXECUTOR_CACHE  # noqa: E402
from opgraph.aclnn.direct import NUMPY_CALLS  # noqa: E402
from opgraph.core.status import AclnnError  # noqa: E402
from opgraph.torch import direct, kernels as K  # noqa: E402
from threads import hammer  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the native backend")
EPS = 1e-5
SMALL, LARGE = (4, 3, 5, 3), (4, 3, 40, 40)  # below and above the native min_elements (4096)


def bits(t):
    return None if t is None else t.detach().contiguous().view(torch.uint8).numpy()


def same(a, b) -> bool:
    return all((x is None and y is None) or np.array_equal(bits(x), bits(y)) for x, y in zip(a, b))


def inputs(shape, dtype, channels_last=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    x, dy = [(torch.randn(*shape, generator=g) * 2 + 1).to(dtype) for _ in range(2)]
    if channels_last:
        x, dy = [t.contiguous(memory_format=torch.channels_last) for t in (x, dy)]
    w = torch.linspace(0.5, 2.0, C)
    return x, dy, w, torch.linspace(-1.0, 1.0, C), torch.zeros(C), torch.ones(C)


def primitives(x, dy, w, b, rm, rv):
    """The five primitives chained as SyncBatchNorm chains them on one rank: every output."""
    mean, invstd = K.batch_norm_stats(x, EPS)
    counts = np.full(1, x.numel() // x.shape[1], np.float32)
    gm, gs = K.batch_norm_gather_stats_with_counts(x, K.as_numpy(mean)[None], K.as_numpy(invstd)[None],
                                                   rm, rv, 0.1, EPS, counts)
    y = K.batch_norm_elemt(x, w, b, gm, gs, EPS)
    sdy, sdx, gw, gb = K.batch_norm_backward_reduce(dy, x, gm, gs, w, True, True, True)
    dx = K.batch_norm_backward_elemt(dy, x, gm, gs, w, sdy, sdx, counts.astype(np.int32))
    return [mean, invstd, gm, gs, y, sdy, sdx, gw, gb, dx, rm, rv]


def nan_empty(shape, strides, dtype):
    return torch.empty_strided(shape, strides, dtype=dtype).fill_(float("nan"))


@pytest.fixture
def calls(monkeypatch):
    """A fresh direct-call cache whose outputs start as NaN."""
    fresh = direct.DirectCalls(direct.TORCH)
    monkeypatch.setattr(K, "DIRECT_CALLS", fresh)
    monkeypatch.setattr(direct, "_EMPTY", nan_empty)
    monkeypatch.setattr(NUMPY_CALLS, "enabled", False)  # the usual call under the torch layer's
    return fresh


def run(calls, enabled, args, backend="native", platform="Ascend910B"):
    calls.enabled = enabled
    with K.on(backend, platform):
        return primitives(*[a.clone() for a in args])


CASES = [(SMALL, torch.float32, False, "Ascend910B"), (LARGE, torch.float32, False, "Ascend910B"),
         (SMALL, torch.float16, False, "Ascend910B"), (LARGE, torch.float32, True, "Ascend910B"),
         (LARGE, torch.bfloat16, False, "Ascend950"), ((6, 3), torch.float32, False, "Ascend910B")]
IDS = ["small", "large", "fp16", "channels_last", "bf16-950", "2d"]


@pytest.mark.parametrize("backend", ["native", "numpy"])
@pytest.mark.parametrize("shape, dtype, channels_last, platform", CASES, ids=IDS)
def test_direct_calls_give_the_bits_of_the_two_phase_calls(calls, shape, dtype, channels_last,
                                                           platform, backend):
    args = inputs(shape, dtype, channels_last)
    want = run(calls, False, args, backend, platform)
    assert len(calls) == 0
    learnt = run(calls, True, args, backend, platform)  # learns the five calls
    assert len(calls) == 5
    hits = EXECUTOR_CACHE.hits
    again = run(calls, True, args, backend, platform)  # direct: no phase 1 at all
    assert EXECUTOR_CACHE.hits == hits
    assert same(learnt, want) and same(again, want)
    assert again[4].stride() == args[0].stride()  # channels_last kept, as empty_like keeps it


def test_a_direct_call_on_new_tensors_reads_and_writes_them(calls):
    first, second = inputs(LARGE, torch.float32), inputs(LARGE, torch.float32, seed=1)
    run(calls, True, first)
    got = run(calls, True, second)
    assert same(got, run(calls, False, second)) and not same(got, run(calls, False, first))


class NoDirectBackend(NumpyBackend):
    """numpy whose executables do not run direct (as a backend without run_direct)."""

    name = "numpy-no-direct"

    def compile(self, graph, memory_plan, platform):
        exe = super().compile(graph, memory_plan, platform)
        exe.run_direct = lambda bindings: False
        return exe


def test_a_backend_that_does_not_run_direct_runs_the_usual_call(calls):
    args, backend = inputs(SMALL, torch.float32), NoDirectBackend()
    want = run(calls, False, args, backend)
    run(calls, True, args, backend)  # learnt
    run(calls, True, args, backend)  # tried once: does not run direct
    hits = EXECUTOR_CACHE.hits
    assert same(run(calls, True, args, backend), want)
    assert EXECUTOR_CACHE.hits == hits + 5  # every call went through phase 1
    assert len(calls) == 5 and not any(calls.runs_direct())


def test_a_program_with_a_workspace_is_not_learnt(calls):
    x = inputs(SMALL, torch.float32)[0]
    with K.on("native", "Ascend910B"), opgraph.opt_level(0):  # as recorded: intermediates
        for _ in range(2):
            K.batch_norm_stats(x, EPS)
            assert calls.runs_direct() == [False]  # from the first call: never tried direct


@pytest.mark.parametrize("backend", ["native", "numpy"])
def test_the_950_gather_with_half_precision_counts_runs_direct_on_native(calls, backend):
    """A bf16 model's counts (the layer rounds them as torch does) put the gather's cast of
    them in a workspace: native runs the program direct all the same (its C call casts them
    itself), numpy takes the usual call; the bits are the usual call's."""
    x = inputs(LARGE, torch.bfloat16)[0]
    C = x.shape[1]
    g = torch.Generator().manual_seed(3)
    mean, invstd = torch.randn(2, C, generator=g).numpy(), (torch.rand(2, C, generator=g) + 0.5).numpy()
    counts = np.float32([1600, 1500]).astype(ml_dtypes.bfloat16)

    def gather(enabled):
        calls.enabled = enabled
        rm, rv = torch.zeros(C), torch.ones(C)
        with K.on(backend, "Ascend950"):
            m, s = K.batch_norm_gather_stats_with_counts(x, mean, invstd, rm, rv, 0.1, EPS, counts)
        return [m, s, rm, rv]
    want = gather(False)
    assert same(gather(True), want)  # learnt
    hits = EXECUTOR_CACHE.hits
    assert same(gather(True), want)
    assert calls.runs_direct() == [backend == "native"]
    assert (EXECUTOR_CACHE.hits == hits) == (backend == "native")  # direct: no phase 1


def test_a_capture_sees_every_call(calls):
    x = inputs(SMALL, torch.float32)[0]
    with K.on("native", "Ascend910B"):
        K.batch_norm_stats(x, EPS), K.batch_norm_stats(x, EPS)  # learnt
        with opgraph.capture() as prog:
            K.batch_norm_stats(x, EPS)
    assert prog.stats().launches >= 1


@pytest.mark.parametrize("aliasing", ["same", "overlapping"])
def test_running_stats_sharing_memory_take_the_usual_call(calls, aliasing):
    x, _, _, _, _, _ = inputs(SMALL, torch.float32)
    C = x.shape[1]
    mean = torch.linspace(0, 1, C)[None]
    invstd = torch.linspace(1, 2, C)[None]
    counts = np.full(1, 20.0, np.float32)

    def gather(enabled):
        calls.enabled = enabled
        buf = torch.linspace(0.5, 1.5, C + 1)
        rm, rv = (buf[:C], buf[:C]) if aliasing == "same" else (buf[:C], buf[1:])
        with K.on("native", "Ascend910B"):
            out = K.batch_norm_gather_stats_with_counts(x, mean, invstd, rm, rv, 0.1, EPS, counts)
        return [*out, buf]

    calls.enabled = True
    with K.on("native", "Ascend910B"):  # learnt on separate running stats
        for _ in range(2):
            K.batch_norm_gather_stats_with_counts(x, mean, invstd, torch.zeros(C), torch.ones(C),
                                                  0.1, EPS, counts)
    before = EXECUTOR_CACHE.hits + EXECUTOR_CACHE.misses
    got = gather(True)
    assert EXECUTOR_CACHE.hits + EXECUTOR_CACHE.misses > before  # phase 1 ran
    assert same(got, gather(False))


def test_a_tensor_opgraph_cannot_view_is_refused_as_before(calls):
    x = inputs(SMALL, torch.float32)[0]
    with K.on("native", "Ascend910B"):
        K.batch_norm_stats(x, EPS), K.batch_norm_stats(x, EPS)  # learnt for this metadata
        with pytest.raises(AclnnError, match="input: .*neg bit set"):  # never keyed, never viewed
            K.batch_norm_stats(torch._neg_view(x), EPS)
        for opaque in (x.to_sparse(), x.to_mkldnn()):  # strides like x's, or none: not keyed
            with pytest.raises(AclnnError, match="input: cannot be used as a tensor"):
                K.batch_norm_stats(opaque, EPS)


def test_a_zero_tensor_is_never_keyed(calls):
    """A ZeroTensor has the metadata of any tensor but no memory (a NULL data pointer): keyed,
    it ran the learnt call on address 0 (native: a segmentation fault)."""
    x = inputs(SMALL, torch.float32)[0]
    zero = torch._efficientzerotensor(SMALL)
    assert direct.TORCH.metadata(zero) is None  # (first: without it, the call below crashes)
    with K.on("native", "Ascend910B"):
        K.batch_norm_stats(x, EPS), K.batch_norm_stats(x, EPS)  # learnt for this metadata
        with pytest.raises(AclnnError, match="input: .*ZeroTensor: its memory does not hold"):
            K.batch_norm_stats(zero, EPS)


def test_bad_input_is_refused_every_time(calls):
    with K.on("native", "Ascend910B"):
        for _ in range(2):
            with pytest.raises(AclnnError, match="input"):
                K.batch_norm_stats(torch.zeros(5), EPS)  # rank 1
    assert len(calls) == 0  # nothing learnt from a refused call


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["small", "large"])
def test_threads_share_a_learnt_call(calls, shape):
    xs = [inputs(shape, torch.float32, seed=s)[0] for s in range(6)]
    w = torch.linspace(0.5, 2.0, shape[1])

    def both(x):
        mean, invstd = K.batch_norm_stats(x, EPS)
        return [mean, invstd, K.batch_norm_elemt(x, w, None, mean, invstd, EPS)]

    calls.enabled = False
    with K.on("native", "Ascend910B"):
        want = [both(x) for x in xs]
    calls.enabled = True
    got, errors = hammer(lambda k: both(xs[k]), want, same, rounds=60,
                         context=lambda: K.on("native", "Ascend910B"))
    assert not errors and len(got) == len(xs) and len(calls) == 2


def test_the_cache_is_bounded():
    calls = direct.DirectCalls(direct.TORCH, capacity=2)
    with K.on("numpy"):
        for n in (2, 3, 4):
            calls.call("aclnnBatchNormStats", (torch.ones(2, n), EPS), lambda: [])
    assert len(calls) == 2
    assert direct.call_key("aclnnBatchNormStats", (torch.ones(2, 2), EPS)) not in calls


def test_empty_inputs_give_what_the_usual_call_gives(calls):
    x = torch.zeros(0, 3, 4)
    m, s, w = torch.zeros(3), torch.ones(3), torch.ones(3)

    def both(enabled):
        calls.enabled = enabled
        with K.on("native", "Ascend910B"):
            return [*K.batch_norm_stats(x, EPS), K.batch_norm_elemt(x, w, None, m, s, EPS),
                    *K.batch_norm_backward_reduce(x, x, m, s, w, True, True, True)]

    want = both(False)
    assert same(both(True), want) and same(both(True), want)  # learnt, then again
    assert torch.isnan(want[1]).all() and (want[3] == 0).all()  # the op_apis' fills


def test_an_argument_the_op_api_copies_is_not_learnt(calls):
    x = inputs(SMALL, torch.float32)[0]
    C = x.shape[1]
    backwards = np.linspace(0.5, 1.5, 2 * C).astype(np.float32)[::-2][None]  # negative strides
    invstd, counts = np.ones((1, C), np.float32), np.full(1, 20.0, np.float32)

    def gather(enabled):
        calls.enabled = enabled
        with K.on("native", "Ascend910B"):
            return K.batch_norm_gather_stats_with_counts(x, backwards, invstd, None, None, 0.1,
                                                         EPS, counts)

    want = gather(False)
    assert same(gather(True), want) and same(gather(True), want)
    assert calls.runs_direct() == [False]  # opgraph viewed a copy: never direct
