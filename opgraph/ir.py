"""The IR: typed SSA values, nodes (one l0 op call each) and graphs.

    >>> from opgraph.dtypes import DataType
    >>> g = Graph("demo")
    >>> x = g.add_input("x", TensorType((2, 3), DataType.FLOAT16))
    >>> y = g.add_node("Cast", [x], to=DataType.FLOAT).outputs[0]
    >>> g.outputs = [y]
    >>> print(g)
    graph demo(%x: f16[2,3]) {
      %0: f32[2,3] = Cast(%x, to=f32)
      return %0
    }

Values know their users (cheap ``replace_all_uses_with``); ``verify()`` re-infers every type.
Serialization (JSON, DOT, networkx) lives in :mod:`opgraph.serialize`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from pydantic import BaseModel

from .dtypes import DataType, Format
from .tensor import is_contiguous, row_major_strides


def _registry():
    """l0ops.registry, imported on first use (l0ops imports this module)."""
    global _REGISTRY_MODULE
    if _REGISTRY_MODULE is None:
        import l0ops.registry as reg
        _REGISTRY_MODULE = reg
    return _REGISTRY_MODULE


_REGISTRY_MODULE = None


class GraphError(ValueError):
    """A graph broke an IR rule; the message quotes the offending node's dump line."""


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

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_contiguous(self) -> bool:
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


class Value:
    """An SSA value: a name, a type, the node producing it (None for graph inputs), its users."""

    __slots__ = ("name", "type", "producer", "users")

    def __init__(self, name: str, type: TensorType, producer: "Node | None" = None):
        self.name, self.type, self.producer = name, type, producer
        self.users: list[Node] = []

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> DataType:
        return self.type.dtype

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


class Node:
    """One call of an l0 op: ``outputs = op(inputs, attrs)``."""

    __slots__ = ("op", "inputs", "attrs", "outputs")

    def __init__(self, op: str, inputs: Sequence[Value], attrs: BaseModel):
        self.op, self.inputs, self.attrs = op, list(inputs), attrs
        self.outputs: list[Value] = []

    @property
    def opdef(self):
        return _registry().get_op(self.op)

    def attr_items(self) -> list[tuple[str, Any]]:
        """Attributes in declaration order."""
        return [(k, getattr(self.attrs, k)) for k in type(self.attrs).model_fields]

    def __str__(self) -> str:
        lhs = ", ".join(f"%{v.name}: {v.type}" for v in self.outputs)
        args = [f"%{v.name}" for v in self.inputs]
        fields = type(self.attrs).model_fields
        args += [f"{k}={format_attr(v)}" for k, v in self.attr_items()  # defaults are elided
                 if k != "body" and not (not fields[k].is_required() and v == fields[k].default)]
        line = f"{lhs} = {self.op}({', '.join(args)})"
        body = getattr(self.attrs, "body", None)
        if body:
            from l0ops.fused import body_lines
            line += " {\n" + "\n".join("      " + b for b in body_lines(self.attrs)) + "\n  }"
        return line

    __repr__ = __str__


def format_attr(v: Any) -> str:
    """How an attribute value prints in a text dump."""
    if isinstance(v, DataType):
        return v.short
    if isinstance(v, Format):
        return v.name
    if isinstance(v, (tuple, list)):
        return "[" + ",".join(format_attr(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)


class Graph:
    """A recorded op_api graph: named inputs (user tensors), nodes in emission order, outputs."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self.inputs: list[Value] = []
        self.nodes: list[Node] = []
        self.outputs: list[Value] = []
        self._next = 0

    # --- building -------------------------------------------------------------------------
    def add_input(self, name: str, type: TensorType) -> Value:
        if any(v.name == name for v in self.inputs):
            raise GraphError(f"graph input %{name} defined twice")
        v = Value(name, type)
        self.inputs.append(v)
        return v

    def fresh_name(self) -> str:
        name = str(self._next)
        self._next += 1
        return name

    def add_node(self, op: str, inputs: Sequence[Value], attrs: "BaseModel | None" = None,
                 *, out_names: "Sequence[str] | None" = None, index: "int | None" = None,
                 **attr_kwargs: Any) -> Node:
        """Append (or insert at ``index``) a call of ``op``; output types are inferred."""
        from l0ops.registry import get_op
        opdef = get_op(op)
        if attrs is None:
            attrs = opdef.make_attrs(**attr_kwargs)
        node = Node(op, inputs, attrs)
        out_types = opdef.infer_types([v.type for v in inputs], attrs)
        names = list(out_names) if out_names else [self.fresh_name() for _ in out_types]
        node.outputs = [Value(n, t, node) for n, t in zip(names, out_types)]
        for v in inputs:
            v.users.append(node)
        if index is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(index, node)
        return node

    # --- editing (for passes) -------------------------------------------------------------
    def replace_all_uses_with(self, old: Value, new: Value) -> None:
        """Point every user of ``old`` (and graph outputs) at ``new``."""
        for user in old.users:
            user.inputs = [new if v is old else v for v in user.inputs]
            new.users.append(user)
        old.users = []
        self.outputs = [new if v is old else v for v in self.outputs]

    def remove_node(self, node: Node) -> None:
        """Drop a node whose outputs have no users."""
        for v in node.outputs:
            if v.users or v in self.outputs:
                raise GraphError(f"cannot remove a node whose output is used: {node}")
        for v in node.inputs:
            if node in v.users:
                v.users.remove(node)
        self.nodes.remove(node)
        node.inputs, node.outputs = [], []  # detached: passes iterating a snapshot skip it

    def values(self) -> Iterable[Value]:
        yield from self.inputs
        for n in self.nodes:
            yield from n.outputs

    def copy(self) -> "Graph":
        """A deep structural copy (attrs are frozen and shared)."""
        g = Graph(self.name)
        g._next = self._next
        env = {id(v): g.add_input(v.name, v.type) for v in self.inputs}
        for n in self.nodes:
            m = Node(n.op, [env[id(v)] for v in n.inputs], n.attrs)
            m.outputs = [Value(v.name, v.type, m) for v in n.outputs]
            for v in m.inputs:
                v.users.append(m)
            for old, new in zip(n.outputs, m.outputs):
                env[id(old)] = new
            g.nodes.append(m)
        g.outputs = [env[id(v)] for v in self.outputs]
        return g

    # --- checking -------------------------------------------------------------------------
    def verify(self) -> "Graph":
        """Check SSA, definition order, user lists, re-inferred types and effects; returns self."""
        from l0ops.registry import get_op
        defined: dict[str, Value] = {}
        for v in self.inputs:
            if v.name in defined:
                raise GraphError(f"value %{v.name} defined twice")
            defined[v.name] = v
        for i, n in enumerate(self.nodes):
            try:
                opdef = get_op(n.op)
            except KeyError as e:
                raise GraphError(f"node {i}: {e.args[0]}: {n}") from None
            for v in n.inputs:
                if defined.get(v.name) is not v:
                    raise GraphError(f"node {i} uses %{v.name} before it is defined: {n}")
                if n not in v.users:
                    raise GraphError(f"node {i} is missing from the users of %{v.name}: {n}")
            try:
                types = opdef.infer_types([v.type for v in n.inputs], n.attrs)
            except ValueError as e:
                raise GraphError(f"node {i} does not type-check ({e}): {n}") from None
            if types != [v.type for v in n.outputs]:
                raise GraphError(f"node {i} output types {[str(t) for t in types]} differ from "
                                 f"the recorded ones: {n}")
            for k in opdef.written(n):
                dst = n.inputs[k]
                if dst.producer is not None:
                    raise GraphError(f"node {i} writes %{dst.name}, which is not a user tensor: {n}")
            for v in n.outputs:
                if v.name in defined:
                    raise GraphError(f"value %{v.name} defined twice: {n}")
                if v.producer is not n:
                    raise GraphError(f"%{v.name} does not point back at its producer: {n}")
                defined[v.name] = v
        for v in self.values():
            for u in v.users:
                if v not in u.inputs:
                    raise GraphError(f"%{v.name} lists a user that does not use it: {u}")
        for v in self.outputs:
            if defined.get(v.name) is not v:
                raise GraphError(f"graph output %{v.name} is not defined")
        return self

    # --- dumps ----------------------------------------------------------------------------
    def __str__(self) -> str:
        ins = ", ".join(f"%{v.name}: {v.type}" for v in self.inputs)
        lines = [f"graph {self.name}({ins}) {{"]
        lines += [f"  {n}" for n in self.nodes]
        lines.append("  return " + ", ".join(f"%{v.name}" for v in self.outputs))
        lines.append("}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Graph {self.name}: {len(self.inputs)} inputs, {len(self.nodes)} nodes>"

    def to_dict(self) -> dict:
        from .serialize import graph_to_dict
        return graph_to_dict(self)

    def to_json(self, indent: "int | None" = 1) -> str:
        from .serialize import to_json
        return to_json(self, indent)

    @classmethod
    def from_json(cls, text: "str | bytes") -> "Graph":
        from .serialize import from_json
        return from_json(text)

    def to_dot(self) -> str:
        from .serialize import to_dot
        return to_dot(self)

    def to_networkx(self):
        from .serialize import to_networkx
        return to_networkx(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]
