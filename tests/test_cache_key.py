"""Phase 1's executor cache key: one interned signature id per tensor, which tensors are the
same, numbers by type and value (signed zeros apart), and the outputs' writability checked on a
hit rather than keyed; the cache itself an LRU map, whole under threads."""
from __future__ import annotations

import sys
from collections import OrderedDict

import numpy as np

import opgraph
import reference as R
from opgraph import aclnn
from opgraph.aclnn.cache import ExecutorCache, cache_key
from threads import hammer

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


def test_the_cache_is_lru_like_an_ordered_dict_model():
    """Random gets and puts (new keys, hits, re-puts of a key) on a small ExecutorCache give
    the same entries, order and hit counts as a model kept with OrderedDict."""
    rng = np.random.default_rng(11)
    cache: ExecutorCache[int] = ExecutorCache(capacity=5)
    model: OrderedDict = OrderedDict()
    hits = 0
    for step in range(3000):
        key = ("op", int(rng.integers(0, 9)))
        if rng.random() < 0.6:
            want = model.get(key)
            if want is not None:
                model.move_to_end(key)
                hits += 1
            assert cache.get(key) == want
        else:
            model[key] = step
            model.move_to_end(key)
            while len(model) > 5:
                model.popitem(last=False)
            cache.put(key, step)
        assert cache.values() == list(model.values()) and len(cache) == len(model)
        assert all((k in cache) == (k in model) for k in [("op", i) for i in range(9)])
    assert cache.hits == hits > 500
    cache.clear()
    assert cache.values() == [] and len(cache) == 0 and cache.get(("op", 1)) is None


def test_the_cache_stays_whole_under_threads():
    """Four threads getting and putting overlapping keys: never more than capacity entries,
    and the recency list holds exactly the entries the map does."""
    cache: ExecutorCache[tuple] = ExecutorCache(capacity=8)

    def churn(k: int) -> bool:
        for i in range(300):
            key = ("op", (i * 7 + k) % 13)
            if cache.get(key) is None:
                cache.put(key, key)
        return len(cache) <= 8

    got, errors = hammer(churn, [True] * 4, lambda a, b: a == b, rounds=5)
    assert not errors and len(got) == 4
    entries = cache.values()
    assert len(entries) == len(cache) <= 8 and all(key in cache for key in entries)
