"""Behaviours of the core layer (tensor metadata, memory planning, graph loading, foreign
arrays) that a mutation audit found unpinned (the cache and call layers' are in
test_mutants_core.py): each test fails on a small change of the code it names and passes on the
code as written."""
from __future__ import annotations

import json

import numpy as np
import pytest

import opgraph
from backends import get as get_backend
from opgraph import passes
from opgraph.aclnn.batch_norm_elemt import aclnnBatchNormElemtGetWorkspaceSize
from opgraph.aclnn.batch_norm_elemt_backward import aclnnBatchNormElemtBackwardGetWorkspaceSize
from opgraph.aclnn.batch_norm_stats import aclnnBatchNormStats, aclnnBatchNormStatsGetWorkspaceSize
from opgraph.core import serialize
from opgraph.core.dtypes import DataType
from opgraph.core.ir import Graph, GraphError, TensorType
from opgraph.core.tensor import Tensor

native = pytest.importorskip("backends.native")
BACKENDS = ["numpy", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason="no C compiler for the native backend"))]


# --- tensor metadata ------------------------------------------------------------------------------
def test_a_two_element_storage_must_be_contiguous_too():
    """Storage is a flat contiguous array whatever its length from 2 elements: every other
    element of an array (a stride of 2 items) is refused."""
    with pytest.raises(ValueError, match="contiguous"):
        Tensor(np.zeros(4, np.float32)[::2], (2,), (1,))
    assert Tensor(np.zeros(1, np.float32)[::2], (1,), (1,)).numpy().tolist() == [0.0]


def test_strides_and_offset_take_exactly_the_int64_range():
    """aclCreateTensor takes strides and offset as int64_t: 2**63 - 1 is taken (a size-1 dim's
    stride, an empty view's offset: neither reaches past the storage), 2**63 refused."""
    storage = np.zeros(1, np.float32)
    assert Tensor(storage, (1,), ((1 << 63) - 1,)).numel == 1
    assert Tensor(storage, (0,), (1,), offset=(1 << 63) - 1).numel == 0
    for kwargs in (dict(shape=(1,), strides=(1 << 63,)), dict(shape=(0,), strides=(1,), offset=1 << 63)):
        with pytest.raises(ValueError, match="int64_t"):
            Tensor(storage, **kwargs)


@pytest.mark.parametrize("stride", [1 << 61, (1 << 63) - 1])
def test_a_size_1_dim_or_an_empty_view_may_have_a_stride_of_more_bytes_than_numpy_takes(stride):
    """A stride is taken up to 2**63 - 1 elements; on a size-1 dim (or in an empty view) it steps
    nowhere, so such a tensor reads as any other though stride × item size exceeds numpy's
    int64 byte strides (its view raised OverflowError)."""
    storage = np.float32([5, 6, 7])
    assert Tensor(storage, (1, 3), (stride, 1)).numpy().tolist() == [[5, 6, 7]]
    assert Tensor(storage, (3, 1), (1, stride)).numpy().tolist() == [[5], [6], [7]]
    assert Tensor(storage, (0, 3), (stride, 1)).numpy().shape == (0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_op_api_runs_on_a_size_1_dim_with_a_huge_stride(backend):
    """BatchNormStats over one sample [1, 3] whose batch dim has a stride of 2**61 elements: the
    mean is the sample itself and invstd 1 / sqrt(0 + eps) (phase 2 failed with 361001)."""
    x = Tensor(np.float32([5, 6, 7]), (1, 3), (1 << 61, 1))
    mean, invstd = np.zeros(3, np.float32), np.zeros(3, np.float32)
    with opgraph.use_backend(backend):
        status, ws, ex = aclnnBatchNormStatsGetWorkspaceSize(x, 1e-4, opgraph.tensor(mean), opgraph.tensor(invstd))
        assert status == 0 and aclnnBatchNormStats(bytearray(ws) if ws else None, ws, ex) == 0
    assert mean.tolist() == [5, 6, 7]
    np.testing.assert_allclose(invstd, 1 / np.sqrt(1e-4), rtol=1e-6)


def test_an_array_viewing_the_callers_buffer_is_not_a_copy():
    """An array numpy makes over memory the caller holds (a float32 memoryview of a bytearray)
    is viewed, not copied: as an output it is taken and the results land in the buffer."""
    buf = bytearray(12)
    out = opgraph.tensor(memoryview(buf).cast("f"))
    assert not out.copied
    x = opgraph.tensor(np.float32([[1, 2, 3], [3, 6, 9]]))
    with opgraph.use_backend("numpy"):
        status, ws, ex = aclnnBatchNormStatsGetWorkspaceSize(x, 1e-5, out, opgraph.tensor(np.zeros(3, np.float32)))
        assert status == 0 and aclnnBatchNormStats(bytearray(ws) if ws else None, ws, ex) == 0
    assert np.frombuffer(buf, np.float32).tolist() == [2, 4, 6]


def test_an_element_wise_output_over_its_input_in_another_order_is_compiled_as_recorded():
    """BatchNormElemt keeps its optimised program for an output that is the very view of its
    input; the transpose of a square input (same first element, same shape, other strides) is
    other elements in the same memory: compiled as recorded (level 0)."""
    a = np.arange(9, dtype=np.float32).reshape(3, 3)
    w, b, m, s = (opgraph.tensor(np.ones(3, np.float32)) for _ in range(4))
    for out, level in ((a, 2), (a.T, 0)):
        with opgraph.opt_level(2):
            status, _, ex = aclnnBatchNormElemtGetWorkspaceSize(opgraph.tensor(a), w, b, m, s, 1e-5, opgraph.tensor(out))
        assert status == 0 and ex.program.opt_level == level


def test_an_output_over_its_input_in_another_dtype_is_compiled_as_recorded():
    """BatchNormElemtBackward's float32 gradInput starting where its float16 gradOut starts, of
    the same shape and element strides, is not the very view of it (other bytes, other values):
    compiled as recorded (level 0); over a gradOut of its own it keeps the level's program."""
    buf = np.zeros(8, np.float32)
    grad_in = opgraph.tensor(buf.reshape(2, 4))
    vectors = [opgraph.tensor(np.ones(4, np.float32)) for _ in range(5)]
    counter = opgraph.tensor(np.int32([2]))
    x = opgraph.tensor(np.ones((2, 4), np.float16))
    for grad_out, level in ((np.ones((2, 4), np.float16), 2), (buf.view(np.float16)[:8].reshape(2, 4), 0)):
        with opgraph.opt_level(2):
            status, _, ex = aclnnBatchNormElemtBackwardGetWorkspaceSize(
                opgraph.tensor(grad_out), x, *vectors, counter, grad_in)
        assert status == 0 and ex.program.opt_level == level


def test_a_strided_array_is_viewed_over_storage_ending_at_its_last_element():
    """A non-contiguous array's tensor stores the span from its first element to its last, both
    included (2 rows 4 apart, 2 columns 2 apart: 1 + 4 + 2 = 7 elements), and a tensor made
    afresh from that storage and metadata reads the same values."""
    a = np.arange(8, dtype=np.float32).reshape(2, 4)[:, ::2]
    t = opgraph.tensor(a)
    assert (t.strides, t.storage.size, t.storage_shape) == ((4, 2), 7, (7,))
    assert Tensor(t.storage, t.shape, t.strides, t.offset).numpy().tolist() == [[0, 2], [4, 6]]


@pytest.mark.parametrize("format, dtype", [("NCHW", None), ("ND", np.float32)])
def test_a_contiguous_array_off_the_fast_path_gets_row_major_strides_on_size_1_dims(format, dtype):
    """numpy may give a size-1 dim any stride (here -40 bytes) in a C-contiguous array; a tensor
    made off the fast path too (a format, a dtype asked) views it (no copy) with the row-major
    strides."""
    a = np.lib.stride_tricks.as_strided(np.arange(6, dtype=np.float32), (2, 1, 3, 1), (12, -40, 4, 4))
    assert a.flags.c_contiguous
    t = opgraph.tensor(a, format, dtype)
    assert t.strides == (3, 3, 1, 1) and t.numpy().ravel().tolist() == [0, 1, 2, 3, 4, 5]
    assert not t.copied and t.data_address == a.ctypes.data


def test_a_tensor_has_at_most_64_dims():
    """numpy's limit on dims is the tensor's: rank 64 is made, rank 65 refused naming it."""
    storage = np.zeros(1, np.float32)
    assert Tensor(storage, (1,) * 64, (1,) * 64).ndim == 64
    with pytest.raises(ValueError, match="rank 65 > 64"):
        Tensor(storage, (1,) * 65, (1,) * 65)


# --- memory planning: redirects -------------------------------------------------------------------
def _copy_chain(a_strides):
    """x*x copied into a (of ``a_strides``), then a copied into a contiguous b."""
    g = Graph("chain")
    x, b = (g.add_input(n, TensorType((4,), DataType.FLOAT)) for n in "xb")
    a = g.add_input("a", TensorType((4,), DataType.FLOAT, strides=a_strides))
    into_a = g.add_node("ViewCopy", [g.add_node("Mul", [x, x]).outputs[0], a]).outputs[0]
    g.add_node("ViewCopy", [into_a, b])
    return g


def test_only_a_kernels_own_output_into_a_contiguous_tensor_is_redirected():
    """A copy becomes a redirect (the producing kernel writes the tensor) only from a kernel's
    own output into a contiguous tensor: into a strided a, x*x stays a copy, and so does the
    copy of a (an in-place write's result, not a kernel output) into b; into a contiguous a,
    x*x is redirected. Either way a and b get x*x."""
    for strides, redirects in (((2,), [False, False]), (None, [True, False])):
        opt = passes.optimize(_copy_chain(strides), 2)
        assert [n.attrs.redirect for n in opt.nodes if n.op == "ViewCopy"] == redirects
        a, b = np.zeros(8, np.float32), np.zeros(4, np.float32)
        view = a[::2] if strides else a[:4]
        get_backend("numpy").run(opt, {"x": opgraph.tensor(np.float32([1, 2, 3, 4])),
                                       "a": opgraph.tensor(view), "b": opgraph.tensor(b)})
        assert view.tolist() == b.tolist() == [1, 4, 9, 16]


# --- loading graphs -----------------------------------------------------------------------------
def _doc(name="x", shape=(2,), call_value=None, graph_name="g") -> str:
    """A graph document: one input (returned as is) and, with ``call_value``, a recorded call
    whose one int argument holds it."""
    d = {"schema": "opgraph.graph", "version": 1, "name": graph_name,
         "inputs": [{"name": name, "shape": list(shape), "dtype": "FLOAT"}], "nodes": [], "outputs": [name]}
    if call_value is not None:
        d["call"] = {"api": "aclnnOp", "args": [{"name": "k", "kind": "int", "value": call_value}]}
    return json.dumps(d)


@pytest.mark.parametrize("doc, ok", [
    (_doc(call_value=-(1 << 63)), True), (_doc(call_value=(1 << 63) - 1), True),
    (_doc(call_value=-(1 << 63) - 1), False), (_doc(call_value=1 << 63), False),
    (_doc(shape=((1 << 63) - 1,)), True), (_doc(shape=(1 << 63,)), False),
    (_doc(name="a\x7fb"), False), (_doc(graph_name="g\x7f"), False), (_doc(name='a"b'), False),
    (_doc(name=""), False), (_doc(name="a\tb"), False)],
    ids=["int64 min", "int64 max", "below int64", "above int64", "dim 2**63-1", "dim 2**63",
         "DEL in a value name", "DEL in the graph name", "quote in a value name", "empty value name",
         "tab in a value name"])
def test_a_graph_document_is_loaded_exactly_within_its_rules(doc, ok):
    """Loading takes integers in int64 (a call argument, a dim in [0, 2**63)), and refuses with
    a GraphError a name holding DEL (a control character), a quote or whitespace, or none."""
    if ok:
        assert Graph.from_json(doc).name == "g"
    else:
        with pytest.raises(GraphError):
            Graph.from_json(doc)


@pytest.mark.parametrize("kind", ["float", "double"])
def test_a_non_finite_call_argument_of_either_float_kind_loads_as_a_float(kind):
    """A float or double call argument written as "inf" / "-inf" / "nan" loads as that float."""
    doc = json.loads(_doc())
    doc["call"] = {"api": "aclnnOp", "args": [{"name": v.strip("-"), "kind": kind, "value": v}
                                              for v in ("inf", "nan")] + [{"name": "m", "kind": kind, "value": "-inf"}]}
    values = [v for _, _, v in Graph.from_json(json.dumps(doc)).call.args]
    assert all(type(v) is float for v in values) and values[0] == np.inf and np.isnan(values[1])
    assert values[2] == -np.inf


def test_a_node_recorded_with_more_outputs_than_its_op_makes_is_refused():
    """A Cast recorded with two outputs (it makes one) is a GraphError naming both counts."""
    doc = json.loads(_doc())
    out = {"shape": [2], "dtype": "FLOAT16"}
    doc["nodes"] = [{"op": "Cast", "inputs": ["x"], "attrs": {"to": "FLOAT16"},
                     "outputs": [{"name": "y", **out}, {"name": "z", **out}]}]
    with pytest.raises(GraphError, match="Cast has 1 outputs, 2 recorded"):
        Graph.from_json(json.dumps(doc))


def test_a_loading_error_of_exactly_the_limit_is_not_clipped():
    """An error message of MAX_ERROR characters is kept whole; one more is clipped."""
    assert serialize._clipped("x" * serialize.MAX_ERROR) == "x" * serialize.MAX_ERROR
    assert serialize._clipped("x" * (serialize.MAX_ERROR + 1)).endswith("... (1 more characters)")


def test_dot_escapes_a_backslash_in_a_name():
    """DOT strings escape backslashes (then quotes): a graph name ending in a backslash does not
    escape the closing quote."""
    g = Graph("dir\\")
    g.outputs = [g.add_input("x", TensorType((2,), DataType.FLOAT))]
    assert serialize.to_dot(g).splitlines()[0] == 'digraph "dir\\\\" {'


def test_a_string_attribute_spelled_like_a_non_finite_float_stays_a_string():
    """Only a float field reads "nan" / "inf" back as a float: AllReduce's group named "nan"
    round-trips as that string."""
    g = Graph("g")
    x = g.add_input("x", TensorType((2,), DataType.FLOAT))
    g.outputs = [g.add_node("AllReduce", [x], group="nan", seq=2).outputs[0]]
    loaded = Graph.from_json(g.to_json())
    assert loaded == g and loaded.nodes[0].attrs.group == "nan"
