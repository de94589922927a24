"""aclDataType / aclFormat with their vendor numbers, numpy mapping and type promotion.

    >>> DataType.FLOAT16.short, DataType.FLOAT16.np
    ('f16', dtype('float16'))
    >>> promote_types(DataType.FLOAT16, DataType.BF16)
    <DataType.FLOAT: 0>
"""
from __future__ import annotations

import enum
import operator

import ml_dtypes
import numpy as np


class DataType(enum.IntEnum):
    """aclDataType; names and numbers as in the CANN runtime docs (runtime: docs/zh/api_ref/25-02_Enumerations.md)."""

    DT_UNDEFINED = -1
    FLOAT = 0
    FLOAT16 = 1
    INT8 = 2
    INT32 = 3
    UINT8 = 4
    INT16 = 6
    UINT16 = 7
    UINT32 = 8
    INT64 = 9
    UINT64 = 10
    DOUBLE = 11
    BOOL = 12
    STRING = 13
    COMPLEX64 = 16
    COMPLEX128 = 17
    BF16 = 27
    INT4 = 29
    UINT1 = 30
    COMPLEX32 = 33
    HIFLOAT8 = 34
    FLOAT8_E5M2 = 35
    FLOAT8_E4M3FN = 36
    FLOAT8_E8M0 = 37
    FLOAT6_E3M2 = 38
    FLOAT6_E2M3 = 39
    FLOAT4_E2M1 = 40
    FLOAT4_E1M2 = 41

    @property
    def short(self) -> str:
        """Short name used in dumps (``f32``, ``bf16``, ``s32``...)."""
        return _SHORT.get(self, self.name.lower())

    @property
    def np(self) -> np.dtype:
        """The numpy dtype holding this type; raises for types numpy cannot hold."""
        try:
            return _NP[self]
        except KeyError:
            raise TypeError(f"dtype {self.name} has no numpy representation") from None

    @property
    def itemsize(self) -> int:
        """Bytes per element (of :attr:`np`; TypeError for types numpy cannot hold).

            >>> DataType.BF16.itemsize, DataType.INT64.itemsize
            (2, 8)
        """
        return self.np.itemsize

    @property
    def acl_name(self) -> str:
        """The C enumerator, e.g. ``ACL_FLOAT16``."""
        return "ACL_" + ("DT_UNDEFINED" if self is DataType.DT_UNDEFINED else self.name)


_SHORT = {
    DataType.FLOAT: "f32", DataType.FLOAT16: "f16", DataType.BF16: "bf16", DataType.DOUBLE: "f64",
    DataType.INT8: "s8", DataType.INT16: "s16", DataType.INT32: "s32", DataType.INT64: "s64",
    DataType.UINT8: "u8", DataType.UINT16: "u16", DataType.UINT32: "u32", DataType.UINT64: "u64",
    DataType.BOOL: "bool", DataType.COMPLEX64: "c64", DataType.COMPLEX128: "c128",
}
_NP = {
    DataType.FLOAT: np.dtype(np.float32), DataType.FLOAT16: np.dtype(np.float16),
    DataType.BF16: np.dtype(ml_dtypes.bfloat16), DataType.DOUBLE: np.dtype(np.float64),
    DataType.INT8: np.dtype(np.int8), DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32), DataType.INT64: np.dtype(np.int64),
    DataType.UINT8: np.dtype(np.uint8), DataType.UINT16: np.dtype(np.uint16),
    DataType.UINT32: np.dtype(np.uint32), DataType.UINT64: np.dtype(np.uint64),
    DataType.BOOL: np.dtype(np.bool_), DataType.COMPLEX64: np.dtype(np.complex64),
    DataType.COMPLEX128: np.dtype(np.complex128),
}
_FROM_NP = {v: k for k, v in _NP.items()}
_BY_NAME = {**{d.name.lower(): d for d in DataType}, **{v: k for k, v in _SHORT.items()},
            "float32": DataType.FLOAT, "bfloat16": DataType.BF16, "float64": DataType.DOUBLE,
            "half": DataType.FLOAT16, "int32": DataType.INT32, "int64": DataType.INT64}


def dtype_of(x: "np.dtype | type | np.ndarray | DataType | str") -> DataType:
    """The DataType for a numpy dtype, scalar type or array, a DataType, or a name
    (``"float16"``, ``"f16"``).

    >>> dtype_of("bfloat16"), dtype_of(np.float16)
    (<DataType.BF16: 27>, <DataType.FLOAT16: 1>)
    """
    if isinstance(x, DataType):
        return x
    if isinstance(x, str):
        try:
            return _BY_NAME[x.lower()]
        except KeyError:
            raise ValueError(f"unknown dtype name {x!r}; use e.g. float32, float16, bfloat16, int32") from None
    try:  # a scalar type (np.float16, ml_dtypes.bfloat16) has a `dtype` that is no dtype
        dt = np.dtype(x if isinstance(x, type) else getattr(x, "dtype", x))
    except TypeError:
        raise TypeError(f"{x!r} is no dtype, array or dtype name") from None
    try:
        return _FROM_NP[dt]
    except KeyError:
        raise TypeError(f"numpy dtype {dt} has no aclDataType") from None


class Format(enum.IntEnum):
    """aclFormat; names and numbers as in runtime: docs/zh/api_ref/25-02_Enumerations.md."""

    UNDEFINED = -1
    NCHW = 0
    NHWC = 1
    ND = 2
    NC1HWC0 = 3
    FRACTAL_Z = 4
    NC1HWC0_C04 = 12
    HWCN = 16
    NDHWC = 27
    FRACTAL_NZ = 29
    NCDHW = 30
    NDC1HWC0 = 32
    FRACTAL_Z_3D = 33
    NC = 35
    NCL = 47
    FRACTAL_NZ_C0_16 = 50
    FRACTAL_NZ_C0_32 = 51
    FRACTAL_NZ_C0_2 = 52
    FRACTAL_NZ_C0_4 = 53
    FRACTAL_NZ_C0_8 = 54

    @property
    def is_private(self) -> bool:
        """``op::IsPrivateFormat``: true for exactly the 11 private formats."""
        return self in PRIVATE_FORMATS

    @property
    def acl_name(self) -> str:
        """The C enumerator: ``ACL_FORMAT_ND``; the three oldest fractal formats have no
        ``FORMAT_`` part (``ACL_FRACTAL_Z``, ``ACL_FRACTAL_NZ``, ``ACL_FRACTAL_Z_3D``)."""
        old = self.name in ("FRACTAL_Z", "FRACTAL_NZ", "FRACTAL_Z_3D")
        return ("ACL_" if old else "ACL_FORMAT_") + self.name


PRIVATE_FORMATS = frozenset({
    Format.NC1HWC0, Format.FRACTAL_Z, Format.NC1HWC0_C04, Format.FRACTAL_NZ, Format.NDC1HWC0,
    Format.FRACTAL_Z_3D, Format.FRACTAL_NZ_C0_16, Format.FRACTAL_NZ_C0_32, Format.FRACTAL_NZ_C0_2,
    Format.FRACTAL_NZ_C0_4, Format.FRACTAL_NZ_C0_8,
})


def format_of(x: "Format | str | int") -> Format:
    """A Format from a Format, a name (``"NCHW"``) or a number."""
    if isinstance(x, Format):
        return x
    if isinstance(x, str):
        try:
            return Format[x.upper().removeprefix("ACL_FORMAT_").removeprefix("ACL_")]
        except KeyError:
            raise ValueError(f"unknown format {x!r}") from None
    if isinstance(x, (bool, np.bool_)):
        raise ValueError(f"format must be a Format, a name or an integer, got {x!r}")
    try:
        return Format(operator.index(x))
    except TypeError:
        raise ValueError(f"format must be a Format, a name or an integer, got {x!r}") from None


# Promotion: the tensor-tensor table of opbase data_type_utils.h (kPromoteTypesLookup).
_F32, _F16, _BF16, _F64 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16, DataType.DOUBLE
_INT_ORDER = [DataType.BOOL, DataType.UINT8, DataType.INT8, DataType.INT16, DataType.INT32, DataType.INT64]
_WIDE_UNSIGNED = frozenset({DataType.UINT16, DataType.UINT32, DataType.UINT64})
_C32, _C64, _C128 = DataType.COMPLEX32, DataType.COMPLEX64, DataType.COMPLEX128
_COMPLEX = frozenset({_C32, _C64, _C128})


def _promote_complex(a: DataType, b: DataType) -> DataType:
    """Complex rows of the table: c128 or f64 involved → c128; c64 or f32 (with c32) → c64;
    c32 with f16, bf16 (the doc's rendering), integers or bool → c32."""
    other = b if a in _COMPLEX else a
    pair = {a, b}
    if other not in _COMPLEX and other not in _INT_ORDER and other not in (_F32, _F16, _BF16, _F64):
        return DataType.DT_UNDEFINED
    if _C128 in pair or _F64 in pair:
        return _C128
    if _C64 in pair or _F32 in pair:
        return _C64
    return _C32


def promote_types(a: DataType, b: DataType) -> DataType:
    """``op::PromoteType`` for the real dtypes (same type → same type).

    >>> promote_types(DataType.INT32, DataType.FLOAT16)
    <DataType.FLOAT16: 1>
    """
    if a == b:
        return a
    if {a, b} & _WIDE_UNSIGNED:
        return DataType.DT_UNDEFINED  # u16/u32/u64 promote only with themselves
    if {a, b} & _COMPLEX:
        return _promote_complex(a, b)
    floats = {a, b} & {_F32, _F16, _BF16, _F64}
    if floats:
        if _F64 in floats:
            return _F64
        if len(floats) == 2 or _F32 in floats:
            return _F32  # f16+bf16 = f32, anything+f32 = f32
        return floats.pop()  # integer + f16/bf16 keeps the float
    if a in _INT_ORDER and b in _INT_ORDER:
        if {a, b} == {DataType.INT8, DataType.UINT8}:
            return DataType.INT16
        if DataType.BOOL in (a, b):
            return b if a == DataType.BOOL else a
        return max(a, b, key=_INT_ORDER.index)
    return DataType.DT_UNDEFINED
