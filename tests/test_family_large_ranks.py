"""Every op_api of the family at ranks 2 and 3 (BatchNorm1d's [N,C] and [N,C,L]) past the
numpy interpreter's whole-chunk size (2^19 elements), on every backend at level 2: phase 1 and
phase 2 succeed and each output is within a float32 rounding bound of the op_api's own float64
reference (an independent formula). A body that cannot be cut into chunks used to fail here
with a reshape error (BatchNormElemt). And on native, no op_api leaves a fused kernel to numpy
at any rank, SoC family or dtype."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

import backends as B

from backends import native
from native_limits import reduce_limits_at
from opgraph.cli.cases import build_case, execute, record
from opgraph.core.dtypes import DataType
from opgraph.core.opapi import op_api_specs
from opgraph.core.status import Status

SHAPES = [(160000, 4), (8, 16, 5000)]  # 640000 elements
CASES = [(name, shape) for name, spec in sorted(op_api_specs().items()) if spec.make_inputs
         for shape in SHAPES if spec.rank[0] <= len(shape) <= spec.rank[1]]  # the ranks it takes
BACKENDS = ["numpy"] + (["native"] if native.available() else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, shape", CASES, ids=[f"{n}-rank{len(s)}" for n, s in CASES])
def test_ranks_2_and_3_past_the_whole_chunk_size(name, shape, backend):
    spec = op_api_specs()[name]
    args = argparse.Namespace(op=name, shape=shape, dtype=DataType.FLOAT, platform="Ascend910B",
                              level=2, backend=backend, seed=0)
    for o in spec.options:
        setattr(args, o.name, o.default)
    case = build_case(args)
    ref = spec.reference(case.arrays)  # before phase 2 (in-out tensors as given)
    rec = record(case)
    assert rec.status == Status.ACLNN_SUCCESS
    with np.errstate(all="ignore"):
        assert execute(case, rec) == Status.ACLNN_SUCCESS
    checked = 0
    for out_name, out in case.outputs.items():
        if out_name not in ref:
            continue
        want, got = np.asarray(ref[out_name], np.float64), out.astype(np.float64)
        assert got.shape == want.shape, out_name
        scale = max(float(np.max(np.abs(want[np.isfinite(want)]), initial=0)), 1.0)
        assert np.allclose(got, want, rtol=1e-4, atol=1e-4 * scale, equal_nan=True), out_name
        checked += 1
    assert checked, f"{name}: no output has a float64 reference"


SWEEP = [(name, shape) for name, spec in sorted(op_api_specs().items()) if spec.make_inputs
         for shape in [(4, 8), (4, 8, 30), (4, 8, 5, 6), (2, 8, 3, 4, 5)]
         if spec.rank[0] <= len(shape) <= spec.rank[1]]


@pytest.mark.skipif(not native.available(), reason=native.availability()[1])
@pytest.mark.parametrize("name, shape", SWEEP, ids=[f"{n}-rank{len(s)}" for n, s in SWEEP])
def test_no_op_api_falls_back_to_numpy_on_native(name, shape, monkeypatch):
    """Every op_api at level 2 on native, both SoC families, three dtypes, ranks 2-5, with its
    C paths forced at these small sizes: no fused kernel is left to numpy (the backend counts
    each fallback with its reason)."""
    monkeypatch.setattr(native.NativeBackend, "min_fused_elements", 0)
    reduce_limits_at(monkeypatch, 0)
    nat = B.get("native")
    spec = op_api_specs()[name]
    for platform in ("Ascend910B", "Ascend950"):
        for dtype in (DataType.FLOAT, DataType.FLOAT16, DataType.BF16):
            args = argparse.Namespace(op=name, shape=shape, dtype=dtype, platform=platform,
                                      level=2, backend="native", seed=0)
            for o in spec.options:
                setattr(args, o.name, o.default)
            case = build_case(args)
            rec = record(case)
            if rec.status != Status.ACLNN_SUCCESS:  # a dtype the SoC does not take
                continue
            nat.fallbacks.clear()
            with np.errstate(all="ignore"):
                assert execute(case, rec) == Status.ACLNN_SUCCESS
            assert not nat.fallbacks, (platform, dtype.short, dict(nat.fallbacks))
