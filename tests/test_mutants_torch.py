"""Mutation audit of opgraph/torch/: what its tests did not pin before. TorchViews never hands
out the view of a tensor that is gone; a numpy subclass argument takes the usual call (it raised
AttributeError); a torch tensor's span is its byte bounds; a meta tensor is refused even after a
CPU call of its layout; one value per channel on one rank is refused as torch does, and ranks
with one value per channel count when another rank is empty; the gather's counts are rounded
to half-precision running stats, eagerly and captured; a captured step with a frozen bias writes
the weight gradient only; a backward outside its forward's fast-math block keeps fast-math;
eval mode uses running stats kept after tracking is switched off, as torch's BatchNorm;
registering the aten kernels again changes their platform; the syncbn check refuses an empty
shape at once; run_ranks returns results in rank order whichever rank finishes first."""
from __future__ import annotations

import time

import numpy as np
import pytest

try:  # numpy 2
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy 1.x (pyproject allows >= 1.24)
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")

import opgraph  # noqa: E402
import opgraph.torch as ot  # noqa: E402
from opgraph.torch import check, kernels as K  # noqa: E402
from opgraph.torch.direct import TORCH  # noqa: E402


def finishes_last_on_rank_0(rank, world):
    """Its rank, rank 0 a second late."""
    if rank == 0:
        time.sleep(1.0)  # rank 1 sends its result first
    return rank


def test_views_of_dropped_bfloat16_tensors_are_never_reused():
    """TorchViews keys by id(); it holds each tensor so that its id is not reused while
    remembered. A bfloat16 view (16-bit words) does not keep the tensor alive by itself."""
    views = K.TorchViews()
    for i in range(64):
        t = torch.full((3,), float(i), dtype=torch.bfloat16)
        assert float(views(t).numpy()[0]) == i
        del t


def test_one_value_per_channel_on_one_rank_is_refused_as_torch_does():
    """torch's SyncBatchNorm function refuses one value per channel on one rank (its variance
    is no statistic): so does opgraph's, eagerly and in a capture, before touching the running
    stats."""
    x = torch.randn(1, 3, requires_grad=True)
    w, b = torch.ones(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    rm, rv = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        ot.SyncBatchNormFunction.apply(x, w, b, rm, rv, 1e-5, 0.1, None, 1, {})
    bn = ot.SyncBatchNorm(3)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        with opgraph.capture():
            bn(x)
    assert (rm == 0).all() and (rv == 1).all()
    assert (bn.running_mean == 0).all() and (bn.running_var == 1).all()


def one_value_per_channel_ranks_and_an_empty_one(rank, world):
    """A [2, 3] batch over 3 ranks: one sample (one value per channel) on ranks 0 and 1, none
    on rank 2; SyncBatchNorm forward and backward."""
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    mine = x.tensor_split(world)[rank].clone().requires_grad_()
    bn = ot.SyncBatchNorm(3)
    y = bn(mine)
    y.backward(dy.tensor_split(world)[rank])
    return y.detach(), mine.grad, bn.running_mean, bn.running_var


def test_one_value_per_channel_ranks_count_when_another_rank_is_empty():
    """Dropping the empty rank keeps the ranks with count 1: the result is BatchNorm1d's on the
    whole batch (float32 reference, float64 comparison)."""
    results = ot.run_ranks(one_value_per_channel_ranks_and_an_empty_one, 3, timeout=90.0,
                           pg_timeout=30.0)
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(2, 3, generator=g).requires_grad_(), torch.randn(2, 3, generator=g)
    ref = torch.nn.BatchNorm1d(3)
    y = ref(x)
    y.backward(dy)
    outputs = torch.cat([r[0] for r in results])
    grads = torch.cat([r[1] for r in results if r[1] is not None])
    torch.testing.assert_close(outputs.double(), y.detach().double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads.double(), x.grad.double(), rtol=1e-5, atol=1e-5)
    for _, _, running_mean, running_var in results:
        torch.testing.assert_close(running_mean, ref.running_mean, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(running_var, ref.running_var, rtol=1e-6, atol=1e-7)


def test_the_gathers_counts_are_rounded_to_half_precision_running_stats(monkeypatch):
    """torch's SyncBatchNorm hands the gather its counts in the running stats' dtype (PTF): a
    float16 model's 2049 values per channel count as float16(2049) = 2048 there, eagerly and
    in a capture."""
    seen = []
    gather = K.batch_norm_gather_stats_with_counts

    def spy(*args, **kwargs):
        seen.append(args[7])
        return gather(*args, **kwargs)
    monkeypatch.setattr(K, "batch_norm_gather_stats_with_counts", spy)
    x = torch.linspace(-1, 1, 2049, dtype=torch.float16).reshape(2049, 1).requires_grad_()
    rm, rv = torch.zeros(1, dtype=torch.float16), torch.ones(1, dtype=torch.float16)
    ot.SyncBatchNormFunction.apply(x, None, None, rm, rv, 1e-5, 0.1, None, 1, {})
    with opgraph.capture():  # (one rank: no process group)
        ot.SyncBatchNormFunction.apply(x, None, None, rm, rv, 1e-5, 0.1, None, 1, {})
    for counts in seen:  # eager, captured
        assert np.asarray(counts).dtype == np.float16 and np.asarray(counts).tolist() == [2048.0]
    assert len(seen) == 2


def test_a_captured_step_with_a_frozen_bias_writes_the_weight_gradient_only():
    """One rank in a capture: weight trains, bias frozen. Each replay writes weight.grad,
    sum(dy * x_hat) per channel (float64 formula), and leaves bias.grad None."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 2, 2, generator=g).requires_grad_()
    dy = torch.randn(4, 3, 2, 2, generator=g)
    bn = ot.SyncBatchNorm(3)
    bn.bias.requires_grad_(False)
    with opgraph.capture() as prog:
        bn(x).backward(dy)
    bn.weight.grad.zero_()
    prog.replay()
    x64 = x.detach().double()
    mean, var = x64.mean((0, 2, 3), keepdim=True), x64.var((0, 2, 3), unbiased=False, keepdim=True)
    want = (dy.double() * (x64 - mean) / torch.sqrt(var + 1e-5)).sum((0, 2, 3))
    torch.testing.assert_close(bn.weight.grad.double(), want, rtol=1e-5, atol=1e-5)
    assert bn.bias.grad is None


def test_registering_again_changes_the_platform_of_the_aten_kernels():
    """register_cpu_kernels is idempotent but a later call sets the kernels' platform: after
    registering for the Ascend950, torch.batch_norm_stats takes bfloat16 (float64 formula)."""
    ot.register_cpu_kernels()
    x = torch.arange(24.).reshape(2, 3, 4).to(torch.bfloat16)
    try:
        ot.register_cpu_kernels(platform="Ascend950")
        mean, _ = torch.batch_norm_stats(x, 1e-5)
    finally:
        ot.register_cpu_kernels()
    torch.testing.assert_close(mean.double(), x.double().mean((0, 2)), rtol=1e-6, atol=0)


def test_eval_mode_uses_the_running_stats_kept_after_tracking_is_switched_off():
    """As torch's BatchNorm: running stats that exist are used in eval mode even when
    ``track_running_stats`` was set False afterwards."""
    ours, torchs = ot.SyncBatchNorm(3), torch.nn.BatchNorm2d(3)
    for bn in (ours, torchs):
        bn.running_mean.fill_(0.5)
        bn.running_var.fill_(4.0)
        bn.track_running_stats = False
        bn.eval()
    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(ours(x), torchs(x))
    torch.testing.assert_close(ours(x), (x - 0.5) / torch.sqrt(torch.tensor(4.0 + 1e-5)))


def test_a_backward_outside_the_fast_math_block_of_its_forward_keeps_fast_math(monkeypatch):
    """The layer's backward keeps its forward's opgraph.fast_math() setting (loss.backward()
    may run after the block ends): its op_apis are called with fast-math on."""
    seen = []
    reduce = K.batch_norm_backward_reduce

    def spy(*args, **kwargs):
        seen.append(opgraph.get_fast_math())
        return reduce(*args, **kwargs)
    monkeypatch.setattr(K, "batch_norm_backward_reduce", spy)
    x = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(4)).requires_grad_()
    with opgraph.fast_math():
        y = ot.SyncBatchNormFunction.apply(x, None, None, None, None, 1e-5, 0.1, None, 1, {})
    y.backward(torch.ones_like(y))
    assert seen == [True] and not opgraph.get_fast_math()


def test_a_meta_tensor_is_refused_even_after_a_cpu_call_of_its_layout():
    """A learnt call's metadata does not cover a tensor off the CPU (a meta tensor has no
    memory): the call is the op_api's, which names the device, not a direct run from address 0."""
    x = torch.arange(24.).reshape(2, 3, 4)
    for _ in range(2):  # learnt, then direct
        K.batch_norm_stats(x, 1e-5)
    with pytest.raises(opgraph.AclnnError, match="input: cannot be used .*device 'meta'"):
        K.batch_norm_stats(torch.empty(2, 3, 4, device="meta"), 1e-5)


class Sub(np.ndarray):
    """A numpy subclass (as np.memmap and masked arrays are)."""


def test_a_numpy_subclass_takes_the_usual_call():
    """The primitives take numpy arrays too; a subclass of ndarray is never keyed for a direct
    call (its operators may differ) but runs the op_api as usual (it raised AttributeError:
    'is_cpu')."""
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for _ in range(2):
        mean, invstd = K.batch_norm_stats(x.view(Sub), 1e-5)
        np.testing.assert_allclose(mean.numpy(), x.astype(np.float64).mean(axis=(0, 2)), rtol=1e-6)
        np.testing.assert_allclose(invstd.numpy(), 1 / np.sqrt(x.astype(np.float64).var(axis=(0, 2))
                                                               + 1e-5), rtol=1e-5)


@pytest.mark.parametrize("make", [
    lambda b: b[:24].reshape(4, 6).t(),                              # transposed
    lambda b: b[3:24].reshape(3, 7)[:, ::3],                         # stepped, offset
    lambda b: b[:36].reshape(1, 3, 3, 4).contiguous(memory_format=torch.channels_last),
    lambda b: b[:12].reshape(3, 4),                                  # contiguous
    lambda b: b[5:5].reshape(0, 3),                                  # empty
], ids=["transposed", "stepped", "channels_last", "contiguous", "empty"])
def test_a_torch_tensors_span_is_its_byte_bounds(make):
    """The bytes a tensor spans (what direct calls check for shared memory) are numpy's
    byte_bounds of the same memory, to the last element's last byte."""
    t = make(torch.zeros(64))
    lo, hi = TORCH.span(t)
    assert (lo, hi) == byte_bounds(t.numpy()) if t.numel() else lo == hi  # empty: no bytes


@pytest.mark.parametrize("shape", [(0, 3), (2, 0), (2, 3, 0)])
def test_the_syncbn_check_refuses_an_empty_shape_before_starting_ranks(shape):
    """opgraph syncbn's compare() wants N >= 1 and C >= 1 and some elements: said at once."""
    with pytest.raises(ValueError, match=r"expected N,C,\.\.\. with N >= 1 and C >= 1"):
        check.compare(2, shape, timeout=30.0)


def test_results_come_back_in_rank_order_whichever_rank_finishes_first():
    """Rank 0 finishes a second after rank 1: the results are still [rank 0's, rank 1's]."""
    assert ot.run_ranks(finishes_last_on_rank_0, 2, timeout=60.0, pg_timeout=20.0) == [0, 1]
