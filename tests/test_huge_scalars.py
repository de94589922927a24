"""An integer scalar too large for its C type (``eps=10**400``) is refused by phase 1 with 161002
naming it, as any other bad argument, and the outputs stay untouched; ``float()`` on it would
raise OverflowError."""
from __future__ import annotations

import numpy as np
import pytest

import opgraph
from opgraph import aclnn, ops
from family import default_call, get_op_api, shipped_op_apis

INVALID = 161002


def _scalar_params():
    for spec in shipped_op_apis():
        for p in spec.params:
            if p.kind in ("double", "float", "int"):
                yield pytest.param(spec.name, p.name, id=f"{spec.name}-{p.name}")


@pytest.mark.parametrize("name, param", list(_scalar_params()))
@pytest.mark.parametrize("huge", [10**400, -(10**400)], ids=["+1e400", "-1e400"])
def test_an_integer_too_large_for_a_double_is_refused(name, param, huge):
    spec = get_op_api(name)
    cfg, arrays = default_call(spec)
    before = {k: v.tobytes() for k, v in arrays.items() if isinstance(v, np.ndarray)}
    args = spec.args_of(arrays, lambda x, fmt: opgraph.tensor(x, fmt), cfg)
    at = [p.name for p in spec.params].index(param)
    args[at] = huge
    status, size, ex = spec.get_workspace_size(*args)
    assert (status, size, ex) == (INVALID, 0, None)
    msg = aclnn.aclGetRecentErrMsg()
    assert msg.startswith(f"ACLNN_ERR_PARAM_INVALID (161002): {param}: an integer of 1329 bits"), msg
    assert {k: v.tobytes() for k, v in arrays.items() if isinstance(v, np.ndarray)} == before


def test_the_largest_integer_a_double_holds_is_taken():
    x = np.ones((2, 3, 4), np.float32)
    mean, invstd = ops.batch_norm_stats(x, int(np.finfo(np.float64).max))
    assert mean.tolist() == [1.0, 1.0, 1.0] and invstd.dtype == np.float32


def test_the_pythonic_api_raises_aclnn_error_for_it():
    with pytest.raises(opgraph.AclnnError, match="eps: an integer of 1329 bits does not fit in a double"):
        ops.batch_norm_stats(np.ones((2, 3, 4), np.float32), 10**400)
