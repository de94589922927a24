"""An output whose own elements share memory (a stride of 0, strides that interleave) cannot
hold its results: phase 1 refuses it with 161002 naming it, and every output stays untouched
(torch refuses such outputs too; native's threads would otherwise leave a different element in
the shared cell from run to run). Nor can a masked array passed as ``out=``: its mask would
still hide what was written."""
from __future__ import annotations

import numpy as np
import pytest

import opgraph
from opgraph import aclnn, ops
from family import default_call, get_op_api, shipped_op_apis
from opgraph.core.tensor import Tensor, overlaps_itself

INVALID, INNER_NULLPTR = 161002, 561103


def _written_params():
    for spec in shipped_op_apis():
        for p in spec.params:
            if p.kind == "tensor" and p.role in ("output", "inout"):
                yield pytest.param(spec.name, p.name, id=f"{spec.name}-{p.name}")


@pytest.mark.parametrize("name, param", list(_written_params()))
@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_an_output_with_a_stride_of_0_is_refused(name, param, backend):
    spec = get_op_api(name)
    cfg, arrays = default_call(spec)
    target = arrays.get(param)
    if not isinstance(target, np.ndarray) or target.size < 2:
        pytest.skip(f"{param} is NULL or has fewer than 2 elements in the default call")
    cell = np.full(1, 3, target.dtype)
    arrays[param] = np.lib.stride_tricks.as_strided(cell, target.shape, (0,) * target.ndim)
    before = {k: v.tobytes() for k, v in arrays.items() if isinstance(v, np.ndarray)}
    args = spec.args_of(arrays, lambda x, fmt: opgraph.tensor(x, fmt), cfg)
    with opgraph.use_backend(backend):
        status, size, ex = spec.get_workspace_size(*args)
    msg = aclnn.aclGetRecentErrMsg()
    if status == INNER_NULLPTR:  # the vendor's own path refused the strided tensor first
        assert f"{param}: " in msg and "contiguous" in msg, msg
    else:
        assert status == INVALID, msg
        assert msg.startswith(f"ACLNN_ERR_PARAM_INVALID (161002): {param}: its elements overlap"), msg
    assert (size, ex) == (0, None)
    assert {k: v.tobytes() for k, v in arrays.items() if isinstance(v, np.ndarray)} == before


def test_the_pythonic_api_refuses_it_too():
    x = np.ones((2, 3, 4), np.float32)
    out = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), x.shape, (0, 0, 0))
    c = np.ones(3, np.float32)
    with pytest.raises(opgraph.AclnnError, match="output: its elements overlap in memory"):
        ops.batch_norm_elemt(x, c, c, c, c, 1e-5, out=out)
    assert out[0, 0, 0] == 0


@pytest.mark.parametrize("shape, strides, overlaps", [
    ((2, 3), (3, 1), False), ((3, 2), (1, 3), False), ((2, 3), (0, 1), True),
    ((2, 3), (2, 1), True), ((2, 2), (2, 3), False), ((1, 5), (0, 1), False),
    ((4, 1), (1, 0), False), ((2, 2, 2), (4, 1, 2), False), ((2, 2, 2), (3, 1, 2), True)])
def test_overlaps_itself(shape, strides, overlaps):
    assert overlaps_itself(Tensor(np.zeros(64, np.float32), shape, strides)) == overlaps
    offsets = {sum(i * s for i, s in zip(index, strides)) for index in np.ndindex(shape)}
    assert overlaps == (len(offsets) < np.prod(shape))  # every element's offset, enumerated


def test_a_masked_array_output_is_refused():
    x = np.ones((2, 3, 4), np.float32)
    c = np.ones(3, np.float32)
    out = np.ma.masked_array(np.zeros_like(x), mask=True)
    with pytest.raises(opgraph.AclnnError, match="out: a masked array keeps its mask"):
        ops.batch_norm_elemt(x, c, c, c, c, 1e-5, out=out)
    with pytest.raises(opgraph.AclnnError, match="out: a masked array keeps its mask"):
        ops.batch_norm_elemt_backward(x, x, c, c, c, c, c, np.float32([4, 4, 4]), out=out)
    assert (out.data == 0).all() and out.mask.all()
