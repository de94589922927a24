"""``opgraph.ops`` offers torch's names for the SyncBatchNorm family (the public contract):
``batch_norm_backward_elemt`` was only reachable as ``batch_norm_elemt_backward``."""
import numpy as np

import opgraph.ops

# torch.* names of the family's primitives, and the two op_apis torch has no primitive for
CONTRACT = ["batch_norm_stats", "batch_norm_gather_stats_with_counts", "batch_norm_elemt",
            "batch_norm_backward_reduce", "batch_norm_backward_elemt", "batch_norm_reduce",
            "sync_batch_norm_gather_stats"]


def test_every_contract_name_is_exported():
    assert set(CONTRACT) <= set(opgraph.ops.__all__)
    assert all(callable(getattr(opgraph.ops, name)) for name in opgraph.ops.__all__)


def test_batch_norm_backward_elemt_takes_torchs_argument_order():
    """(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count), checked against the
    formula in float64: dx = (dy − Σdy/n − (x − mean)·invstd²·Σdy·xmu/n)·invstd·w."""
    rng = np.random.default_rng(3)
    dy, x = (rng.standard_normal((4, 3, 5)).astype(np.float32) for _ in range(2))
    mean, w, sdy, sdxmu = (rng.standard_normal(3).astype(np.float32) for _ in range(4))
    invstd = rng.uniform(0.5, 2, 3).astype(np.float32)
    count = np.int32([7, 6, 7])  # n = 20
    got = opgraph.ops.batch_norm_backward_elemt(dy, x, mean, invstd, w, sdy, sdxmu, count)
    c = lambda v: np.float64(v)[None, :, None]  # noqa: E731
    n = 20.0
    want = (dy - c(sdy) / n - (x - c(mean)) * c(invstd) ** 2 * c(sdxmu) / n) * c(invstd) * c(w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
