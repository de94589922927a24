"""Outputs (and in-out tensors) that share memory: every opt level and backend leaves the memory
as the recorded graph does (level 0, the copies in emission order). The passes move writes — a
redirected copy writes when its producer runs, a fused kernel stores its results in its own
order — so phase 1 compiles such a call as recorded, under a cache entry of its own; a call
with disjoint outputs keeps its optimised program. So is a call that writes over an input's
memory, but for an in-place (element-wise) op_api's output that is the very view of its input."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import backends
import opgraph
from opgraph import aclnn, ops
from opgraph.aclnn.direct import NUMPY, NUMPY_CALLS
from opgraph.core.dtypes import DataType
from opgraph.core.opapi import InputConfig, OpApiSpec, get_op_api
from family import shipped_op_apis
from opgraph.core.platform import get_platform

BACKENDS = [b for b in ("numpy", "native") if b in backends.available()]
SOCS = ("Ascend910B", "Ascend950")


def _written(spec: OpApiSpec) -> list[str]:
    return [p.name for p in spec.params if p.kind == "tensor" and p.role in ("output", "inout")]


def _reads(spec: OpApiSpec) -> list[str]:
    return [p.name for p in spec.params if p.kind == "tensor" and p.role == "input"]


def _pairings(pairs, fits, sep: str):
    """(op_api, soc, dtype, a, b) for every pair ``pairs(spec)`` of tensor parameters whose
    arrays share a dtype and ``fits(x, y)``, on every SoC and dtype the op_api takes."""
    for spec in shipped_op_apis():
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
def test_an_output_over_an_input_leaves_what_level_0_leaves(name, soc, dtype, a, b):
    """Written tensor ``a`` over read-only ``b``'s memory (``b``'s values, ``a``'s shape): every
    level and backend leaves every written tensor as level 0 does. An in-place op_api's output
    that is the very view of its input keeps its optimised program; anything else is compiled
    as recorded (a reduction's later reads of ``b`` see what the recorded order wrote)."""
    spec = get_op_api(name)
    results = set()
    for level, backend in itertools.product((0, 1, 2), BACKENDS):
        arrays = _arrays(spec, dtype)
        buf = arrays[b].copy()
        tensors = {a: opgraph.tensor(buf.reshape(arrays[a].shape)), b: opgraph.tensor(buf)}
        ex = _call(spec, soc, level, backend, dtype, arrays, tensors)
        very_view = spec.in_place and arrays[a].shape == buf.shape
        assert ex.program.opt_level == (level if very_view else 0)
        results.add((buf.tobytes(), *(arrays[w].tobytes() for w in _written(spec)
                                       if w != a and isinstance(arrays.get(w), np.ndarray))))
    assert len(results) == 1


@pytest.mark.parametrize("name, a, b", [("aclnnBatchNormElemt", "output", "input"),
                                        ("aclnnBatchNormElemtBackward", "gradInput", "gradOut")])
@pytest.mark.parametrize("shift", [1, -1])
def test_an_output_one_element_off_its_input_leaves_what_level_0_leaves(name, a, b, shift):
    """An element-wise output over its input shifted by one element, above the size the numpy
    backend runs in chunks (2^19 elements) and native runs on threads: compiled as recorded, so
    no chunk reads an input element an earlier chunk has overwritten."""
    spec = get_op_api(name)
    shape = (4, 8, 128, 130)
    n = int(np.prod(shape))
    cfg = InputConfig(shape, DataType.FLOAT, {o.name: o.default for o in spec.options})
    results = set()
    for level, backend in itertools.product((0, 1, 2), BACKENDS):
        arrays = spec.make_inputs(cfg, np.random.default_rng(5))
        buf = np.concatenate([arrays[b].reshape(-1), np.float32([7])])
        x, out = (buf[:n], buf[1:]) if shift == 1 else (buf[1:], buf[:n])
        x[...] = arrays[b].reshape(-1)
        tensors = {a: opgraph.tensor(out.reshape(shape)), b: opgraph.tensor(x.reshape(shape))}
        ex = _call(spec, "Ascend910B", level, backend, DataType.FLOAT, arrays, tensors)
        assert ex.program.opt_level == 0
        results.add(buf.tobytes())
    assert len(results) == 1


def test_a_direct_call_whose_in_out_argument_is_over_an_input_takes_the_usual_path():
    """The Pythonic API's direct call of BatchNormGatherStatsWithCounts (learnt on arguments
    apart) does not run its optimised program when the running mean lies over the gathered
    means, as phase 1 would compile that call as recorded: the learnt entry declines it, and
    the call through the API leaves what level 0 leaves."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 3, 5)).astype(np.float32)
    mean, invstd = rng.normal(size=(2, 3)).astype(np.float32), rng.uniform(1, 2, (2, 3)).astype(np.float32)
    counts = np.float32([20, 20])

    def args(over: bool) -> tuple:
        means = mean.copy()
        running_mean = means[0] if over else np.zeros(3, np.float32)
        return (x, means, invstd, running_mean, np.ones(3, np.float32), 0.1, 1e-5, counts)

    def call(a: tuple) -> list[bytes]:
        got = ops.batch_norm_gather_stats_with_counts(*a)
        return [np.asarray(g).tobytes() for g in (*got, a[1], a[3], a[4])]

    name = "aclnnBatchNormGatherStatsWithCounts"
    with opgraph.opt_level(2):
        for _ in range(2):  # learnt, then direct
            call(args(False))
        entry = NUMPY_CALLS.entries.get(NUMPY_CALLS.key(name, args(True)))
        assert entry is not None and entry.exe is not None
        assert entry.run(args(False), NUMPY) is not None
        assert entry.run(args(True), NUMPY) is None
        over = call(args(True))
    with opgraph.opt_level(0):
        assert over == call(args(True))


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


def test_rebinding_onto_an_inputs_memory_is_refused_for_an_optimised_program():
    """aclSetOutputTensorAddr / aclSetInputTensorAddr cannot make a level-2 program write over
    an input's memory (161002 naming both, the binding kept), but for an in-place op_api's
    output rebound onto the very view of its input."""
    spec = get_op_api("aclnnBatchNormReduceBackward")
    arrays = _arrays(spec, DataType.FLOAT)
    ex = _phase1(spec, "Ascend910B", 2, DataType.FLOAT, arrays, {})
    outputs = [v.name for v in ex.graph.inputs if v.name in _written(spec)]
    inputs = [v.name for v in ex.graph.inputs if v.name not in _written(spec)]
    mean = ex.bindings["mean"]
    kept = ex.bindings["sumDy"]
    assert aclnn.aclSetOutputTensorAddr(ex, outputs.index("sumDy"), opgraph.tensor(mean.storage)) == 161002
    message = aclnn.aclGetRecentErrMsg()
    assert "%sumDy" in message and "%mean" in message, message
    assert ex.bindings["sumDy"] is kept
    sum_dy = ex.bindings["sumDy"]
    assert aclnn.aclSetInputTensorAddr(ex, inputs.index("mean"), opgraph.tensor(sum_dy.storage)) == 161002
    assert ex.bindings["mean"] is mean

    spec = get_op_api("aclnnBatchNormElemt")
    arrays = _arrays(spec, DataType.FLOAT)
    ex = _phase1(spec, "Ascend910B", 2, DataType.FLOAT, arrays, {})
    x = ex.bindings["input"]
    assert aclnn.aclSetOutputTensorAddr(ex, 0, x) == 0, aclnn.aclGetRecentErrMsg()
    assert ex.bindings["output"] is x
