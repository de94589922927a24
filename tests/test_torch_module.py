"""opgraph.torch.SyncBatchNorm as a drop-in for torch.nn.SyncBatchNorm in one process: state-dict
keys, momentum=None cumulative average, eval behaviour, num_batches_tracked, the fallback to
ordinary batch norm without a process group, and convert_sync_batchnorm."""
from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")

from torch import nn  # noqa: E402

import opgraph  # noqa: E402
import opgraph.torch as ot  # noqa: E402
from backends.numpy_backend import NumpyBackend  # noqa: E402

C = 3


def batch(seed: int, shape=(4, C, 5, 2)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 2 + 1


def test_state_dict_is_torchs():
    ours, theirs = ot.SyncBatchNorm(C), nn.SyncBatchNorm(C)
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b) == ["weight", "bias", "running_mean", "running_var",
                                  "num_batches_tracked"]
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    with torch.no_grad():
        theirs.running_mean.fill_(0.25)
        theirs.weight.fill_(2.0)
    theirs.num_batches_tracked.fill_(7)
    ours.load_state_dict(theirs.state_dict())           # strict: same keys both ways
    assert ours.running_mean.eq(0.25).all() and ours.weight.eq(2.0).all()
    assert int(ours.num_batches_tracked) == 7
    theirs.load_state_dict(ot.SyncBatchNorm(C).state_dict())
    assert list(ot.SyncBatchNorm(C, affine=False, track_running_stats=False).state_dict()) == []


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_without_a_process_group_it_is_batch_norm(momentum):
    """Bit for bit torch.nn.BatchNorm2d, over steps, in training and in eval."""
    ours, ref = ot.SyncBatchNorm(C, momentum=momentum), nn.BatchNorm2d(C, momentum=momentum)
    for step in range(3):
        xs = [batch(step).requires_grad_() for _ in range(2)]
        ys = [m(x) for m, x in zip((ours, ref), xs)]
        for y in ys:
            y.backward(torch.ones_like(y) * (step + 1) + y.detach())
        assert torch.equal(ys[0], ys[1]) and torch.equal(xs[0].grad, xs[1].grad)
        assert torch.equal(ours.weight.grad, ref.weight.grad)
    assert torch.equal(ours.running_mean, ref.running_mean)
    assert torch.equal(ours.running_var, ref.running_var)
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 3
    ours.eval(), ref.eval()
    assert torch.equal(ours(batch(9)), ref(batch(9)))


def test_cumulative_average_of_the_batch_statistics():
    """momentum=None: after k steps the running stats are the plain average of the k batches'
    mean and unbiased variance (computed here with numpy in float64)."""
    bn = ot.SyncBatchNorm(C, momentum=None)
    xs = [batch(s).numpy().astype(np.float64) for s in range(3)]
    for x in xs:
        bn(torch.from_numpy(x).float())
    axes = (0, 2, 3)
    np.testing.assert_allclose(bn.running_mean.numpy(), np.mean([x.mean(axes) for x in xs], 0),
                               rtol=1e-5)
    np.testing.assert_allclose(bn.running_var.numpy(),
                               np.mean([x.var(axes, ddof=1) for x in xs], 0), rtol=1e-5)


def test_eval_normalises_with_the_running_stats():
    bn = ot.SyncBatchNorm(C).eval()
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([1.0, -2.0, 0.5]))
        bn.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
        bn.weight.copy_(torch.tensor([1.0, 2.0, -1.0]))
        bn.bias.copy_(torch.tensor([0.0, 1.0, 3.0]))
    x = batch(1)
    want = ((x.double() - bn.running_mean.double().view(1, C, 1, 1))
            / torch.sqrt(bn.running_var.double().view(1, C, 1, 1) + 1e-5)
            * bn.weight.double().view(1, C, 1, 1) + bn.bias.double().view(1, C, 1, 1))
    torch.testing.assert_close(bn(x).double(), want, rtol=1e-6, atol=1e-6)
    assert int(bn.num_batches_tracked) == 0                 # eval does not count


@pytest.mark.parametrize("shape,message", [((4,), "expected at least 2D input"),
                                           ((4, 0, 2), "number of input channels")])
def test_bad_input_dims(shape, message):
    with pytest.raises(ValueError, match=message):
        ot.SyncBatchNorm(C)(torch.zeros(shape))


def test_convert_sync_batchnorm_shares_everything():
    inner = nn.Sequential(nn.Conv1d(2, C, 1), nn.BatchNorm1d(C, momentum=None))
    net = nn.Sequential(nn.Conv2d(1, C, 1), nn.BatchNorm2d(C, eps=1e-3), inner,
                        nn.BatchNorm3d(C, affine=False), nn.SyncBatchNorm(C, bias=False))
    net[1].qconfig = "some qconfig"
    net[3].eval()
    old = [net[1], inner[1], net[3], net[4]]
    out = ot.convert_sync_batchnorm(net, process_group="pg", backend="numpy")
    assert out is net and isinstance(out[0], nn.Conv2d)
    new = [out[1], out[2][1], out[3], out[4]]
    assert all(type(m) is ot.SyncBatchNorm for m in new)
    for a, b in zip(old, new):
        assert (a.weight is b.weight) and (a.bias is b.bias)
        assert a.running_mean is b.running_mean and a.running_var is b.running_var
        assert a.num_batches_tracked is b.num_batches_tracked
        assert (a.eps, a.momentum, a.affine, a.training) == (b.eps, b.momentum, b.affine, b.training)
        assert b.process_group == "pg" and b.backend == "numpy"
    assert out[1].qconfig == "some qconfig" and out[4].bias is None and out[4].weight is not None
    assert not out[3].training and out[1].training


def test_convert_a_lone_batchnorm_and_the_classmethod():
    bn = nn.BatchNorm2d(C)
    new = ot.SyncBatchNorm.convert_sync_batchnorm(bn, platform="Ascend950")
    assert isinstance(new, ot.SyncBatchNorm) and new.weight is bn.weight
    assert new.platform == "Ascend950" and "platform=Ascend950" in repr(new)
    lin = nn.Linear(2, 2)
    assert ot.convert_sync_batchnorm(lin) is lin


def test_reconverting_keeps_backend_and_platform_unless_given():
    bn = ot.SyncBatchNorm(C, backend="numpy", platform="Ascend950")
    again = ot.convert_sync_batchnorm(bn)
    assert (again.backend, again.platform) == ("numpy", "Ascend950") and again.weight is bn.weight
    other = ot.convert_sync_batchnorm(bn, platform="Ascend910B")
    assert (other.backend, other.platform) == ("numpy", "Ascend910B")


@pytest.mark.parametrize("kwargs, message", [({"backend": "nope"}, "unknown backend 'nope'"),
                                             ({"platform": "nope"}, "unknown platform 'nope'")])
def test_an_unknown_backend_or_platform_fails_when_the_layer_is_made(kwargs, message):
    """Not at its first multi-rank step (with one rank or no group it would never be used)."""
    with pytest.raises(Exception, match=message):
        ot.SyncBatchNorm(C, **kwargs)


def test_it_is_not_torchs_syncbatchnorm():
    """DDP refuses torch.nn.SyncBatchNorm layers on CPU: ours must not be one."""
    assert not isinstance(ot.SyncBatchNorm(C), nn.SyncBatchNorm)
    assert isinstance(ot.SyncBatchNorm(C), nn.modules.batchnorm._BatchNorm)


def test_torch_compile_runs_the_function_eagerly_with_the_same_bits():
    """Under torch.compile (dynamo + AOTAutograd, backend "aot_eager": no C++ build) the
    autograd function is a graph break, not traced: dynamo cannot trace the op_apis' numpy.
    One rank (the exchanges skipped), so no process group is needed."""
    w, b = torch.linspace(0.5, 2, C).requires_grad_(), torch.linspace(-1, 1, C).requires_grad_()
    stats = [[torch.zeros(C), torch.ones(C)] for _ in range(2)]

    def step(x, running):
        y = ot.SyncBatchNormFunction.apply(x, w, b, *running, 1e-5, 0.1, None, 1, {})
        return (y.relu() * 3).sum()

    results = []
    for fn, running in ((step, stats[0]), (torch.compile(step, backend="aot_eager"), stats[1])):
        x = batch(7).requires_grad_()
        w.grad = b.grad = None
        fn(x, running).backward()
        results.append([t.detach().clone() for t in (x.grad, w.grad, b.grad, *running)])
    assert results[1][-1].ne(1).any()  # the running stats were updated
    for eager, compiled in zip(*results):
        assert np.array_equal(eager.numpy().view(np.int32), compiled.numpy().view(np.int32))


def test_a_second_backward_through_the_function_is_refused():
    """Its backward is not differentiable (the op_apis run outside autograd): a gradient taken
    with create_graph=True must not silently drop the second-order term."""
    x = batch(8).requires_grad_()
    y = ot.SyncBatchNormFunction.apply(x, torch.ones(C, requires_grad=True), None, None, None,
                                       1e-5, 0.1, None, 1, {})
    g, = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


@pytest.mark.parametrize("dtype, hint", [
    (torch.float64, r"takes float32, float16; use float32 \(model.float\(\)"),
    (torch.bfloat16, r"takes float32, float16; bfloat16 statistics exist only on Ascend950: "
                     r"SyncBatchNorm\(\.\.\., platform='Ascend950'\)")])
def test_an_input_dtype_the_op_apis_refuse_says_what_to_use(dtype, hint):
    """float64 (a gradcheck) and bfloat16 off the 950 (CPU autocast's default): the op_api's
    161002 named neither the layer nor the platform that takes bfloat16."""
    x = batch(0).to(dtype).requires_grad_()
    with pytest.raises(TypeError, match=f"SyncBatchNorm: input dtype {dtype} is not supported on "
                                        f"Ascend910B, whose BatchNormStats {hint}"):
        ot.SyncBatchNormFunction.apply(x, None, None, None, None, 1e-5, 0.1, None, 1, {})
    with torch.autocast("cpu", dtype=torch.bfloat16):  # on the 950 it runs
        h = torch.nn.functional.conv2d(batch(0), torch.eye(C).view(C, C, 1, 1))
        y = ot.SyncBatchNormFunction.apply(h, None, None, None, None, 1e-5, 0.1, None, 1,
                                           {"platform": "Ascend950"})
    assert h.dtype == y.dtype == torch.bfloat16


@pytest.mark.parametrize("param", ["weight", "bias", "running_mean", "running_var"])
def test_a_float64_parameter_is_refused_before_any_exchange_naming_it(param):
    """model.double() fed float32 inputs: the op_api's 161002 came from BatchNormElemt or the
    gather, after the exchange and on the ranks with data only."""
    args = {"weight": torch.ones(C), "bias": torch.zeros(C), "running_mean": torch.zeros(C),
            "running_var": torch.ones(C)}
    args[param] = args[param].double()
    with pytest.raises(TypeError, match=f"SyncBatchNorm: {param} dtype torch.float64 is not "
                                        r"supported .*; use model.float\(\)"):
        ot.SyncBatchNormFunction.apply(batch(0), *args.values(), 1e-5, 0.1, None, 1, {})


def test_importing_and_running_the_layer_leaves_dynamo_unimported():
    """torch.compiler.disable is applied only under torch.compile (importing dynamo costs
    ~1.5 s and changes how DDP holds its model)."""
    code = ("import sys, torch, opgraph.torch as ot\n"
            "x = torch.randn(4, 3, 2, requires_grad=True)\n"
            "ot.SyncBatchNormFunction.apply(x, None, None, None, None, 1e-5, 0.1, None, 1, {})"
            ".sum().backward()\n"
            "print('torch._dynamo' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False"]


class CompilesLogged(NumpyBackend):
    """numpy, logging the programs it compiles (each op_api's: its graph's name)."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled: list[str] = []

    def compile(self, graph, memory_plan, platform):
        self.compiled.append(graph.name)
        return super().compile(graph, memory_plan, platform)


def test_the_backward_runs_on_the_forwards_platform_and_backend():
    """A backward after the block that set the platform and backend (``loss.backward()``
    outside it) ran on the ones current then: here the Ascend910, which has no bfloat16
    op_apis, and the default numpy instance."""
    x = batch(0).bfloat16().requires_grad_()
    w, b, rm, rv = torch.ones(C), torch.zeros(C), torch.zeros(C), torch.ones(C)
    backend = CompilesLogged()
    with opgraph.platform("Ascend910"):
        with opgraph.platform("Ascend950"), opgraph.use_backend(backend):
            y = ot.SyncBatchNormFunction.apply(x, w, b, rm, rv, 1e-5, 0.1, None, 1, {})
        y.backward(torch.ones_like(y))
    assert x.grad.dtype == torch.bfloat16
    assert {"aclnnBatchNormReduceBackward", "aclnnBatchNormElemtBackward"} <= set(backend.compiled)


def test_a_graph_kept_after_its_backward_keeps_no_activation():
    """The forward's tensor views were kept with the autograd node: a ``loss`` kept until the
    next step (as a loop keeps it) kept every layer's input alive, which torch frees at the
    backward. A second backward (retain_graph) still gives the same gradient."""
    x = batch(0).requires_grad_()
    h = x * 2  # the layer's input: an activation only the graph holds
    y = ot.SyncBatchNormFunction.apply(h, torch.ones(C), torch.zeros(C), None, None, 1e-5, 0.1,
                                       None, 1, {"backend": "numpy"})
    loss = (y * batch(1)).sum()
    activation = weakref.ref(h)
    del h
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert torch.equal(x.grad, 2 * first)
    gc.collect()
    assert activation() is None and loss.grad_fn is not None
