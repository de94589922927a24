"""Properties (hypothesis): over small shapes of rank 2-5, dtypes, platforms, opt levels and
random strided layouts, the result equals the reference bit for bit, ViewCopy writes only the
output view, and the recorded graph always verifies and round-trips through JSON."""
from __future__ import annotations

import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import opgraph  # noqa: E402
from opgraph import Graph, aclnn  # noqa: E402

from reference import (BF16, F16, F32, I32, NAMES, assert_bits_equal, make_case,  # noqa: E402
                       to_tensors)

FAST = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DTYPES = [F32, F16, BF16]
LAYOUT = st.sampled_from(["contig", "perm", "step", "offset"])


@st.composite
def problems(draw):
    rank = draw(st.integers(2, 5))
    shape = tuple(draw(st.integers(1, 3)) for _ in range(rank))
    dtype = draw(st.sampled_from(DTYPES))
    per_tensor = draw(st.booleans())
    dtypes = {n: draw(st.sampled_from(DTYPES)) for n in NAMES[:-1]} if per_tensor else None
    kw = dict(
        dtype=dtype, dtypes=dtypes,
        out_dtype=draw(st.sampled_from(DTYPES + [None])),
        weight=draw(st.booleans()),
        counter_dtype=draw(st.sampled_from([I32, F16, F32])),
        counter_shape=tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3)))),
        seed=draw(st.integers(0, 2 ** 16)),
    )
    layouts = {n: draw(LAYOUT) for n in NAMES}
    soc = draw(st.sampled_from(["Ascend910B", "Ascend950", "Ascend910_93"]))
    level = draw(st.sampled_from([0, 1, 2]))
    out_pad = tuple(draw(st.integers(0, 2)) for _ in range(rank))
    out_perm = draw(st.permutations(range(rank)))
    out_offset = draw(st.integers(0, 5))
    layout_seed = draw(st.integers(0, 2 ** 16))
    return shape, kw, layouts, soc, level, (out_pad, out_perm, out_offset), layout_seed


def strided_out(shape, dtype, pad, perm, offset):
    """A view of ``shape`` whose dims are laid out in order ``perm`` with ``pad`` unused
    elements after each dim, over a sentinel-filled storage. Returns (tensor, storage, pristine, index)."""
    strides = [0] * len(shape)
    acc = 1
    for d in reversed(perm):  # perm[-1] is the fastest-varying dim
        strides[d] = acc
        acc *= shape[d] + pad[d]
    size = offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1 + 3
    raw = np.random.default_rng(size).integers(0, 256, size * np.dtype(dtype).itemsize, dtype=np.uint8)
    storage = raw.view(dtype)
    t = opgraph.Tensor(storage, shape, tuple(strides), offset)
    idx = np.full(shape, offset, np.int64)
    for d, s in enumerate(strides):
        sh = [1] * len(shape)
        sh[d] = shape[d]
        idx = idx + (np.arange(shape[d]) * s).reshape(sh)
    return t, storage, storage.copy(), idx


@FAST
@given(problems())
def test_matches_reference_bit_exactly_and_writes_only_the_view(problem):
    shape, kw, layouts, soc, level, (pad, perm, offset), layout_seed = problem
    case = make_case(shape, **kw)
    ts = to_tensors(case, layouts, np.random.default_rng(layout_seed))
    for n, t in zip(NAMES, ts):
        if t is not None:
            assert np.array_equal(t.numpy(), getattr(case, n))
    out, storage, pristine, idx = strided_out(shape, case.out_dtype, pad, perm, offset)
    with opgraph.platform(soc), opgraph.opt_level(level):
        st1, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*ts, out)
        assert st1 == 0, aclnn.aclGetRecentErrMsg()
        assert aclnn.aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex) == 0
    assert_bits_equal(out.numpy(), case.expected(soc))
    outside = np.ones(storage.size, bool)
    outside[idx.ravel()] = False
    assert outside.sum() == storage.size - math.prod(shape)
    assert storage[outside].tobytes() == pristine[outside].tobytes()


@FAST
@given(problems())
def test_recorded_graph_verifies_and_round_trips(problem):
    shape, kw, layouts, soc, level, _, layout_seed = problem
    case = make_case(shape, **kw)
    ts = to_tensors(case, layouts, np.random.default_rng(layout_seed))
    out = opgraph.tensor(np.zeros(shape, case.out_dtype))
    with opgraph.platform(soc), opgraph.opt_level(level):
        st1, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*ts, out)
    assert st1 == 0
    g = ex.graph
    g.verify()
    assert sum(n.op == "BroadcastTo" for n in g.nodes) == 5
    assert sum(n.op == "Contiguous" for n in g.nodes) == 8
    assert sum(n.op == "Fill" for n in g.nodes) == (case.weight is None)
    assert sum(n.op == "UnsqueezeNd" for n in g.nodes) == 5 * (1 + (len(shape) > 2))
    assert Graph.from_json(g.to_json()) == g
    assert ex.compiled is not None
    ex.compiled.verify()
    assert ws == ex.workspace_size >= 0


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 4), min_size=2, max_size=5), st.integers(0, 10), st.data())
def test_tensor_view_matches_numpy_as_strided(shape, offset, data):
    """Tensor.numpy() equals the element-by-element definition of a strided view."""
    strides = [data.draw(st.integers(0, 6)) for _ in shape]
    span = offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    storage = np.arange(span + data.draw(st.integers(0, 3)), dtype=np.float32)
    t = opgraph.Tensor(storage, shape, strides, offset)
    got = t.numpy()
    for i in np.ndindex(*shape):
        assert got[i] == storage[offset + sum(a * s for a, s in zip(i, strides))]
    with pytest.raises(ValueError, match="outside storage"):
        opgraph.Tensor(storage[:span - 1], shape, strides, offset)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=5), st.data())
def test_contiguity_means_consecutive_addresses(shape, data):
    """For more than one element, is_contiguous holds exactly when walking the view in C order
    visits consecutive storage elements (so size-1 dims and the offset cannot matter)."""
    strides = [data.draw(st.integers(0, 30)) for _ in shape]
    numel = math.prod(shape)
    if numel <= 1:
        expected = True
    else:
        addrs = [sum(a * s for a, s in zip(i, strides)) for i in np.ndindex(*shape)]
        expected = addrs == list(range(addrs[0], addrs[0] + numel))
    assert opgraph.is_contiguous(shape, strides) is expected
