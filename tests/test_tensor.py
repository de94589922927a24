"""Tensors (reference §2.3 contiguity, strided views), dtypes/formats (§2.1, §2.2), type promotion
(§8) and the platform presets / context (§9, design §3)."""
from __future__ import annotations

import ctypes
import platform
import sys
import sysconfig
import threading

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import DataType, Format, Tensor, is_contiguous, promote_types
from opgraph.core import foreign
from opgraph.core.tensor import array_address
from reference import make_case, run_op, to_tensors

try:  # numpy 2
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy 1.x
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]


# --------------------------------------------------------------------------------------------
# contiguity (op::IsContiguous)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,strides,fmt,expected", [
    ((2, 3), (3, 1), "ND", True),
    ((2, 3), (1, 2), "ND", False),          # transposed
    ((2, 3), (4, 1), "ND", False),          # padded rows
    ((3,), (2,), "ND", False),              # every other element
    ((2, 3), (0, 1), "ND", False),          # broadcast
    ((2, 1, 3), (3, 999, 1), "ND", True),   # size-1 dims are skipped
    ((1, 4), (7, 1), "ND", True),
    ((4, 1), (1, 5), "ND", True),
    ((1, 1, 1), (5, 9, 2), "ND", True),     # one element
    ((1,), (3,), "ND", True),
    ((0, 3), (7, 5), "ND", True),           # no elements
    ((2, 3), (1, 2), "NC1HWC0", True),      # private format counts as contiguous
    ((2, 3), (1, 2), "FRACTAL_NZ", True),
    ((2, 3), (1, 2), "NCHW", False),        # a plain tag does not
    ((2, 2, 2), (4, 2, 1), "NHWC", True),
])
def test_is_contiguous_rule(shape, strides, fmt, expected):
    assert is_contiguous(shape, strides, opgraph.format_of(fmt)) is expected
    size = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 1
    t = Tensor(np.zeros(size + 2, np.float32), shape, strides, 0, fmt)
    assert t.is_contiguous is expected


def test_offset_is_ignored_by_contiguity():
    t = Tensor(np.zeros(20, np.float32), (2, 3), (3, 1), offset=11)
    assert t.is_contiguous
    assert t.offset == 11


# --------------------------------------------------------------------------------------------
# Tensor validation
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size,shape,strides,offset", [
    (5, (2, 3), (3, 1), 0),     # last element is 5
    (6, (2, 3), (3, 1), 1),     # offset pushes it out
    (10, (3, 3), (1, 4), 0),    # transposed view too big
    (4, (2, 2), (0, 4), 0),
])
def test_view_outside_storage_is_rejected(size, shape, strides, offset):
    with pytest.raises(ValueError, match="outside storage"):
        Tensor(np.zeros(size, np.float32), shape, strides, offset)


def test_view_exactly_fitting_storage_is_accepted():
    t = Tensor(np.arange(7, dtype=np.float32), (2, 3), (3, 1), offset=1)
    assert t.numpy().tolist() == [[1, 2, 3], [4, 5, 6]]
    # an empty view never reaches storage, whatever its strides and offset
    assert Tensor(np.zeros(0, np.float32), (0, 3), (100, 1), 0).numel == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(shape=(2, 2), strides=(-1, 1), offset=3), "strides"),
    (dict(shape=(2, 2), strides=(2, 1), offset=-1), "offset"),
    (dict(shape=(2, 2), strides=(1,), offset=0), "rank"),
    (dict(shape=(2, -2), strides=(2, 1), offset=0), "negative"),
    # what aclCreateTensor's int64_t cannot hold (BroadcastTo named it 561103 later)
    (dict(shape=(2 ** 63, 1), strides=(0, 0), offset=0), "int64_t"),
    (dict(shape=(1,), strides=(2 ** 63,), offset=0), "int64_t"),
    (dict(shape=(2 ** 32, 2 ** 32), strides=(0, 0), offset=0), "element count"),
])
def test_invalid_views_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Tensor(np.zeros(10, np.float32), **kwargs)


def test_a_view_within_int64_is_made():
    t = Tensor(np.zeros(1, np.float32), (2 ** 31, 2 ** 31 - 1), (0, 0), 0)  # 2**62 - 2**31 elements
    assert t.numel == 2 ** 62 - 2 ** 31


def test_storage_must_be_flat():
    with pytest.raises(ValueError, match="1-D"):
        Tensor(np.zeros((2, 3), np.float32), (2, 3), (3, 1))


def test_numpy_values_of_strided_view():
    s = np.arange(12, dtype=np.float32)
    t = Tensor(s, (2, 2), (5, 2), offset=1)
    assert t.numpy().tolist() == [[1, 3], [6, 8]]
    assert t.numpy().flags.c_contiguous
    u = Tensor(s, (3, 2), (1, 3))
    assert u.numpy().tolist() == [[0, 3], [1, 4], [2, 5]]
    b = Tensor(s, (2, 3), (0, 1), offset=4)  # stride 0 = broadcast
    assert b.numpy().tolist() == [[4, 5, 6], [4, 5, 6]]


def test_numpy_is_a_copy_and_view_is_live():
    s = np.zeros(6, np.float32)
    t = Tensor(s, (2, 2), (3, 1), offset=1)
    c = t.numpy()
    c[:] = 7
    assert not s.any()
    t.view()[1, 1] = 3
    assert s.tolist() == [0, 0, 0, 0, 0, 3]


def test_tensor_of_transpose_shares_memory():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = opgraph.tensor(a.T)
    assert t.shape == (3, 2) and t.strides == (1, 3) and not t.is_contiguous
    assert np.shares_memory(t.storage, a)
    assert t.numpy().tolist() == a.T.tolist()
    a[1, 2] = 100
    assert t.numpy()[2, 1] == 100


def test_tensor_of_stepped_slice_shares_memory():
    a = np.arange(24, dtype=np.float16).reshape(4, 6)
    v = a[1:, ::2]
    t = opgraph.tensor(v)
    assert t.shape == (3, 3) and t.strides == (6, 2) and not t.is_contiguous
    assert np.shares_memory(t.storage, a)
    np.testing.assert_array_equal(t.numpy(), v)
    t.view()[0, 0] = -1
    assert a[1, 0] == -1


def test_tensor_of_negative_strides_copies():
    a = np.arange(5, dtype=np.float32)
    t = opgraph.tensor(a[::-1])
    assert t.strides == (1,)
    assert t.numpy().tolist() == [4, 3, 2, 1, 0]


def test_tensor_dtypes_and_format():
    assert opgraph.tensor(np.zeros(2, ml_dtypes.bfloat16)).dtype is DataType.BF16
    assert opgraph.tensor(np.zeros(2, np.int32)).dtype is DataType.INT32
    assert opgraph.tensor([1.0, 2.0], dtype="float16").dtype is DataType.FLOAT16
    t = opgraph.tensor(np.zeros((1, 2, 3, 4), np.float32), format="NHWC")
    assert t.format is Format.NHWC and t.is_contiguous and t.ndim == 4 and t.numel == 24
    e = opgraph.tensor(np.zeros((0, 3), np.float32))
    assert e.is_empty and e.shape == (0, 3)


def test_contiguous_tensor_strides_and_storage_shape():
    a = np.zeros((2, 3, 4), np.float32)
    t = opgraph.tensor(a)
    assert t.strides == (12, 4, 1) and t.offset == 0 and t.is_contiguous
    assert np.shares_memory(t.storage, a) and t.storage.size == 24


# --------------------------------------------------------------------------------------------
# dtypes and formats (vendor numbers)
# --------------------------------------------------------------------------------------------
ACL_DTYPES = {
    "DT_UNDEFINED": -1, "FLOAT": 0, "FLOAT16": 1, "INT8": 2, "INT32": 3, "UINT8": 4, "INT16": 6,
    "UINT16": 7, "UINT32": 8, "INT64": 9, "UINT64": 10, "DOUBLE": 11, "BOOL": 12, "STRING": 13,
    "COMPLEX64": 16, "COMPLEX128": 17, "BF16": 27, "INT4": 29, "UINT1": 30, "COMPLEX32": 33,
    "HIFLOAT8": 34, "FLOAT8_E5M2": 35, "FLOAT8_E4M3FN": 36, "FLOAT8_E8M0": 37,
    "FLOAT6_E3M2": 38, "FLOAT6_E2M3": 39, "FLOAT4_E2M1": 40, "FLOAT4_E1M2": 41,
}
ACL_FORMATS = {
    "UNDEFINED": -1, "NCHW": 0, "NHWC": 1, "ND": 2, "NC1HWC0": 3, "FRACTAL_Z": 4,
    "NC1HWC0_C04": 12, "HWCN": 16, "NDHWC": 27, "FRACTAL_NZ": 29, "NCDHW": 30, "NDC1HWC0": 32,
    "FRACTAL_Z_3D": 33, "NC": 35, "NCL": 47, "FRACTAL_NZ_C0_16": 50, "FRACTAL_NZ_C0_32": 51,
    "FRACTAL_NZ_C0_2": 52, "FRACTAL_NZ_C0_4": 53, "FRACTAL_NZ_C0_8": 54,
}
PRIVATE = {"NC1HWC0", "FRACTAL_Z", "NC1HWC0_C04", "FRACTAL_NZ", "NDC1HWC0", "FRACTAL_Z_3D",
           "FRACTAL_NZ_C0_16", "FRACTAL_NZ_C0_32", "FRACTAL_NZ_C0_2", "FRACTAL_NZ_C0_4",
           "FRACTAL_NZ_C0_8"}


def test_acl_datatype_numbers():
    assert {d.name: int(d) for d in DataType} == ACL_DTYPES


def test_acl_format_numbers():
    assert {f.name: int(f) for f in Format} == ACL_FORMATS


def test_exactly_eleven_private_formats():
    assert len(PRIVATE) == 11
    assert {f.name for f in Format if f.is_private} == PRIVATE


def test_dtype_numpy_mapping_and_names():
    assert DataType.FLOAT16.np == np.float16 and DataType.BF16.np == ml_dtypes.bfloat16
    assert DataType.FLOAT.itemsize == 4 and DataType.BF16.itemsize == 2
    assert DataType.FLOAT.acl_name == "ACL_FLOAT" and DataType.BF16.acl_name == "ACL_BF16"
    assert Format.NCHW.acl_name == "ACL_FORMAT_NCHW"
    for name, d in [("float32", DataType.FLOAT), ("f16", DataType.FLOAT16), ("bfloat16", DataType.BF16),
                    ("int32", DataType.INT32), ("FLOAT", DataType.FLOAT)]:
        assert opgraph.dtype_of(name) is d
    assert opgraph.dtype_of(np.dtype(ml_dtypes.bfloat16)) is DataType.BF16
    # scalar types, as numpy takes them: np.float16's `dtype` attribute is a descriptor, which
    # np.dtype() refused (TypeError: Cannot interpret '<attribute 'dtype' ...>')
    for scalar_type, d in [(np.float16, DataType.FLOAT16), (np.float32, DataType.FLOAT),
                           (ml_dtypes.bfloat16, DataType.BF16), (np.int64, DataType.INT64)]:
        assert opgraph.dtype_of(scalar_type) is d
    with pytest.raises(TypeError, match="3.5 is no dtype"):
        opgraph.dtype_of(3.5)
    with pytest.raises(ValueError, match="unknown dtype"):
        opgraph.dtype_of("float17")
    with pytest.raises(TypeError):
        DataType.HIFLOAT8.np
    assert opgraph.format_of("ACL_FORMAT_NHWC") is Format.NHWC and opgraph.format_of(29) is Format.FRACTAL_NZ
    with pytest.raises(ValueError):
        opgraph.format_of("NOPE")


# reference §8, table 1 (rows a, columns b)
PROMOTE_TABLE = """
      f32  f16  bf16 f64  s8   u8   s16  s32  s64  bool
f32   f32  f32  f32  f64  f32  f32  f32  f32  f32  f32
f16   f32  f16  f32  f64  f16  f16  f16  f16  f16  f16
bf16  f32  f32  bf16 f64  bf16 bf16 bf16 bf16 bf16 bf16
s8    f32  f16  bf16 f64  s8   s16  s16  s32  s64  s8
u8    f32  f16  bf16 f64  s16  u8   s16  s32  s64  u8
s32   f32  f16  bf16 f64  s32  s32  s32  s32  s64  s32
s64   f32  f16  bf16 f64  s64  s64  s64  s64  s64  s64
bool  f32  f16  bf16 f64  s8   u8   s16  s32  s64  bool
"""
_SHORT = {"f32": DataType.FLOAT, "f16": DataType.FLOAT16, "bf16": DataType.BF16, "f64": DataType.DOUBLE,
          "s8": DataType.INT8, "u8": DataType.UINT8, "s16": DataType.INT16, "s32": DataType.INT32,
          "s64": DataType.INT64, "bool": DataType.BOOL, "u16": DataType.UINT16, "u32": DataType.UINT32,
          "u64": DataType.UINT64, "c32": DataType.COMPLEX32, "c64": DataType.COMPLEX64,
          "c128": DataType.COMPLEX128}


def _table_cells():
    rows = [r.split() for r in PROMOTE_TABLE.strip().splitlines()]
    cols = rows[0]
    for r in rows[1:]:
        for c, cell in zip(cols, r[1:]):
            yield r[0], c, cell


@pytest.mark.parametrize("a,b,expected", list(_table_cells()))
def test_promote_types_table(a, b, expected):
    assert promote_types(_SHORT[a], _SHORT[b]) is _SHORT[expected]


@pytest.mark.parametrize("a", ["f32", "f16", "bf16", "f64", "s8", "u8", "s16", "s32", "s64", "bool"])
def test_promote_types_is_symmetric_on_the_table(a):
    for b in ["f32", "f16", "bf16", "f64", "s8", "u8", "s16", "s32", "s64", "bool"]:
        assert promote_types(_SHORT[a], _SHORT[b]) is promote_types(_SHORT[b], _SHORT[a])


@pytest.mark.parametrize("u", ["u16", "u32", "u64"])
def test_wide_unsigned_promote_only_with_themselves(u):
    assert promote_types(_SHORT[u], _SHORT[u]) is _SHORT[u]
    for other in ["f32", "f16", "bf16", "f64", "s8", "u8", "s32", "bool"]:
        assert promote_types(_SHORT[u], _SHORT[other]) is DataType.DT_UNDEFINED, other
        assert promote_types(_SHORT[other], _SHORT[u]) is DataType.DT_UNDEFINED, other


@pytest.mark.parametrize("a,b,expected", [
    ("c32", "f16", "c32"), ("c32", "f32", "c64"), ("c32", "s32", "c32"),
    ("c64", "f32", "c64"), ("c64", "f16", "c64"), ("c64", "s64", "c64"), ("c64", "bool", "c64"),
    ("c64", "f64", "c128"), ("c64", "c128", "c128"), ("c128", "f32", "c128"), ("c32", "c64", "c64"),
])
def test_promote_types_complex(a, b, expected):
    assert promote_types(_SHORT[a], _SHORT[b]) is _SHORT[expected]
    assert promote_types(_SHORT[b], _SHORT[a]) is _SHORT[expected]


# --------------------------------------------------------------------------------------------
# platforms
# --------------------------------------------------------------------------------------------
def _in_fresh_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", fn()))
    t.start()
    t.join()
    return box["v"]


def test_default_platform_is_ascend910b():
    p = _in_fresh_thread(opgraph.get_platform)
    assert (p.soc, p.npu_arch, p.core_count, p.ub_size) == ("Ascend910B", 2201, 40, 196608)
    assert p.arch_name == "DAV_2201" and not p.is_regbase
    assert opgraph.get_platform().soc == "Ascend910B"  # the autouse fixture keeps the default too


@pytest.mark.parametrize("soc,arch,cores,ub", [
    ("Ascend950", 3510, 64, 245760),
    ("Ascend910_93", 2201, None, 196608),
    ("Ascend910", 1001, None, None),
    ("Ascend310P", 2002, None, None),
    ("Ascend310B", 3002, None, None),
])
def test_platform_presets(soc, arch, cores, ub):
    with opgraph.platform(soc) as p:
        assert opgraph.get_platform() is p
        assert p.soc == soc and p.npu_arch == arch
        if cores is not None:
            assert p.core_count == cores
        if ub is not None:
            assert p.ub_size == ub
        assert p.is_regbase is (arch == 3510)


def test_ascend910_95_is_an_alias_of_950():
    with opgraph.platform("Ascend910_95") as p:
        assert p.soc == "Ascend950" and p.npu_arch == 3510


def test_platform_context_restores_even_on_error():
    with pytest.raises(RuntimeError):
        with opgraph.platform("Ascend950"):
            with opgraph.platform("Ascend910"):
                assert opgraph.get_platform().soc == "Ascend910"
            assert opgraph.get_platform().soc == "Ascend950"
            raise RuntimeError("boom")
    assert opgraph.get_platform().soc == "Ascend910B"


def test_set_platform_and_unknown_name():
    assert opgraph.set_platform("Ascend910_93").soc == "Ascend910_93"
    assert opgraph.get_platform().npu_arch == 2201
    with pytest.raises(ValueError, match="unknown platform 'Ascend999'"):
        opgraph.set_platform("Ascend999")
    assert opgraph.get_platform().soc == "Ascend910_93"


def test_platform_is_thread_local():
    """A new thread sees the default, and threads do not see each other's choices."""
    with opgraph.platform("Ascend950"):
        assert _in_fresh_thread(lambda: opgraph.get_platform().soc) == "Ascend910B"
    barrier = threading.Barrier(3)
    seen = {}

    def worker(soc):
        with opgraph.platform(soc):
            barrier.wait()
            seen[soc] = opgraph.get_platform().soc
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(s,)) for s in ("Ascend950", "Ascend910", "Ascend310P")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"Ascend950": "Ascend950", "Ascend910": "Ascend910", "Ascend310P": "Ascend310P"}


def test_executor_records_its_platform():
    c = make_case((2, 3), np.float32)
    with opgraph.platform("Ascend950"):
        _, _, ex, _ = run_op(to_tensors(c), opgraph.tensor(np.zeros((2, 3), np.float32)))
    assert ex.platform.soc == "Ascend950"
    kernel = [n for n in ex.graph.nodes if n.op == "SyncBatchNormBackwardElemt"]
    assert len(kernel) == 1 and kernel[0].attrs.arch == 3510


def test_c_contiguous_array_with_an_odd_size_one_stride_is_viewed_with_row_major_strides():
    """numpy lets a size-1 dim of a C-contiguous array carry any stride (here -16 bytes); the
    tensor is still a view of the caller's memory, with canonical strides, and writable."""
    a = np.zeros((1, 4), np.float32)[::-1]
    assert a.flags.c_contiguous and a.strides[0] < 0
    t = opgraph.tensor(a)
    assert t.strides == (4, 1) and not t.copied and t.writeable
    t.storage[:] = [1, 2, 3, 4]
    assert a.tolist() == [[1.0, 2.0, 3.0, 4.0]]
    b = np.zeros((2, 3), np.float32)[:, None, :]  # a new axis: stride 0
    assert b.flags.c_contiguous and b.strides[1] == 0
    assert opgraph.tensor(b).signature == opgraph.tensor(np.zeros((2, 1, 3), np.float32)).signature


class _Subclass(np.ndarray):
    pass


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int32])
def test_array_address_is_the_first_elements_for_every_dtype_and_layout(dtype, fast, monkeypatch):
    """The data pointer read from the array object (``fast``) and ``ctypes.data`` give the
    same address for every dtype (bfloat16: user-defined), layout and flag: offset, strided,
    reversed, transposed, read-only, empty, 0-d, a view of other bytes, a subclass."""
    if not fast:
        monkeypatch.setattr(foreign, "_DATA_AT", None)
    a = np.arange(12).astype(dtype)
    ro = a.copy()
    ro.flags.writeable = False
    grid = a.reshape(3, 4)
    for x in (a, a[3:], a[1::2], a[::-1], ro, a[:0], grid.T, grid[1:, ::-2], a[5:6].reshape(()),
              a.view(np.uint8)[2:], a.view(_Subclass)[4:]):
        assert array_address(x) == x.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int8])
def test_array_span_is_numpys_byte_bounds_for_every_layout(dtype):
    """``array_span`` (the bytes a direct call checks for overlap) and ``array_extent`` (the
    same from the first element, a native launch's overlap check) are numpy's own
    ``byte_bounds`` for every layout: contiguous, offset, strided, reversed (negative strides
    reach below the first element), transposed, broadcast (stride 0), 0-d, a view of other
    bytes; an empty array spans nothing, where it is."""
    a = np.arange(48).astype(dtype)
    grid = a.reshape(4, 12)
    cube = a.reshape(2, 4, 6)
    views = (a, a[3:], a[1::3], a[::-1], a[40:2:-5], grid.T, grid[1:, ::-2], grid[::-1, 3:7],
             cube.transpose(2, 0, 1), cube[:, ::-1, 1::2], np.broadcast_to(a[:6], (5, 6)),
             a[7:8].reshape(()), a.view(np.uint8)[3:11], grid[:, 5:6])
    for x in views:
        assert foreign.array_span(x) == byte_bounds(x), (x.shape, x.strides)
        at = array_address(x)
        assert foreign.array_extent(x) == tuple(b - at for b in byte_bounds(x))
    for empty in (a[:0], grid[2:2], grid[:, ::-1][:, 4:4], cube[:, :0, ::-2]):
        lo = array_address(empty)
        assert foreign.array_span(empty) == (lo, lo) and foreign.array_extent(empty) == (0, 0)


@pytest.mark.skipif(platform.python_implementation() != "CPython" or hasattr(sys, "gettotalrefcount")
                    or bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
                    reason="CPython's usual build only: another object header keeps the ctypes path")
def test_array_address_reads_the_data_pointer_on_cpython():
    """On CPython's usual build numpy's array object has its data pointer right after the
    object header, where the import-time check found it (so the fast read is the one taken)."""
    assert foreign._DATA_AT == 2 * ctypes.sizeof(ctypes.c_void_p)


class CopyingExporter:
    """A CPU array that looks like a torch tensor (``is_cpu``, ``data_ptr``, ``numpy``) but whose
    ``numpy()`` is a copy; its DLPack export is its memory."""
    is_cpu = True

    def __init__(self, a: np.ndarray):
        self.a = a

    def data_ptr(self) -> int:
        return self.a.ctypes.data

    def numpy(self) -> np.ndarray:
        return self.a.copy()

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_a_foreign_array_is_viewed_only_through_memory_it_shares():
    """The quick ``numpy()`` view of a torch-like tensor is taken only when it is the tensor's
    own memory; a copy would lose what phase 2 writes, so DLPack views it instead."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = opgraph.tensor(CopyingExporter(a))
    t.view()[1, 2] = -1.0
    assert a[1, 2] == -1.0 and not t.copied
