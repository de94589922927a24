"""TensorType: the static type of an IR value (shape, dtype, format; strides for user tensors).

    >>> from opgraph.core.dtypes import DataType
    >>> t = TensorType((2, 3), DataType.FLOAT16)
    >>> str(t), t.nbytes, str(t.with_(dtype=DataType.FLOAT))
    ('f16[2,3]', 12, 'f32[2,3]')
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .dtypes import DataType, Format
from .tensor import is_contiguous, row_major_strides


@dataclass(frozen=True)
class TensorType:
    """Shape, dtype and format of a value; graph inputs (user tensors) also carry strides."""

    shape: tuple[int, ...]
    dtype: DataType
    format: Format = Format.ND
    strides: "tuple[int, ...] | None" = None

    def __post_init__(self) -> None:  # normalise, cheaply when already normal
        if type(self.shape) is not tuple or not all(type(n) is int for n in self.shape):
            object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if type(self.dtype) is not DataType:
            object.__setattr__(self, "dtype", DataType(self.dtype))
        if type(self.format) is not Format:
            object.__setattr__(self, "format", Format(self.format))
        if self.strides is not None and (type(self.strides) is not tuple
                                         or not all(type(n) is int for n in self.strides)):
            object.__setattr__(self, "strides", tuple(int(s) for s in self.strides))

    @classmethod
    def trusted(cls, shape: tuple[int, ...], dtype: DataType, format: Format = Format.ND,
                strides: "tuple[int, ...] | None" = None) -> "TensorType":
        """A TensorType of fields already normal (int tuples, enum members), without the
        checks of ``__post_init__``: for code that maps a checked type's sizes.

        >>> TensorType.trusted((2, 3), DataType.FLOAT) == TensorType((2, 3), DataType.FLOAT)
        True
        """
        t = object.__new__(cls)
        for name, value in (("shape", shape), ("dtype", dtype), ("format", format),
                            ("strides", strides)):
            object.__setattr__(t, name, value)
        return t

    @property
    def numel(self) -> int:
        """The number of elements (1 for rank 0)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the elements, densely packed (strides ignored)."""
        return self.numel * self.dtype.itemsize

    @property
    def rank(self) -> int:
        """The number of dims."""
        return len(self.shape)

    @property
    def is_contiguous(self) -> bool:
        """True for a value without strides (an intermediate), else :func:`is_contiguous`."""
        return self.strides is None or is_contiguous(self.shape, self.strides, self.format)

    def with_(self, shape: "tuple[int, ...] | None" = None, dtype: "DataType | None" = None,
              format: "Format | None" = None, strides: "tuple[int, ...] | None" = None) -> "TensorType":
        """A copy with some fields changed (strides dropped unless given)."""
        return TensorType(self.shape if shape is None else shape, self.dtype if dtype is None else dtype,
                          self.format if format is None else format, strides)

    def __str__(self) -> str:
        s = f"{self.dtype.short}[{','.join(map(str, self.shape))}]"
        if self.strides is not None and self.strides != row_major_strides(self.shape):
            s += "{" + ",".join(map(str, self.strides)) + "}"
        if self.format != Format.ND:
            s += f"@{self.format.name}"
        return s


class GraphError(ValueError):
    """A graph broke an IR rule; the message quotes the offending node's dump line."""


def format_attr(v: Any) -> str:
    """How an attribute value prints in a text dump.

    >>> format_attr((DataType.FLOAT16, 2, 0.5))
    '[f16,2,0.5]'
    """
    if isinstance(v, DataType):
        return v.short
    if isinstance(v, Format):
        return v.name
    if isinstance(v, (tuple, list)):
        return "[" + ",".join(format_attr(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)


@dataclass(frozen=True)
class RecordedCall:
    """The op_api call that recorded a graph: ``api`` and its arguments in prototype order as
    ``(name, kind, value)``: kind ``tensor`` with the graph input's name (None for NULL), or
    ``float`` / ``int`` / ``bool`` with the value. Backends that run a whole op_api as one call
    (aclnn's lowering of a fused graph) read it.

    >>> c = RecordedCall("aclnnDemo", (("x", "tensor", "x"), ("eps", "float", 1e-05)))
    >>> c.value("eps"), c.kinds()
    (1e-05, ('tensor', 'float'))
    """

    api: str
    args: tuple[tuple[str, str, Any], ...]

    def value(self, name: str) -> Any:
        """The value of argument ``name`` (StopIteration when the call has none)."""
        return next(v for n, _, v in self.args if n == name)

    def kinds(self) -> tuple[str, ...]:
        """Each argument's kind, in prototype order."""
        return tuple(k for _, k, _ in self.args)


def broadcast_shape(*shapes: "tuple[int, ...]") -> tuple[int, ...]:
    """The shape numpy broadcasting gives ``shapes`` (right-aligned; a dim of 1 stretches);
    ``ValueError`` when they do not broadcast. ``np.broadcast_shapes`` without its arrays: a
    fused body's type check runs it per instruction, and a new size of a known structure
    checks its body anew.

        >>> broadcast_shape((4, 1, 3), (2, 1), ())
        (4, 2, 3)
    """
    if len(shapes) == 2 and shapes[0] == shapes[1]:
        return tuple(shapes[0])
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for s in shapes:
        for i, n in enumerate(s, rank - len(s)):
            if n != out[i]:
                if out[i] == 1:
                    out[i] = n
                elif n != 1:
                    raise ValueError(f"shapes {[list(s) for s in shapes]} do not broadcast")
    return tuple(out)
