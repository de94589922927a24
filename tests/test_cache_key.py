"""Phase 1's executor cache key: one interned signature id per tensor, which tensors are the
same, numbers by type and value (signed zeros apart), and the outputs' writability checked on a
hit rather than keyed."""
from __future__ import annotations

import sys

import numpy as np

import opgraph
import reference as R
from opgraph import aclnn
from opgraph.aclnn.cache import cache_key

SHAPE = (2, 3, 4)


def test_cached_phase1_rechecks_the_output_is_writable():
    """Writability is not in the executor cache's key: a hit checks it, and a read-only
    output gets phase 1's own error naming it."""
    case = R.make_case(SHAPE, R.F32, seed=5)
    out = np.zeros(SHAPE, np.float32)
    tensors, out_t = R.to_tensors(case), opgraph.tensor(out)
    R.run_op(tensors, out_t)
    out_t.storage.flags.writeable = False
    st, _, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*tensors, out_t)
    assert st == opgraph.Status.ACLNN_ERR_PARAM_INVALID and ex is None
    assert "gradInput: storage is read-only" in aclnn.aclGetRecentErrMsg()
    out_t.storage.flags.writeable = True
    assert R.run_op(tensors, out_t)[0] == 0


def test_key_tells_signed_zeros_and_number_types_apart():
    t = opgraph.tensor(np.zeros(3, np.float32))
    keys = {cache_key("op", (t, v), "p", 2) for v in (0.0, -0.0, 0, False)}
    assert len(keys) == 4
    assert cache_key("op", (t, t), "p", 2) != cache_key("op", (t, opgraph.tensor(np.zeros(3, np.float32))), "p", 2)
    assert cache_key("op", (t, object()), "p", 2) is None


def test_signature_ids_stay_distinct_when_the_table_starts_afresh(monkeypatch):
    tensor_module = sys.modules["opgraph.core.tensor"]
    for table in (tensor_module._SIGNATURE_IDS, tensor_module._CONTIGUOUS):
        monkeypatch.setattr(table, "limit", 3)
    tensors = [opgraph.tensor(np.zeros(n, np.float32)) for n in range(1, 9)]
    ids = [t.signature_id for t in tensors]
    assert len(set(ids)) == len(ids)
    again = opgraph.tensor(np.zeros(8, np.float32))
    assert again.signature_id == ids[-1]  # the newest entries are still in the table


def test_key_tells_signed_zeros_apart_for_numpy_floats_too():
    t = opgraph.tensor(np.zeros(3, np.float32))
    assert cache_key("op", (t, np.float64(0.0)), "p", 2) != cache_key("op", (t, np.float64(-0.0)), "p", 2)
