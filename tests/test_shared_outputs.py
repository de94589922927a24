"""Outputs (and in-out tensors) that share memory: every opt level and backend leaves the memory
as the recorded graph does (level 0, the copies in emission order). The passes move writes — a
redirected copy writes when its producer runs, a fused kernel stores its results in its own
order — so phase 1 compiles such a call as recorded, under a cache entry of its own; a call
with disjoint outputs keeps its optimised program. An output over an input's memory (in place)
needs no such rule: every level agrees there at its own level."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import backends
import opgraph
from opgraph import aclnn
from opgraph.core.dtypes import DataType
from opgraph.core.opapi import InputConfig, OpApiSpec, get_op_api, op_apis
from opgraph.core.platform import get_platform

BACKENDS = [b for b in ("numpy", "native") if b in backends.available()]
SOCS = ("Ascend910B", "Ascend950")


def _family() -> list[OpApiSpec]:
    """The op_apis opgraph ships (other tests may register demo ones while collecting)."""
    specs = [get_op_api(name) for name in op_apis()]
    return [s for s in specs if s.make_inputs is not None
            and s.get_workspace_size.__module__.startswith("opgraph.aclnn.")]


def _written(spec: OpApiSpec) -> list[str]:
    return [p.name for p in spec.params if p.kind == "tensor" and p.role in ("output", "inout")]


def _reads(spec: OpApiSpec) -> list[str]:
    return [p.name for p in spec.params if p.kind == "tensor" and p.role == "input"]


def _pairings(pairs, fits, sep: str):
    """(op_api, soc, dtype, a, b) for every pair ``pairs(spec)`` of tensor parameters whose
    arrays share a dtype and ``fits(x, y)``, on every SoC and dtype the op_api takes."""
    for spec in _family():
        for soc, dtype in itertools.product(SOCS, (DataType.FLOAT, DataType.FLOAT16)):
            with opgraph.platform(soc):
                if not spec.supports(get_platform()) or dtype not in spec.dtypes(get_platform()):
                    continue
            arrays = _arrays(spec, dtype)
            for a, b in pairs(spec):
                x, y = arrays.get(a), arrays.get(b)
                if isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and \
                        x.dtype == y.dtype and fits(x, y):
                    yield pytest.param(spec.name, soc, dtype, a, b,
                                       id=f"{spec.name}-{soc}-{dtype.short}-{a}{sep}{b}")


def _cases():
    """Two written parameters of one shape, which will share memory."""
    return _pairings(lambda spec: itertools.combinations(_written(spec), 2),
                     lambda x, y: x.shape == y.shape, "=")


def _in_place_cases():
    """A written parameter and a read-only one with as many elements."""
    return _pairings(lambda spec: itertools.product(_written(spec), _reads(spec)),
                     lambda x, y: x.size == y.size, "@")


def _config(spec: OpApiSpec, dtype: DataType) -> InputConfig:
    return InputConfig(spec.default_shape, dtype, {o.name: o.default for o in spec.options})


def _arrays(spec: OpApiSpec, dtype: DataType) -> dict:
    return spec.make_inputs(_config(spec, dtype), np.random.default_rng(3))


def _phase1(spec: OpApiSpec, soc: str, level: int, dtype: DataType, arrays: dict,
            tensors: dict) -> opgraph.core.executor.Executor:
    """Phase 1 with ``tensors`` (by parameter name) in place of the arrays' own tensors."""
    args = [tensors.get(p.name, a) for p, a in zip(spec.params, spec.args_of(
        arrays, lambda x, fmt: opgraph.tensor(x, fmt), _config(spec, dtype)))]
    with opgraph.platform(soc), opgraph.opt_level(level):
        status, _, ex = spec.get_workspace_size(*args)
    assert status == 0, aclnn.aclGetRecentErrMsg()
    return ex


def _call(spec: OpApiSpec, soc: str, level: int, backend: str, dtype: DataType, arrays: dict,
          tensors: dict) -> opgraph.core.executor.Executor:
    """Both phases (see :func:`_phase1`)."""
    ex = _phase1(spec, soc, level, dtype, arrays, tensors)
    ws = ex.workspace_size
    with opgraph.use_backend(backend):
        assert spec.run(bytearray(ws) if ws else None, ws, ex) == 0, aclnn.aclGetRecentErrMsg()
    return ex


def _run_shared(spec, soc, level, backend, dtype, a, b, how):
    """The shared buffer's bytes after one call whose ``a`` and ``b`` share memory ``how``:
    one tensor at both positions, two tensors over one array, or two overlapping views."""
    arrays = _arrays(spec, dtype)  # fresh in-out values for every run
    first = arrays[a]
    if how == "one tensor":
        buf = first.copy()
        shared = opgraph.tensor(buf)
        tensors = {a: shared, b: shared}
    elif how == "two tensors":
        buf = first.copy()
        tensors = {a: opgraph.tensor(buf), b: opgraph.tensor(buf)}
    else:  # b starts one element after a, over one flat buffer
        n = first.size
        buf = np.concatenate([first.reshape(-1), first.reshape(-1)[-1:]])
        tensors = {a: opgraph.tensor(buf[:n].reshape(first.shape)),
                   b: opgraph.tensor(buf[1:].reshape(first.shape))}
    ex = _call(spec, soc, level, backend, dtype, arrays, tensors)
    return buf.tobytes(), ex


@pytest.mark.parametrize("name, soc, dtype, a, b", list(_cases()))
@pytest.mark.parametrize("how", ["one tensor", "two tensors", "overlapping views"])
def test_every_level_and_backend_leaves_shared_outputs_as_recorded(name, soc, dtype, a, b, how):
    spec = get_op_api(name)
    want, ex0 = _run_shared(spec, soc, 0, "numpy", dtype, a, b, how)
    assert ex0.program.opt_level == 0
    for level, backend in itertools.product((0, 1, 2), BACKENDS):
        got, ex = _run_shared(spec, soc, level, backend, dtype, a, b, how)
        assert got == want, f"level {level} on {backend}"
        assert ex.program.opt_level == 0  # compiled as recorded whatever the level


def test_cache_keeps_the_optimised_program_for_disjoint_outputs():
    """Same metadata, so the same exact key but for sharing: disjoint outputs compile at level
    2 and stay cached; outputs over one array get a program compiled as recorded; disjoint
    outputs afterwards find their level-2 program again."""
    spec = get_op_api("aclnnBatchNormReduceBackward")
    arrays = _arrays(spec, DataType.FLOAT)

    def outs(shared: bool) -> dict:
        one = np.zeros(3, np.float32)
        return {n: opgraph.tensor(one if shared else np.zeros(3, np.float32))
                for n in ("sumDyXmu", "gradBias")}

    levels = [_call(spec, "Ascend910B", 2, "numpy", DataType.FLOAT, arrays, outs(shared)).program.opt_level
              for shared in (False, True, False)]
    assert levels == [2, 0, 2]


def test_disjoint_outputs_are_not_taken_for_shared():
    """Neighbouring outputs in one buffer, and empty ones, share no memory."""
    spec = get_op_api("aclnnBatchNormStats")
    arrays = _arrays(spec, DataType.FLOAT)
    buf = np.zeros(6, np.float32)
    ex = _call(spec, "Ascend950", 2, "numpy", DataType.FLOAT, arrays,
               {"mean": opgraph.tensor(buf[:3]), "invstd": opgraph.tensor(buf[3:])})
    assert ex.program.opt_level == 2


@pytest.mark.parametrize("name, soc, dtype, a, b", list(_in_place_cases()))
def test_an_output_over_an_input_agrees_at_every_level(name, soc, dtype, a, b):
    """Written tensor ``a`` over read-only ``b``'s memory (``b``'s values, ``a``'s shape):
    the levels agree without compiling as recorded."""
    spec = get_op_api(name)
    results = set()
    for level, backend in itertools.product((0, 1, 2), BACKENDS):
        arrays = _arrays(spec, dtype)
        buf = arrays[b].copy()
        tensors = {a: opgraph.tensor(buf.reshape(arrays[a].shape)), b: opgraph.tensor(buf)}
        ex = _call(spec, soc, level, backend, dtype, arrays, tensors)
        assert ex.program.opt_level == level
        results.add(buf.tobytes())
    assert len(results) == 1


def test_rebinding_an_output_onto_another_is_refused_for_an_optimised_program():
    """aclSetOutputTensorAddr cannot make a level-2 program's outputs share memory (it was
    optimised for outputs apart): 161002 naming both, the binding kept; apart is fine, and a
    program compiled as recorded takes it."""
    spec = get_op_api("aclnnBatchNormReduceBackward")
    arrays = _arrays(spec, DataType.FLOAT)
    a, b = opgraph.tensor(np.zeros(3, np.float32)), opgraph.tensor(np.zeros(3, np.float32))
    ex = _phase1(spec, "Ascend910B", 2, DataType.FLOAT, arrays, {"sumDyXmu": a, "gradBias": b})
    index = [v.name for v in ex.graph.inputs if v.name in _written(spec)].index("gradBias")
    assert aclnn.aclSetOutputTensorAddr(ex, index, opgraph.tensor(a.storage)) == 161002
    message = aclnn.aclGetRecentErrMsg()
    assert "%gradBias" in message and "%sumDyXmu" in message
    assert ex.bindings["gradBias"] is b
    assert aclnn.aclSetOutputTensorAddr(ex, index, opgraph.tensor(np.ones(3, np.float32))) == 0
    shared = _phase1(spec, "Ascend910B", 2, DataType.FLOAT, arrays, {"sumDyXmu": a, "gradBias": b})
    assert aclnn.aclSetOutputTensorAddr(shared, index, opgraph.tensor(a.storage)) == 161002
    as_recorded = _phase1(spec, "Ascend910B", 2, DataType.FLOAT, arrays, {"sumDyXmu": a, "gradBias": a})
    assert as_recorded.program.opt_level == 0
    assert aclnn.aclSetOutputTensorAddr(as_recorded, index, opgraph.tensor(a.storage)) == 0
