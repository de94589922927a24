"""Hostile-user regressions: outputs are written or refused (never silently lost), tensor
metadata cannot be corrupted, malformed JSON is a GraphError, bad Python-level arguments get a
status or AclnnError, and IEEE special values do not leak numpy warnings."""
from __future__ import annotations

import json
import time
import warnings

import numpy as np
import pytest

import opgraph
from opgraph import AclnnError, GraphError, Status, aclnn
from opgraph.core.platform import Platform
from backends import native

F32 = np.float32
C = 3


def args(out: np.ndarray) -> list:
    """aclnnBatchNormElemtBackward arguments over 2x3x4 data, gradInput = ``out``."""
    x = np.arange(24, dtype=F32).reshape(2, C, 4)
    ch = [np.full(C, v, F32) for v in (0.5, 1.0, 1.0, 0.25, 1.0)]
    return [opgraph.tensor(x), opgraph.tensor(x), *map(opgraph.tensor, ch),
            opgraph.tensor(np.full(C, 4, F32)), opgraph.tensor(out)]


UNWRAPPABLE = {  # the caller's array the result must reach, which tensor() can only copy
    "negative stride": lambda: np.zeros(24, F32)[::-1].reshape(2, C, 4),
    # a field of a packed record: stride 6 bytes is not a whole number of float32 elements
    "structured field": lambda: np.zeros(24, dtype=[("a", F32), ("b", np.float16)])["a"]
    .reshape(2, C, 4),
}


@pytest.mark.parametrize("label", sorted(UNWRAPPABLE))
def test_output_that_would_be_copied_is_refused_and_untouched(label):
    out = UNWRAPPABLE[label]()
    out[...] = 7.0
    status, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*args(out))
    assert status == Status.ACLNN_ERR_PARAM_INVALID and ex is None
    msg = aclnn.aclGetRecentErrMsg()
    assert msg.startswith("ACLNN_ERR_PARAM_INVALID (161002): gradInput:") and "copy" in msg
    assert np.all(out == 7.0)


@pytest.mark.parametrize("value", [[1.0, 2.0], np.float32(1.0), np.zeros(2, np.float64)])
def test_tensors_that_hold_a_copy_say_so(value):
    assert opgraph.tensor(value, dtype="float32").copied


def test_pythonic_out_that_would_be_copied_raises_and_is_untouched():
    buf = np.full(24, 7.0, F32)
    out = buf[::-1].reshape(2, C, 4)
    x = np.ones((2, C, 4), F32)
    c = np.ones(C, F32)
    with pytest.raises(AclnnError) as e:
        opgraph.ops.batch_norm_elemt_backward(x, x, c, c, c, c, c, c, out=out)
    assert e.value.status == Status.ACLNN_ERR_PARAM_INVALID and "gradInput" in str(e.value)
    assert np.all(buf == 7.0)


def test_aligned_reinterpreted_output_is_written_in_place():
    """Control: a view tensor() can wrap (here a float32 view of a byte buffer) gets the result."""
    raw = np.zeros(24 * 4, np.uint8)
    out = raw.view(F32).reshape(2, C, 4)
    status, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*args(out))
    assert status == 0
    assert aclnn.aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex) == 0
    assert np.any(raw != 0)


def test_set_output_addr_refuses_a_copied_tensor():
    out = np.zeros((2, C, 4), F32)
    status, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*args(out))
    assert status == 0 and aclnn.aclSetAclOpExecutorRepeatable(ex) == 0
    copied = opgraph.tensor(np.zeros(24, F32)[::-1].reshape(2, C, 4))
    assert copied.copied
    assert aclnn.aclSetOutputTensorAddr(ex, 0, copied) == Status.ACLNN_ERR_PARAM_INVALID
    assert "copy" in aclnn.aclGetRecentErrMsg()
    assert aclnn.aclSetOutputTensorAddr(ex, 0, "not a tensor") == Status.ACLNN_ERR_PARAM_INVALID


# --- tensor metadata ---------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("shape", (2, 3)), ("strides", (1 << 40, 4, 1)),
                                         ("offset", 5), ("storage", np.zeros(1, F32)),
                                         ("format", opgraph.Format.NCHW)])
def test_tensor_metadata_is_immutable(field, value):
    t = opgraph.tensor(np.zeros((2, C, 4), F32))
    before = (t.shape, t.strides, t.offset, t.format)
    with pytest.raises(AttributeError, match="immutable"):
        setattr(t, field, value)
    assert (t.shape, t.strides, t.offset, t.format) == before


def test_reassigning_strides_between_phases_cannot_crash():
    """Used to segfault: strides changed after phase 1 reached far outside the storage."""
    out = np.zeros((2, C, 4), F32)
    a = args(out)
    status, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*a)
    with pytest.raises(AttributeError):
        a[0].strides = (1 << 40, 4, 1)
    assert aclnn.aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex) == 0


@pytest.mark.parametrize("kwargs,what", [
    (dict(shape=(2.5, 3), strides=(3, 1)), "shape"),
    (dict(shape=(2, 3), strides=(3.0, 1)), "strides"),
    (dict(shape=(2, 3), strides=(3, 1), offset=0.5), "offset"),
    (dict(shape=(True, 3), strides=(3, 1)), "shape"),
    (dict(shape=(2, 3), strides=(3, 1), format=3.5), "format"),
    (dict(shape=(2, 3), strides=(3, 1), format=True), "format"),
])
def test_tensor_refuses_non_integral_metadata(kwargs, what):
    with pytest.raises(ValueError, match=what):
        opgraph.Tensor(np.zeros(6, F32), **kwargs)


def test_zero_d_array_is_a_rank_0_tensor_sharing_memory():
    a = np.array(2.5, F32)
    t = opgraph.tensor(a)
    assert t.shape == () and t.strides == () and t.ndim == 0 and t.numel == 1 and not t.copied
    t.view()[...] = 4.0
    assert a == 4.0


# --- JSON --------------------------------------------------------------------------------------
def _doc(**over) -> str:
    d = {"schema": "opgraph.graph", "version": 1, "name": "g",
         "inputs": [{"name": "x", "shape": [2], "dtype": "FLOAT"}], "nodes": [], "outputs": ["x"]}
    d.update(over)
    return json.dumps(d)


def _fused_doc(first: dict) -> str:
    """A FusedElementwise over %x (f32[2]) whose body starts with ``first``, sums it to a
    scalar and adds that to x (a shape the sum hides still type-checks)."""
    body = [first, {"op": "sum", "args": ["t0"], "dtype": "FLOAT"},
            {"op": "add", "args": ["in0", "t1"], "dtype": "FLOAT"}]
    return _doc(nodes=[{"op": "FusedElementwise", "inputs": ["x"], "attrs": {
        "shape": [2], "body": body, "result": "t2", "out_dtype": "FLOAT"},
        "outputs": [{"name": "0", "shape": [2], "dtype": "FLOAT"}]}], outputs=["0"])


MALFORMED = {
    "deep array": "[" * 100_000 + "]" * 100_000,
    "deep object": '{"a":' * 100_000 + "1" + "}" * 100_000,
    "million-digit number": _doc()[:-1] + ', "x": ' + "1" * 1_000_000 + "}",
    "deep attrs": _doc(nodes=[{"op": "Cast", "inputs": ["x"], "attrs": {"to": []},
                               "outputs": [{"name": "0", "shape": [2], "dtype": "FLOAT"}]}]
                       ).replace('"to": []', '"to": ' + "[" * 5000 + "]" * 5000),
    "huge dim": _doc(inputs=[{"name": "x", "shape": [10 ** 30], "dtype": "FLOAT"}]),
    "negative dim": _doc(inputs=[{"name": "x", "shape": [-1], "dtype": "FLOAT"}]),
    "rank 65": _doc(inputs=[{"name": "x", "shape": [1] * 65, "dtype": "FLOAT"}]),
    "not utf-8": b"\xff\xfe\x00",
    "not a string": 12,
    # names no output can carry: a lone surrogate (no encoding), a NUL (breaks DOT), an ESC
    "surrogate name": _doc(inputs=[{"name": "x\ud800", "shape": [2], "dtype": "FLOAT"}],
                           outputs=["x\ud800"]),
    "NUL name": _doc(inputs=[{"name": "a\u0000b", "shape": [2], "dtype": "FLOAT"}], outputs=["a\u0000b"]),
    "ESC in an attribute": _doc(nodes=[{"op": "AllReduce", "inputs": ["x"], "attrs": {
        "group": "g\u001b[2J", "seq": 0}, "outputs": [{"name": "0", "shape": [2], "dtype": "FLOAT"}]}]),
    "empty graph name": _doc(name=""),
    "strides of another rank": _doc(inputs=[{"name": "x", "shape": [2, 3], "strides": [1],
                                             "dtype": "FLOAT"}]),
    "an input twice": _doc(inputs=[{"name": "x", "shape": [2], "dtype": "FLOAT"}] * 2),
    "an int attribute past int64": _doc(nodes=[{"op": "AllReduce", "inputs": ["x"], "attrs": {
        "group": "g", "seq": 2 ** 63}, "outputs": [{"name": "0", "shape": [2], "dtype": "FLOAT"}]}]),
    **{f"a fused body's {what}": _fused_doc(instr) for what, instr in [
        ("negative fill shape", {"op": "fill", "dtype": "FLOAT", "shape": [-1], "value": 1.0}),
        ("huge fill shape", {"op": "fill", "dtype": "FLOAT", "shape": [10 ** 30], "value": 1.0}),
        ("view of negative dims", {"op": "view", "args": ["in0"], "dtype": "FLOAT", "shape": [-1, -2]})]},
}


@pytest.mark.parametrize("label", sorted(MALFORMED))
def test_malformed_json_is_a_graph_error_quickly(label):
    t0 = time.perf_counter()
    with pytest.raises(GraphError):
        opgraph.Graph.from_json(MALFORMED[label])
    assert time.perf_counter() - t0 < 5.0  # "quickly": a bound far above the ~ms it takes


def test_numbers_as_input_names_do_not_collide_with_made_up_names():
    """A pass names new values by counting; an input called %42 (or %0) must not be
    taken again."""
    doc = json.loads(_doc(inputs=[{"name": "0", "shape": [2], "dtype": "FLOAT"},
                                  {"name": "42", "shape": [2], "dtype": "FLOAT"}], outputs=["42"]))
    g = opgraph.Graph.from_json(json.dumps(doc))
    new = g.add_node("Add", g.inputs)
    assert new.outputs[0].name not in ("0", "42") and g.verify() is g


# --- smaller items -------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["abc", object(), {"a": 1}])
def test_pythonic_api_non_array_argument_is_161002(bad):
    x = np.ones((2, C, 4), F32)
    c = np.ones(C, F32)
    with pytest.raises(AclnnError) as e:
        opgraph.ops.batch_norm_elemt_backward(x, bad, c, c, c, c, c, c)
    assert e.value.status == Status.ACLNN_ERR_PARAM_INVALID and str(e.value).count("input") >= 1


@pytest.mark.parametrize("size", ["64", 1.5, None, True, -1])
def test_phase2_bad_workspace_size_returns_a_status(size):
    out = np.zeros((2, C, 4), F32)
    status, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(*args(out))
    assert status == 0
    assert aclnn.aclnnBatchNormElemtBackward(None, size, ex) == Status.ACLNN_ERR_PARAM_INVALID
    assert "workspaceSize" in aclnn.aclGetRecentErrMsg()
    assert not out.any()


@pytest.mark.parametrize("level", [0, 1, 2])
def test_nan_inf_and_zero_counter_do_not_warn(level):
    x = np.array([[[np.nan, np.inf, -np.inf, 1.0]] * C] * 2, F32)
    c = np.zeros(C, F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opgraph.opt_level(level):
            y = opgraph.ops.batch_norm_elemt_backward(x, x, c, c, c, c, c, c)  # Σcounter = 0
    # 0/0 = NaN propagates everywhere: sumDy/Σcounter is NaN (IEEE), so every result is NaN
    assert np.isnan(y).all()


@pytest.mark.parametrize("dtype, eps", [(np.float32, 1e30), (np.float16, 1e5), (np.float16, 1e30)])
def test_native_preparing_on_extreme_eps_does_not_warn(dtype, eps):
    """The native backend prepares a kernel on its first run (its per-channel values and
    constants in numpy: here var = 1/invstd² − eps + eps = 0, so 1/sqrt(0), and an eps past
    fp16's range) outside phase 2's own ``np.errstate``: no warning leaks, in a plain run, a
    direct repeat or a captured replay, and the bits are numpy's."""
    if not native.available():
        pytest.skip(native.availability()[1])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, C, 5)).astype(dtype)
    params = [rng.uniform(0.5, 2, C).astype(dtype) for _ in range(4)]
    weight = params[0].astype(F32)  # a float32 weight: another prologue than an fp16 one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = [opgraph.ops.batch_norm_elemt(x, weight, *params[1:], eps)]
        with opgraph.use_backend("native"):
            got = [opgraph.ops.batch_norm_elemt(x, weight, *params[1:], eps) for _ in range(2)]
            tensors = [opgraph.tensor(a) for a in (x, weight, *params[1:])]
            out = np.zeros_like(x)
            with opgraph.capture() as step:
                status, ws, ex = aclnn.aclnnBatchNormElemtGetWorkspaceSize(*tensors, eps, opgraph.tensor(out))
                assert status == 0 and aclnn.aclnnBatchNormElemt(bytearray(ws) if ws else None, ws, ex) == 0
            for _ in range(3):
                step.replay()
    for y in got + [out]:
        assert np.array_equal(y.view(np.uint16 if dtype == np.float16 else np.uint32),
                              want[0].view(np.uint16 if dtype == np.float16 else np.uint32))


@pytest.mark.parametrize("flag", [np.array([True, False]), "yes", 1, None])
def test_pythonic_backward_reduce_mask_must_be_a_bool(flag):
    """The masks decide which outputs the Pythonic call makes: a non-bool is 161002 naming it,
    not numpy's error on an array's truth value."""
    x, c = np.ones((2, C, 4), F32), np.ones(C, F32)
    for position, name in enumerate(("input_g", "weight_g", "bias_g")):
        masks = [True, True, True]
        masks[position] = flag
        with pytest.raises(AclnnError) as e:
            opgraph.ops.batch_norm_backward_reduce(x, x, c, c, c, *masks)
        assert e.value.status == Status.ACLNN_ERR_PARAM_INVALID
        assert f"{name}: expected a bool, got {type(flag).__name__}" in str(e.value)


def test_a_hand_made_platform_is_checked_where_it_is_made():
    """Platform fields feed the tilings, which divide by the core count: a platform with no
    cores made SyncBatchNormGatherStats' phase 1 raise ZeroDivisionError on the 950."""
    for fields, error, word in (((0, 245760), ValueError, "vector_cores"),
                                ((64, 0), ValueError, "ub_size"),
                                ((2.5, 245760), TypeError, "vector_cores"),
                                ((True, 245760), TypeError, "vector_cores")):
        with pytest.raises(error, match=word):
            Platform("Ascend950", 3, 3510, *fields)
    one_core = Platform("Ascend950", 3, 3510, np.int64(1), 245760)
    assert type(one_core.vector_cores) is int
    rm, rv = np.zeros(2, F32), np.ones(2, F32)
    with opgraph.platform(one_core):  # totalSum 2 = Σx over counts 2: mean 1, running mean 0.5·1
        bm, _ = opgraph.ops.sync_batch_norm_gather_stats(
            np.full((1, 2), 2, F32), np.full((1, 2), 4, F32), np.int32([2]), rm, rv, 0.5, 1e-5)
    assert bm.tolist() == [1.0, 1.0] and rm.tolist() == [0.5, 0.5]
