"""The five primitives on torch tensors (opgraph.torch.kernels) against their formulas in float64,
and their registration as aten CPU kernels (torch.library): torch.batch_norm_stats & co. work
on CPU tensors afterwards, give the same bits, idempotently, on the chosen backend."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")

import opgraph  # noqa: E402
import opgraph.torch as ot  # noqa: E402
from backends import native  # noqa: E402
from opgraph.core.backend import BackendUnavailable, get  # noqa: E402

EPS = 1e-5
C = 3
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def data(shape=(4, C, 5, 3), dtype=torch.float32, seed=0, channels_last=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 2 + 1).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def ch(*v):
    return torch.tensor(v, dtype=torch.float32)


def per_channel(v, nd):
    return v.double().view(1, -1, *([1] * (nd - 2)))


def axes(x):
    return [d for d in range(x.dim()) if d != 1]


def close(got, want, dtype=torch.float32):
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


LAYOUTS = [dict(), dict(channels_last=True), dict(dtype=torch.float16),
           dict(shape=(6, C)), dict(shape=(2, C, 7))]
IDS = ["nchw", "channels_last", "fp16", "2d", "3d"]


@pytest.mark.parametrize("kw", LAYOUTS, ids=IDS)
def test_batch_norm_stats(kw):
    x = data(**kw)
    mean, invstd = ot.batch_norm_stats(x, EPS)
    assert mean.dtype == invstd.dtype == torch.float32 and mean.shape == (C,)
    xd = x.double()
    close(mean, xd.mean(axes(x)))
    close(invstd, 1 / torch.sqrt(xd.var(axes(x), unbiased=False) + EPS))


def test_batch_norm_stats_bf16_on_the_950():
    x = data(dtype=torch.bfloat16)
    mean, _ = ot.batch_norm_stats(x, EPS, platform="Ascend950")
    close(mean, x.double().mean(axes(x)))
    with pytest.raises(opgraph.AclnnError, match="BF16"):
        ot.batch_norm_stats(x, EPS)                      # not on the 910B (the default)


def test_gather_stats_with_counts_and_running_stats_in_place():
    means = torch.tensor([[0.0, 1.0, 2.0], [2.0, -1.0, 2.5]])
    invstds = torch.tensor([[1.0, 0.5, 2.0], [0.25, 1.0, 1.0]])
    counts = torch.tensor([3.0, 5.0])
    rm, rv = torch.tensor([0.5, 0.5, 0.5]), torch.tensor([2.0, 2.0, 2.0])
    ptrs = rm.data_ptr(), rv.data_ptr()
    mean, invstd = ot.batch_norm_gather_stats_with_counts(data(), means, invstds, rm, rv, 0.1,
                                                          EPS, counts)
    # Chan's combination in float64
    m, s, n = means.double(), invstds.double(), counts.double()[:, None]
    total = n.sum()
    avg = (m * n).sum(0) / total
    var = (((1 / s**2 - EPS) + (m - avg) ** 2) * n).sum(0)
    close(mean, avg)
    close(invstd, 1 / torch.sqrt(var / total + EPS))
    close(rm, 0.9 * 0.5 + 0.1 * avg)
    close(rv, 0.9 * 2.0 + 0.1 * var / (total - 1))
    assert (rm.data_ptr(), rv.data_ptr()) == ptrs


@pytest.mark.parametrize("kw", LAYOUTS, ids=IDS)
def test_batch_norm_elemt(kw):
    x = data(**kw)
    mean, invstd, w, b = ch(1.0, -0.5, 2.0), ch(0.5, 2.0, 1.0), ch(1.0, 2.0, -1.0), ch(0, 1, 3)
    y = ot.batch_norm_elemt(x, w, b, mean, invstd, EPS)
    nd = x.dim()
    want = ((x.double() - per_channel(mean, nd)) * per_channel(invstd, nd) * per_channel(w, nd)
            + per_channel(b, nd))
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.stride() == x.stride()                          # channels_last stays
    close(y, want, x.dtype)
    out = torch.full_like(x, -7.0)
    assert ot.batch_norm_elemt(x, None, None, mean, invstd, EPS, out=out) is out
    close(out, (x.double() - per_channel(mean, nd)) * per_channel(invstd, nd), x.dtype)


@pytest.mark.parametrize("kw", LAYOUTS, ids=IDS)
def test_batch_norm_backward_reduce(kw):
    x, dy = data(**kw), data(seed=1, **kw)
    mean, invstd, w = ch(1.0, -0.5, 2.0), ch(0.5, 2.0, 1.0), ch(1.0, 2.0, -1.0)
    sum_dy, sum_dy_xmu, gw, gb = ot.batch_norm_backward_reduce(dy, x, mean, invstd, w,
                                                               True, True, True)
    xmu = x.double() - per_channel(mean, x.dim())
    want_dy = dy.double().sum(axes(x))
    want_xmu = (dy.double() * xmu).sum(axes(x))
    tol = TOL[x.dtype] * float(x.numel())               # sums of rounded products
    for got, want in ((sum_dy, want_dy), (sum_dy_xmu, want_xmu), (gw, want_xmu * invstd.double()),
                      (gb, want_dy)):
        torch.testing.assert_close(got.double(), want, rtol=TOL[x.dtype], atol=tol)
    none = ot.batch_norm_backward_reduce(dy, x, mean, invstd, w, False, True, False)
    assert none[0] is None and none[1] is None and none[3] is None and none[2] is not None


@pytest.mark.parametrize("kw", LAYOUTS, ids=IDS)
def test_batch_norm_backward_elemt(kw):
    x, dy = data(**kw), data(seed=1, **kw)
    mean, invstd, w = ch(1.0, -0.5, 2.0), ch(0.5, 2.0, 1.0), ch(1.0, 2.0, -1.0)
    sum_dy, sum_dy_xmu = ch(3.0, -1.0, 0.5), ch(2.0, 4.0, -3.0)
    count = torch.tensor([[5], [7]], dtype=torch.int32)
    gx = ot.batch_norm_backward_elemt(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count)
    nd, n = x.dim(), 12.0
    inv = per_channel(invstd, nd)
    want = (dy.double() - per_channel(sum_dy, nd) / n
            - (x.double() - per_channel(mean, nd)) * inv**2 * per_channel(sum_dy_xmu, nd) / n
            ) * inv * per_channel(w, nd)
    assert gx.dtype == x.dtype and gx.stride() == x.stride()
    close(gx, want, x.dtype)


def test_shared_views_give_the_same_bits_and_view_each_tensor_once():
    """One TorchViews across the calls (as SyncBatchNorm's step passes it): the bits of fresh
    calls, each tensor viewed once (its opgraph Tensor reused), its memory still the tensor's."""
    x, dy = data(), data(seed=1)
    views = ot.TorchViews()
    calls = []
    for views_arg in (None, views):
        k = dict(views=views_arg)
        mean, invstd = ot.batch_norm_stats(x, EPS, **k)
        y = ot.batch_norm_elemt(x, ch(1, 2, 3), ch(0, 1, 0), mean, invstd, EPS, **k)
        red = ot.batch_norm_backward_reduce(dy, x, mean, invstd, None, True, False, True, **k)
        gx = ot.batch_norm_backward_elemt(dy, x, mean, invstd, None, red[0], red[1],
                                          torch.tensor([[4], [8]], dtype=torch.int32), **k)
        calls.append([mean, invstd, y, red[0], red[1], red[3], gx])
    assert same_bits(*calls)
    seen = views(x)
    assert views(x) is seen and views(x.detach()) is not seen    # another object: its own view
    assert seen.data_address == x.data_ptr() and views(None) is None


@pytest.mark.parametrize("backend, platform, error", [
    ("numpy", "Ascend999", ValueError), ("nope", "Ascend950", BackendUnavailable)])
def test_on_restores_backend_and_platform_when_one_is_refused(backend, platform, error):
    before = (opgraph.get_backend_name(), opgraph.get_platform().soc)
    with ot.kernels.on("native" if get("native").availability()[0] else "numpy", "Ascend950"):
        inside = (opgraph.get_backend_name(), opgraph.get_platform().soc)
        with pytest.raises(error):
            with ot.kernels.on(backend, platform):
                pass
        assert (opgraph.get_backend_name(), opgraph.get_platform().soc) == inside
    assert (opgraph.get_backend_name(), opgraph.get_platform().soc) == before
    with pytest.raises(RuntimeError):
        with ot.kernels.on("numpy", "Ascend910"):
            assert (opgraph.get_backend_name(), opgraph.get_platform().soc) == ("numpy", "Ascend910")
            raise RuntimeError("boom")
    assert (opgraph.get_backend_name(), opgraph.get_platform().soc) == before


def test_a_view_it_cannot_make_is_left_for_the_op_api_to_name():
    views = ot.TorchViews()
    meta = torch.zeros(4, C, device="meta")                       # no memory to view
    assert views(meta) is meta
    with pytest.raises(opgraph.AclnnError, match="input: .*meta"):
        ot.batch_norm_stats(meta, EPS, views=views)


# --- torch.library registration ----------------------------------------------------------------
def aten_calls(x, dy):
    """Every registered primitive through torch's own entry points."""
    mean, invstd = torch.batch_norm_stats(x, EPS)
    table = torch.stack([mean, mean + 1]), torch.stack([invstd, invstd])
    rm, rv = torch.zeros(C), torch.ones(C)
    gm, gi = torch.batch_norm_gather_stats_with_counts(x, *table, rm, rv, 0.1, EPS,
                                                       torch.tensor([4.0, 2.0]))
    y = torch.batch_norm_elemt(x, ch(1, 2, 3), ch(0, 1, 0), gm, gi, EPS)
    out = torch.empty_like(x)
    torch.batch_norm_elemt(x, None, None, gm, gi, EPS, out=out)
    red = torch.batch_norm_backward_reduce(dy, x, gm, gi, ch(1, 2, 3), True, True, True)
    gx = torch.batch_norm_backward_elemt(dy, x, gm, gi, ch(1, 2, 3), red[0], red[1],
                                         torch.tensor([[4], [2]], dtype=torch.int32))
    return [mean, invstd, rm, rv, gm, gi, y, out, *red, gx]


def direct_calls(x, dy, backend=None):
    """The same through opgraph.torch's functions."""
    k = dict(backend=backend)
    mean, invstd = ot.batch_norm_stats(x, EPS, **k)
    table = torch.stack([mean, mean + 1]), torch.stack([invstd, invstd])
    rm, rv = torch.zeros(C), torch.ones(C)
    gm, gi = ot.batch_norm_gather_stats_with_counts(x, *table, rm, rv, 0.1, EPS,
                                                    torch.tensor([4.0, 2.0]), **k)
    y = ot.batch_norm_elemt(x, ch(1, 2, 3), ch(0, 1, 0), gm, gi, EPS, **k)
    out = ot.batch_norm_elemt(x, None, None, gm, gi, EPS, **k)
    red = ot.batch_norm_backward_reduce(dy, x, gm, gi, ch(1, 2, 3), True, True, True, **k)
    gx = ot.batch_norm_backward_elemt(dy, x, gm, gi, ch(1, 2, 3), red[0], red[1],
                                      torch.tensor([[4], [2]], dtype=torch.int32), **k)
    return [mean, invstd, rm, rv, gm, gi, y, out, *red, gx]


def same_bits(a, b):
    return all(np.array_equal(p.contiguous().view(torch.int32).numpy(),
                              q.contiguous().view(torch.int32).numpy()) for p, q in zip(a, b))


@pytest.fixture
def registered():
    ot.register_cpu_kernels()
    yield
    ot.register_cpu_kernels()            # back to the current backend


def test_registered_aten_kernels_equal_the_direct_calls(registered):
    x, dy = data(channels_last=True), data(seed=2, channels_last=True)
    assert same_bits(aten_calls(x, dy), direct_calls(x, dy))


def test_registering_again_is_harmless(registered):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "overriding a previously registered kernel"
        ot.register_cpu_kernels()
        ot.register_cpu_kernels(backend="numpy")
    assert torch.batch_norm_stats(torch.ones(2, C), EPS)[0].tolist() == [1.0] * C


def test_the_registered_kernels_run_on_the_chosen_backend(registered):
    try:
        get("native")
    except BackendUnavailable as e:
        pytest.skip(f"native backend unavailable: {e}")
    x, dy = data(), data(seed=2)
    ot.register_cpu_kernels(backend="native")
    got = aten_calls(x, dy)
    assert same_bits(got, direct_calls(x, dy, backend="numpy"))   # native is bit-faithful
    assert same_bits(got, direct_calls(x, dy, backend="native"))


def test_an_unknown_backend_is_refused_and_nothing_changes(registered):
    with pytest.raises(BackendUnavailable):
        ot.register_cpu_kernels(backend="no-such-backend")
    assert torch.batch_norm_stats(torch.ones(2, C), EPS)[0].tolist() == [1.0] * C


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_an_out_of_another_shape_is_resized_as_torch_does(registered, channels_last):
    """aten's out= rule (CUDA's batch_norm_elemt.out resizes its out): an empty out silently, a
    wrong-shaped one with a warning, as torch warns, to the input's shape in its layout; the op_api
    itself refused it ('output: rank 1 is less than 2')."""
    x = data(channels_last=channels_last)
    mean, invstd = ot.batch_norm_stats(x, EPS)
    want = ot.batch_norm_elemt(x, None, None, mean, invstd, EPS)
    for out, warned in ((torch.empty(0), False), (torch.full((7,), np.nan), True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.batch_norm_elemt(x, None, None, mean, invstd, EPS, out=out)
        assert got is out and out.stride() == want.stride() and same_bits([out], [want])
        resized = f"out= tensor of shape [7] resized to {list(x.shape)}: "
        assert [str(w.message).startswith(resized) for w in caught] == [True] * warned


def stats_twice(x):
    mean, invstd = torch.batch_norm_stats(x, EPS)
    return mean * 2, invstd


def test_torch_compile_with_dynamic_shapes_runs_the_registered_kernels_eagerly(registered):
    """The kernels have no fake implementation: with dynamic shapes each is a graph break, and
    dynamo traced into the op_apis' numpy where it ran between two graphs (TorchRuntimeError:
    copyto on fake tensors). Same bits as the eager calls, two batch sizes."""
    compiled = torch.compile(stats_twice, backend="eager", dynamic=True)
    for n in (4, 6):
        x = data(shape=(n, C, 5, 3), seed=n)
        assert same_bits(compiled(x), stats_twice(x))


def test_torch_compile_runs_the_functions_eagerly_with_the_op_apis_bits():
    """opgraph.torch's own functions in a compiled function: dynamo traced into the op_api's
    numpy and failed (batch_norm_stats: TorchRuntimeError on fake tensors) or ran its own
    rendering of it (batch_norm_elemt: not the op_api's bits)."""
    x = data()
    mean, invstd = ot.batch_norm_stats(x, EPS)

    def step(x):
        m, s = ot.batch_norm_stats(x, EPS)
        return m, s, ot.batch_norm_elemt(x, ch(1, 2, 3), None, mean, invstd, EPS)
    assert same_bits(torch.compile(step, backend="eager")(x), step(x))


def test_bad_input_through_torch_names_the_argument(registered):
    x = data()
    with pytest.raises(opgraph.AclnnError, match="mean"):
        torch.batch_norm_elemt(x, None, None, torch.zeros(C + 1), torch.ones(C), EPS)


RUNTIME_PROBE = """
import sys
import numpy as np
import opgraph
from backends.native import team
x = np.random.default_rng(0).standard_normal((4, 16, 32, 32)).astype(np.float32)
with opgraph.use_backend("native"):
    before = opgraph.ops.batch_norm_stats(x, 1e-5)   # starts the team: no OpenMP runtime yet
    first = team.runtime()
    import opgraph.torch                               # torch's libgomp now runs the kernels
    after = opgraph.ops.batch_norm_stats(x, 1e-5)
same = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(before, after))
print(first, team.runtime(), same)
"""


@pytest.mark.parametrize("policy,after", [("", "openmp"), ("ACTIVE", "openmp"),
                                          ("PASSIVE", "team")])
def test_importing_opgraph_torch_moves_native_kernels_onto_torchs_threads(policy, after):
    """A native team started before torch was imported hands its work to torch's OpenMP threads
    once opgraph.torch is imported (backends.native.team.share_openmp_if_spinning), with the same
    bits — unless OMP_WAIT_POLICY=PASSIVE, where torch's idle threads sleep and the team stays."""
    if not native.available():
        pytest.skip(native.availability()[1])
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPGRAPH_RUNTIME")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", RUNTIME_PROBE], capture_output=True, text=True,
                         timeout=300, env=env, cwd=Path(__file__).parents[1])
    assert out.stdout.split() == ["team", after, "True"], out.stderr[-2000:]
