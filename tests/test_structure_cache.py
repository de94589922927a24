"""The structure cache: a new shape of a known call structure skips recording and the passes,
and gives exactly what recording would — graphs, workspace size, output bits — for every
op_api, platform and level; anything it cannot stand for is recorded as before."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import opgraph
from opgraph.aclnn import twophase
from opgraph.aclnn.cache import EXECUTOR_CACHE
from opgraph.aclnn.structure import STRUCTURE_CACHE, UNTEMPLATED, Template, structure_key
from opgraph.aclnn.twophase import op_api
from opgraph.core.opapi import InputConfig, Param, op_api_specs
from opgraph.core.platform import lookup
from opgraph.core.serialize import graph_to_dict
from opgraph.core.status import Status
from opgraph.core.memory import plan_memory
from opgraph.core.tensor import tensor
import l0ops
import backends
from backends import native
from family import shipped_op_apis

def _other_sizes(shape: tuple[int, ...]):
    """Shapes with the same 0/1/equality pattern: each size class changed in turn, then all."""
    classes = sorted({n for n in shape if n > 1})
    for m in range(5, 40):
        for c in classes:
            yield tuple(m if n == c else n for n in shape)
        yield tuple(n if n <= 1 else m + 2 * classes.index(n) + 40 for n in shape)


def _args(spec, shape, dtype, seed=0):
    cfg = InputConfig(tuple(shape), dtype, {o.name: o.default for o in spec.options})
    arrays = spec.make_inputs(cfg, np.random.default_rng(seed))
    return arrays, spec.args_of(arrays, tensor, cfg)


def _same_structure(spec, shape, dtype):
    """Other sizes whose arguments (as make_inputs builds them) have ``shape``'s structure."""
    key = lambda s: structure_key(spec.name, tuple(_args(spec, s, dtype)[1]), "p", 0)[0]
    want = key(shape)
    assert want is not None
    return next(s for s in _other_sizes(shape) if s != shape and key(s) == want)


def _call(spec, shape, dtype, seed=0):
    arrays, args = _args(spec, shape, dtype, seed)
    status, ws, ex = spec.get_workspace_size(*args)
    assert status == Status.ACLNN_SUCCESS, twophase.aclGetRecentErrMsg()
    key, _ = structure_key(spec.name, tuple(args), opgraph.get_platform(), opgraph.get_opt_level())
    assert spec.run(bytearray(ws) if ws else None, ws, ex) == Status.ACLNN_SUCCESS
    written = {p.name for p in spec.tensor_params("output", "inout")}
    outs = {k: np.asarray(v).copy() for k, v in arrays.items() if k in written and v is not None}
    return ex, ws, outs, key


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fV" else a


@pytest.fixture(autouse=True)
def _fresh_caches():
    EXECUTOR_CACHE.clear()
    STRUCTURE_CACHE.clear()
    yield
    EXECUTOR_CACHE.clear()
    STRUCTURE_CACHE.clear()


CASES = [(spec.name, soc, level) for spec in shipped_op_apis() for soc in spec.platforms
         if soc in ("Ascend910B", "Ascend950") for level in (0, 1, 2)]


@pytest.mark.parametrize("name, soc, level", CASES)
def test_a_new_shape_gives_what_recording_gives(name, soc, level):
    spec = op_api_specs()[name]
    dtype = spec.dtypes(lookup(soc))[-1]
    first = tuple(spec.default_shape)
    second = _same_structure(spec, first, dtype)
    with opgraph.platform(soc), opgraph.opt_level(level):
        _call(spec, first, dtype)  # records, then templates the structure
        hits = STRUCTURE_CACHE.hits
        ex, ws, outs, key = _call(spec, second, dtype, seed=1)
        assert isinstance(STRUCTURE_CACHE.get(key), Template), "the structure was not templated"
        assert STRUCTURE_CACHE.hits == hits + 2  # this call and the get() above
        assert ex.program._graph is None  # nothing recorded until someone asks
        templated = graph_to_dict(ex.graph), graph_to_dict(ex.compiled)
        EXECUTOR_CACHE.clear()
        STRUCTURE_CACHE.clear()
        ref, ref_ws, ref_outs, _ = _call(spec, second, dtype, seed=1)  # recorded from scratch
    assert templated == (graph_to_dict(ref.graph), graph_to_dict(ref.compiled))
    assert ws == ref_ws
    assert outs.keys() == ref_outs.keys() and outs
    for k in outs:
        assert np.array_equal(_bits(outs[k]), _bits(ref_outs[k])), k


def _third_size(spec, first, second, dtype):
    """A third size of the structure: ``second`` with another batch size (the sizes a kernel
    pins, such as the channels, kept) when the structure allows one, else any other."""
    key = lambda s: structure_key(spec.name, tuple(_args(spec, s, dtype)[1]), "p", 0)[0]
    batches = ((n, *second[1:]) for n in range(second[0] + 1, second[0] + 40))
    return next(s for s in itertools.chain(batches, _other_sizes(second))
                if s not in (first, second) and key(s) == key(first))


# level 2 on both backends; level 0 (intermediates in the workspace: slots at every size) on numpy
THIRD_SIZE_CASES = ([(n, soc, 2, b) for n, soc, level in CASES if level == 2 for b in ("numpy", "native")]
                    + [(n, soc, 0, "numpy") for n, soc, level in CASES if level == 0 and soc == "Ascend910B"])


@pytest.mark.parametrize("name, soc, level, backend", THIRD_SIZE_CASES)
def test_a_third_size_derives_its_executable_and_gives_what_recording_gives(name, soc, level, backend,
                                                                            monkeypatch):
    """The second size's executable joins its structure's family; the third size's is derived
    from it (Executable.resized: no compile) and runs to the bits of a call recorded afresh."""
    be = backends.get(backend) if backend == "numpy" or native.available() else None
    if be is None:
        pytest.skip(native.availability()[1])
    spec = op_api_specs()[name]
    dtype = spec.dtypes(lookup(soc))[-1]
    first = tuple(spec.default_shape)
    second = _same_structure(spec, first, dtype)
    third = _third_size(spec, first, second, dtype)
    compiled = []
    compile_graph = type(be).compile
    monkeypatch.setattr(type(be), "compile", lambda self, *a: compiled.append(a[0]) or compile_graph(self, *a))
    with opgraph.platform(soc), opgraph.opt_level(level), opgraph.use_backend(backend):
        _call(spec, first, dtype)
        ex2 = _call(spec, second, dtype, seed=1)[0]
        ex, ws, outs, _ = _call(spec, third, dtype, seed=2)
        assert compiled[-1] is ex2.program.compiled  # the third size compiled nothing
        derived = ex.program.built_executable(be)
        assert derived is not ex2.program.built_executable(be)
        assert derived.graph is ex.program.compiled and derived.plan is ex.program.memory_plan
        seed = ex2.program.built_executable(be)
        if getattr(seed, "launches", None):  # native's direct launches: the same kernels, resized
            assert [ln.fn for ln, _ in derived.launches] == [ln.fn for ln, _ in seed.launches]
            assert all(ln is not s for (ln, _), (s, _) in zip(derived.launches, seed.launches))
        EXECUTOR_CACHE.clear()
        STRUCTURE_CACHE.clear()
        ref, ref_ws, ref_outs, _ = _call(spec, third, dtype, seed=2)  # recorded from scratch
    assert ws == ref_ws and outs.keys() == ref_outs.keys() and outs
    for k in outs:
        assert np.array_equal(_bits(outs[k]), _bits(ref_outs[k])), k


def test_a_bad_call_of_a_known_structure_is_still_checked():
    """A wrong-length per-channel tensor changes the equality pattern: recorded, and refused."""
    spec = op_api_specs()["aclnnBatchNormElemtBackward"]
    _call(spec, (2, 3, 4), opgraph.DataType.FLOAT)
    cfg = InputConfig((4, 6, 5), opgraph.DataType.FLOAT, {o.name: o.default for o in spec.options})
    arrays = spec.make_inputs(cfg, np.random.default_rng(0))
    arrays["mean"] = np.zeros(7, np.float32)
    before = arrays["gradInput"].copy()
    status, _, ex = spec.get_workspace_size(*spec.args_of(arrays, tensor, cfg))
    assert status == Status.ACLNN_ERR_PARAM_INVALID and ex is None
    assert "mean" in twophase.aclGetRecentErrMsg()
    assert np.array_equal(arrays["gradInput"], before)


def test_non_contiguous_calls_do_not_take_part():
    x = tensor(np.zeros((4, 6), np.float32)[:, ::2])
    assert structure_key("op", (x,), "p", 2) == (None, ())
    y = tensor(np.zeros((4, 3), np.float32))
    assert structure_key("op", (y,), "p", 2)[1] == (4, 3)


def test_zero_one_and_equal_dims_are_part_of_the_structure():
    k = lambda *shapes: structure_key("op", tuple(tensor(np.zeros(s, np.float32)) for s in shapes), "p", 2)[0]
    assert k((2, 3), (3,)) == k((5, 7), (7,))
    assert k((2, 3), (3,)) != k((2, 3), (2,))      # which dims are equal
    assert k((2, 3), (3,)) != k((3, 3), (3,))
    assert k((2, 3), (3,)) != k((1, 3), (3,))      # 1 is its own case
    assert k((2, 3), (3,)) != k((0, 3), (3,))      # and so is 0


@op_api("aclnnTestSizeInValue", params=(Param("x", "tensor", "input"), Param("out", "tensor", "output")))
def _size_in_value(ex, x, out):
    """A graph holding a value computed from a size (x.shape[0] as a fill value)."""
    filled = l0ops.Fill(ex, shape=list(x.shape), value=float(x.shape[0]), dtype=x.dtype)
    ex.output(l0ops.ViewCopy(ex, l0ops.Add(ex, ex.input("x", x), filled), ex.input("out", out)))


def test_a_size_hidden_in_a_value_leaves_the_structure_untemplated():
    def run(n):
        x, out = np.ones((n, 3), np.float32), np.zeros((n, 3), np.float32)
        status, ws, ex = _size_in_value(tensor(x), tensor(out))
        assert status == 0 and twophase.run_executor(bytearray(ws) if ws else None, ws, ex) == 0
        return out
    run(2)
    key, _ = structure_key("aclnnTestSizeInValue", (tensor(np.ones((5, 3), np.float32)),
                                                    tensor(np.ones((5, 3), np.float32))), opgraph.get_platform(), 2)
    assert STRUCTURE_CACHE.get(key) is UNTEMPLATED
    assert (run(5) == 6.0).all()  # recorded at its own size: 1 + 5


def test_a_read_only_output_of_a_known_structure_is_refused_and_left_alone():
    """Writability is not part of the structure key: a hit checks it, and a read-only output
    is recorded, refused with its name, and not written."""
    spec = op_api_specs()["aclnnBatchNormElemtBackward"]
    _call(spec, (2, 3, 4), opgraph.DataType.FLOAT)
    cfg = InputConfig((5, 3, 4), opgraph.DataType.FLOAT, {o.name: o.default for o in spec.options})
    arrays = spec.make_inputs(cfg, np.random.default_rng(0))
    arrays["gradInput"][...] = 7
    arrays["gradInput"].flags.writeable = False
    hits = STRUCTURE_CACHE.hits
    status, _, ex = spec.get_workspace_size(*spec.args_of(arrays, tensor, cfg))
    assert STRUCTURE_CACHE.hits == hits + 1  # the structure was known
    assert status == Status.ACLNN_ERR_PARAM_INVALID and ex is None
    assert "gradInput" in twophase.aclGetRecentErrMsg()
    assert (arrays["gradInput"] == 7).all()


def test_an_executable_with_state_of_its_own_is_not_derived():
    """A subclass of the numpy executable (ascend-sim's keeps traces) compiles afresh unless it
    says how to resize itself; numpy's and native's do."""
    ex = opgraph.Executor("demo")
    x = ex.input("x", tensor(np.ones((2, 3), np.float32)))
    ex.output(l0ops.Cast(ex, x, to="float16"))
    plan = plan_memory(ex.graph)
    for name, derived in (("ascend-sim", False), ("numpy", True)):
        exe = backends.get(name).compile(ex.graph, plan, opgraph.get_platform())
        assert (exe.resized(ex.graph, plan) is not None) == derived, name


def test_a_momentum_of_one_over_a_dim_is_the_callers_value_at_every_size():
    """torch's cumulative average passes momentum = 1/step: at step 11, with 11 ranks, the
    value 1/11 is also 1/N. A later call of the structure with 5 ranks keeps momentum 1/11
    (running mean = 0·(1 − m) + batch mean·m, the batch mean 1: m itself), as recording gives."""
    m = 1 / 11

    def running_mean(n):
        rm = np.zeros(3, np.float32)
        opgraph.ops.sync_batch_norm_gather_stats(
            np.ones((n, 3), np.float32), np.full((n, 3), 2, np.float32), np.ones(n, np.int32),
            rm, np.zeros(3, np.float32), m, 1e-5)
        return rm

    want = np.full(3, m, np.float32).view(np.uint32)
    assert np.array_equal(running_mean(11).view(np.uint32), want)
    hits = STRUCTURE_CACHE.hits
    assert np.array_equal(running_mean(5).view(np.uint32), want)
    assert STRUCTURE_CACHE.hits == hits + 1  # from the structure's template
