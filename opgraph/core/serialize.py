"""Graph dumps: JSON (schema-versioned, validated, never executed), DOT and networkx.

    >>> import l0ops
    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType
    >>> g = Graph("g"); x = g.add_input("x", TensorType((2,), DataType.FLOAT))
    >>> g.outputs = [g.add_node("Cast", [x], to=DataType.FLOAT16).outputs[0]]
    >>> Graph.from_json(g.to_json()) == g
    True
"""
from __future__ import annotations

import json
import math
import types
import typing
from typing import TYPE_CHECKING, Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from .dtypes import DataType, Format, dtype_of, format_of
from .opdef import get_op
from .tensor import MAX_RANK
from .types import GraphError, RecordedCall, TensorType, format_attr

if TYPE_CHECKING:
    import networkx as nx

# This module works on graph objects (opgraph.core.ir.Graph) without importing ir: ir imports it.
Graph = Node = Value = Any

SCHEMA = "opgraph.graph"
SCHEMA_VERSION = 1
INT64_LIMIT = 1 << 63  # aclTensor dims and strides are int64


def printable(text: str, what: str) -> str:
    """``text`` if every output can carry it — no control character (a NUL breaks DOT, an ESC
    a terminal), no lone surrogate (no encoding writes it) — else ValueError naming ``what``.

    >>> printable("mean", "value name")
    'mean'
    """
    bad = next((c for c in text if c < " " and c not in "\t\n" or c == "\x7f"
                or "\ud800" <= c <= "\udfff"), None)
    if bad is not None:
        raise ValueError(f"{what} {text!r} holds {bad!r}, which no graph output can carry")
    return text


def _check_values(value: Any, what: str) -> None:
    """Every string in a JSON value :func:`printable`, every integer an int64 (what ONNX and
    the C backends take)."""
    if isinstance(value, str):
        printable(value, what)
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -INT64_LIMIT <= value < INT64_LIMIT:
            raise ValueError(f"{what} {value} is outside int64")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_values(k, what)
            _check_values(v, what)
    elif isinstance(value, list):
        for v in value:
            _check_values(v, what)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ValueModel(_Strict):
    """One value of the JSON dump: name, shape, dtype and format names, strides (user tensors
    only); validated on load (rank ≤ MAX_RANK, dims and strides in [0, 2**63))."""

    name: str
    shape: list[int]
    dtype: str
    format: str = "ND"
    strides: Optional[list[int]] = None

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        dtype_of(v)
        return v

    @field_validator("format")
    @classmethod
    def _format(cls, v: str) -> str:
        format_of(v)
        return v

    @field_validator("shape", "strides")
    @classmethod
    def _dims(cls, v: "list[int] | None") -> "list[int] | None":
        if v is not None:
            if len(v) > MAX_RANK:
                raise ValueError(f"rank {len(v)} > {MAX_RANK}")
            if any(not 0 <= n < INT64_LIMIT for n in v):
                raise ValueError("dims and strides must be in [0, 2**63)")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v or any(c in v for c in " \t\n%\"{}"):
            raise ValueError(f"bad value name {v!r}")
        return printable(v, "value name")

    @model_validator(mode="after")
    def _strides_rank(self) -> "ValueModel":
        if self.strides is not None and len(self.strides) != len(self.shape):
            raise ValueError(f"%{self.name}: {len(self.strides)} strides for rank {len(self.shape)}")
        return self

    def to_type(self) -> TensorType:
        """The :class:`TensorType` this model describes."""
        return TensorType(tuple(self.shape), dtype_of(self.dtype), format_of(self.format),
                          None if self.strides is None else tuple(self.strides))

    @classmethod
    def of(cls, v: Value) -> "ValueModel":
        """The model of value ``v`` (a graph input or a node output)."""
        t = v.type
        return cls(name=v.name, shape=list(t.shape), dtype=t.dtype.name, format=t.format.name,
                   strides=None if t.strides is None else list(t.strides))


class NodeModel(_Strict):
    """One node of the JSON dump: op, operand value names, attrs (JSON values, checked by the op's
    model on load), output values, and the source line that recorded it (or None)."""

    op: str
    inputs: list[str]
    attrs: dict[str, Any] = {}
    outputs: list[ValueModel]
    source: Optional[str] = None

    @field_validator("attrs")
    @classmethod
    def _values(cls, v: dict) -> dict:
        _check_values(v, "attribute")
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: "str | None") -> "str | None":
        return None if v is None else printable(v, "node source")


def _name_field(v: str, what: str) -> str:
    """An identifier (an op_api or a parameter of one: a backend may spell it in code it
    generates, such as emit-cpp's variables)."""
    if not v.isidentifier():
        raise ValueError(f"{what} {v!r} is not an identifier")
    return v


class CallArgModel(_Strict):
    """One argument of the recorded op_api call; ``value`` must suit ``kind``: a tensor's
    parameter name or None (NULL), a number for double/float (or ``"inf"``, ``"-inf"``,
    ``"nan"``), an int64 for int, true/false for bool.

    >>> CallArgModel(name="eps", kind="double", value="nan").value
    'nan'
    """

    name: str
    kind: str
    value: Any = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _name_field(v, "call argument name")

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in ("tensor", "double", "float", "int", "bool"):
            raise ValueError(f"bad call argument kind {v!r}")
        return v

    @model_validator(mode="after")
    def _value_of_kind(self) -> "CallArgModel":
        v = self.value
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        ok = {"tensor": v is None or isinstance(v, str) and v.isidentifier(),
              "double": number or v in NON_FINITE, "float": number or v in NON_FINITE,
              "int": number and isinstance(v, int), "bool": isinstance(v, bool)}[self.kind]
        if not ok:
            raise ValueError(f"call argument {self.name!r} of kind {self.kind} has the value {v!r}")
        _check_values(v, f"call argument {self.name!r}")
        return self


class CallModel(_Strict):
    """The recorded op_api call in the JSON dump (:class:`RecordedCall`): api name and arguments."""

    api: str
    args: list[CallArgModel]

    @field_validator("api")
    @classmethod
    def _api(cls, v: str) -> str:
        return _name_field(v, "call api")

    def to_call(self) -> RecordedCall:
        """The :class:`RecordedCall`; ``"inf"``, ``"-inf"`` and ``"nan"`` become floats again."""
        return RecordedCall(self.api, tuple(
            (a.name, a.kind, float(a.value) if a.kind in ("double", "float") and a.value in NON_FINITE
             else a.value) for a in self.args))


class GraphModel(_Strict):
    """The whole JSON dump: ``schema`` and ``version``, the graph's name, the recorded call (or
    None), inputs, nodes in order, output value names."""

    schema_: str = SCHEMA
    version: int = SCHEMA_VERSION
    name: str
    call: Optional[CallModel] = None
    inputs: list[ValueModel]
    nodes: list[NodeModel]
    outputs: list[str]

    model_config = ConfigDict(populate_by_name=True)  # (and _Strict's settings: pydantic merges them)

    @field_validator("name")
    @classmethod
    def _graph_name(cls, v: str) -> str:
        if not v:
            raise ValueError("the graph name is empty")
        return printable(v, "graph name")

    def __init__(self, **data: Any):
        if "schema" in data:
            data["schema_"] = data.pop("schema")
        super().__init__(**data)


def graph_to_dict(g: Graph) -> dict:
    """A plain-JSON dict of the graph (the JSON dump before encoding)."""
    return {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "name": g.name,
        "call": None if g.call is None else {
            "api": g.call.api, "args": [{"name": n, "kind": k, "value": v} for n, k, v in g.call.args]},
        "inputs": [ValueModel.of(v).model_dump() for v in g.inputs],
        "nodes": [{"op": n.op, "inputs": [v.name for v in n.inputs],
                   "attrs": n.attrs.model_dump(mode="json"),
                   "outputs": [ValueModel.of(v).model_dump() for v in n.outputs],
                   "source": n.source} for n in g.nodes],
        "outputs": [v.name for v in g.outputs],
    }


def to_json(g: Graph, indent: "int | None" = 1) -> str:
    """Standard JSON (what any parser reads): a float attribute or call argument that is not
    finite is written as the string ``"inf"``, ``"-inf"`` or ``"nan"``, which loading turns
    back into the float."""
    return json.dumps(_finite(graph_to_dict(g)), indent=indent, allow_nan=False)


NON_FINITE = ("inf", "-inf", "nan")


def _finite(value: Any) -> Any:
    """``value`` (a JSON-ready dict/list tree) with every non-finite float as its string."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _takes_float(annotation: Any) -> bool:
    if annotation is float:
        return True
    return (typing.get_origin(annotation) in (typing.Union, types.UnionType)
            and any(_takes_float(a) for a in typing.get_args(annotation)))


def _item_model(annotation: Any) -> "type[BaseModel] | None":
    """The model class a field holds, alone or as the items of a tuple/list (a fused body)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(_item_model, typing.get_args(annotation))), None)


def _revived(model: "type[BaseModel]", attrs: Any) -> Any:
    """``attrs`` with :data:`NON_FINITE` strings back as floats where ``model``'s field takes a
    float, in nested models too — the one string a strictly validated number may be."""
    if not isinstance(attrs, dict):
        return attrs
    out = dict(attrs)
    for k, v in attrs.items():
        field = model.model_fields.get(k)
        if field is None:
            continue
        if isinstance(v, str) and v in NON_FINITE and _takes_float(field.annotation):
            out[k] = float(v)
        elif isinstance(v, list) and (item := _item_model(field.annotation)) is not None:
            out[k] = [_revived(item, x) for x in v]
    return out


def from_json(text: "str | bytes", graph_cls: type) -> Graph:
    """Rebuild a ``graph_cls`` from :func:`to_json` output. Only data is read: op names must be
    registered l0 ops, attrs are validated by the op's model, and the result is verified."""
    try:
        raw = json.loads(text)
    except RecursionError:
        raise GraphError("graph JSON is malformed: nested too deeply") from None
    except (ValueError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError, huge integers
        raise GraphError(f"graph JSON is malformed: {e}") from None
    try:
        return _graph_from_raw(raw, graph_cls)
    except RecursionError:
        raise GraphError("graph JSON is invalid: nested too deeply") from None
    except GraphError as e:
        raise GraphError(_clipped(str(e))) from None
    except (ValueError, TypeError, KeyError, OverflowError) as e:  # a rule the checks above missed
        raise GraphError(_clipped(f"graph JSON is invalid: {type(e).__name__}: {e}")) from None


MAX_ERROR = 1000  # characters of a loading error: the file's values it quotes may be huge


def _clipped(message: str) -> str:
    """``message`` cut after :data:`MAX_ERROR` characters (a megabyte op name in a file is
    quoted in the error naming it).

    >>> _clipped("x" * 1005)[-30:], _clipped("short")
    ('xxxxxxx... (5 more characters)', 'short')
    """
    if len(message) <= MAX_ERROR:
        return message
    return f"{message[:MAX_ERROR]}... ({len(message) - MAX_ERROR} more characters)"


def _graph_from_raw(raw: Any, graph_cls: type) -> Graph:
    """:func:`from_json` after decoding: schema, model validation, rebuild, verify."""
    if not isinstance(raw, dict):
        raise GraphError("graph JSON must be an object")
    if raw.get("schema") != SCHEMA:
        raise GraphError(f"not an opgraph graph: schema is {raw.get('schema')!r}, expected {SCHEMA!r}")
    if raw.get("version") != SCHEMA_VERSION:
        raise GraphError(f"unsupported graph schema version {raw.get('version')!r} "
                         f"(this opgraph reads version {SCHEMA_VERSION})")
    try:
        model = GraphModel(**raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(map(str, err["loc"]))
        raise GraphError(f"graph JSON is invalid at {loc}: {err['msg']}") from None
    g = graph_cls(model.name, None if model.call is None else model.call.to_call())
    env: dict[str, Value] = {}
    for vm in model.inputs:
        if vm.name in env:
            raise GraphError(f"graph JSON input %{vm.name} defined twice")
        env[vm.name] = g.add_input(vm.name, vm.to_type(), unique=True)
    for i, nm in enumerate(model.nodes):
        try:
            opdef = get_op(nm.op)
        except KeyError as e:
            raise GraphError(f"graph JSON node {i}: {e.args[0]}") from None
        try:
            args = [env[name] for name in nm.inputs]
        except KeyError as e:
            raise GraphError(f"graph JSON node {i} ({nm.op}) uses undefined value %{e.args[0]}") from None
        try:
            attrs = opdef.attrs_from_json(json.dumps(_revived(opdef.attrs, nm.attrs)))
        except ValueError as e:
            raise GraphError(f"graph JSON node {i}: {e}") from None
        try:
            node = g.add_node(nm.op, args, attrs, out_names=[o.name for o in nm.outputs],
                              source=nm.source)
        except ValueError as e:
            raise GraphError(f"graph JSON node {i} ({nm.op}) does not type-check: {e}") from None
        for v, vm in zip(node.outputs, nm.outputs):
            if v.type != vm.to_type():
                raise GraphError(f"graph JSON node {i}: recorded type of %{vm.name} "
                                 f"({vm.to_type()}) differs from the inferred {v.type}: "
                                 f"{node.header()}")
            if vm.name in env:
                raise GraphError(f"graph JSON node {i}: value %{vm.name} defined twice")
            env[vm.name] = v
        if len(node.outputs) != len(nm.outputs):
            raise GraphError(f"graph JSON node {i}: {nm.op} has {len(node.outputs)} outputs, "
                             f"{len(nm.outputs)} recorded")
    try:
        g.outputs = [env[name] for name in model.outputs]
    except KeyError as e:
        raise GraphError(f"graph JSON output %{e.args[0]} is not defined") from None
    return g.verify()


# --- DOT ----------------------------------------------------------------------------------
def _q(s: str) -> str:
    """A DOT double-quoted string with quotes, backslashes and newlines escaped."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _node_label(n: Node) -> str:
    attrs = ", ".join(f"{k}={format_attr(v)}" for k, v in n.attr_items() if k != "body")
    return n.op + (f"\n{attrs}" if attrs else "")


def to_dot(g: Graph) -> str:
    """Graphviz DOT: one box per node, an ellipse per graph input, edges labelled with types."""
    lines = [f"digraph {_q(g.name)} {{", "  rankdir=TB;", '  node [fontname="monospace"];']
    for v in g.inputs:
        lines.append(f"  {_q('in:' + v.name)} [shape=ellipse, label={_q('%' + v.name + chr(10) + str(v.type))}];")
    ids = {}
    for i, n in enumerate(g.nodes):
        ids[id(n)] = f"n{i}"
        style = ', style=filled, fillcolor="#ffe0e0"' if n.opdef.has_effects else ""
        lines.append(f"  n{i} [shape=box, label={_q(_node_label(n))}{style}];")
    for i, n in enumerate(g.nodes):
        for v in n.inputs:
            src = ids[id(v.producer)] if v.producer is not None else _q("in:" + v.name)
            lines.append(f"  {src} -> n{i} [label={_q('%' + v.name + ' ' + str(v.type))}];")
    for k, v in enumerate(g.outputs):
        lines.append(f"  {_q('out:' + str(k))} [shape=doublecircle, label={_q('out ' + '%' + v.name)}];")
        src = ids[id(v.producer)] if v.producer is not None else _q("in:" + v.name)
        lines.append(f"  {src} -> {_q('out:' + str(k))};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_networkx(g: Graph) -> "nx.MultiDiGraph":
    """A MultiDiGraph: nodes ``in:<name>`` for inputs and ``n<i>`` for ops (attrs op, attrs,
    node), one edge per operand use keyed by operand index, with the value's name and type."""
    import networkx as nx  # on demand: its import is ~0.19 s of every process otherwise
    G = nx.MultiDiGraph(name=g.name)
    for v in g.inputs:
        G.add_node(f"in:{v.name}", kind="input", value=v.name, type=str(v.type))
    ids = {}
    for i, n in enumerate(g.nodes):
        ids[id(n)] = f"n{i}"
        G.add_node(f"n{i}", kind="op", op=n.op, attrs=n.attrs.model_dump(mode="json"),
                   outputs=[v.name for v in n.outputs], text=str(n))
    for i, n in enumerate(g.nodes):
        for k, v in enumerate(n.inputs):
            src = ids[id(v.producer)] if v.producer is not None else f"in:{v.name}"
            G.add_edge(src, f"n{i}", key=k, value=v.name, type=str(v.type))
    return G


__all__ = ["to_json", "from_json", "to_dot", "to_networkx", "graph_to_dict", "SCHEMA_VERSION",
           "DataType", "Format"]
