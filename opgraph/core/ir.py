"""The IR: typed SSA values, nodes (one l0 op call each) and graphs.

    >>> from opgraph.core.dtypes import DataType
    >>> import l0ops
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
Nodes remember the source line that recorded them (``node.source``). Dumps (JSON, DOT,
networkx) are functions in :mod:`opgraph.core.serialize` that the ``Graph.to_*`` methods call;
``to_html`` and ``to_onnx`` call :mod:`opgraph.core.html` and :mod:`opgraph.core.onnx_export`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from pydantic import BaseModel

from . import html, onnx_export, serialize
from .dtypes import DataType
from .opdef import L0Error, OpDef, get_op
from .types import GraphError, RecordedCall, TensorType, format_attr

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["Graph", "GraphError", "Node", "TensorType", "Value"]

class Value:
    """An SSA value: a name, a type, the node producing it (None for graph inputs), its users."""

    __slots__ = ("name", "type", "producer", "users")

    def __init__(self, name: str, type: TensorType, producer: "Node | None" = None):
        self.name, self.type, self.producer = name, type, producer
        self.users: list[Node] = []

    @property
    def shape(self) -> tuple[int, ...]:
        """The value's shape (of its :class:`TensorType`)."""
        return self.type.shape

    @property
    def dtype(self) -> DataType:
        """The value's element type (of its :class:`TensorType`)."""
        return self.type.dtype

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


class Node:
    """One call of an l0 op: ``outputs = op(inputs, attrs)``; ``source`` is where it was recorded."""

    __slots__ = ("op", "inputs", "attrs", "outputs", "source")

    def __init__(self, op: str, inputs: Sequence[Value], attrs: BaseModel,
                 source: Optional[str] = None):
        self.op, self.inputs, self.attrs, self.source = op, list(inputs), attrs, source
        self.outputs: list[Value] = []

    @property
    def opdef(self) -> OpDef:
        """The registered definition of :attr:`op` (KeyError for an op not registered)."""
        return get_op(self.op)

    def attr_items(self) -> list[tuple[str, Any]]:
        """Attributes in declaration order."""
        return [(k, getattr(self.attrs, k)) for k in type(self.attrs).model_fields]

    def header(self) -> str:
        """The node's dump line without its body (attributes at their default are elided)."""
        lhs = ", ".join(f"%{v.name}: {v.type}" for v in self.outputs)
        args = [f"%{v.name}" for v in self.inputs]
        fields = type(self.attrs).model_fields
        args += [f"{k}={format_attr(v)}" for k, v in self.attr_items()
                 if k != "body" and not (not fields[k].is_required() and v == fields[k].default)]
        return f"{lhs} = {self.op}({', '.join(args)})"

    def __str__(self) -> str:
        line = self.header()
        try:
            fmt = self.opdef.format_body
        except KeyError:  # an unregistered op (a graph that fails verify) prints without a body
            fmt = None
        body = fmt(self.attrs) if fmt is not None else []
        if body:
            line += " {\n" + "\n".join("      " + b for b in body) + "\n  }"
        return line

    __repr__ = __str__


class Graph:
    """A recorded op_api graph: named inputs (user tensors), nodes in emission order, outputs."""

    def __init__(self, name: str = "graph", call: Optional[RecordedCall] = None):
        self.name = name
        self.call = call  # the op_api call that recorded this graph, if any
        self.inputs: list[Value] = []
        self.nodes: list[Node] = []
        self.outputs: list[Value] = []
        self._next = 0

    # --- building -------------------------------------------------------------------------
    def add_input(self, name: str, type: TensorType, *, unique: bool = False) -> Value:
        """A new graph input; ``unique``: the caller knows no other input has ``name``
        (a loader that checked, saving a scan of the inputs per input)."""
        if not unique and any(v.name == name for v in self.inputs):
            raise GraphError(f"graph input %{name} defined twice")
        v = Value(name, type)
        self.inputs.append(v)
        self._claim(name)
        return v

    def fresh_name(self) -> str:
        """The next unused numeric value name (``"0"``, ``"1"`` ...), past any number given as an
        input's name; add_node names outputs with it when no names are given."""
        name = str(self._next)
        self._next += 1
        return name

    def _claim(self, name: str) -> None:
        """Keep :meth:`fresh_name` past a number given as a name (an input ``%42``)."""
        if name.isascii() and name.isdigit():
            self._next = max(self._next, int(name) + 1)

    def add_node(self, op: str, inputs: Sequence[Value], attrs: "BaseModel | None" = None,
                 *, out_names: "Sequence[str] | None" = None, index: "int | None" = None,
                 source: Optional[str] = None, out_types: "Sequence[TensorType] | None" = None,
                 **attr_kwargs: Any) -> Node:
        """Append (or insert at ``index``) a call of ``op``; output types are inferred unless
        given (``out_types``: for callers that derive them from a graph already checked). An
        unknown op is a GraphError; operands that are not values and attributes of another op's
        model are L0Errors naming the op."""
        try:
            opdef = get_op(op)
        except KeyError as e:
            raise GraphError(e.args[0]) from None
        if attrs is None:
            attrs = opdef.make_attrs(**attr_kwargs)
        elif type(attrs) is not opdef.attrs:
            raise L0Error(f"{op}: attributes must be {opdef.attrs.__name__}, got {type(attrs).__name__}")
        for i, v in enumerate(inputs):
            if type(v) is not Value:
                raise L0Error(f"{op}: input {i} is not a graph value: {type(v).__name__}")
        if out_types is None:
            out_types = opdef.infer_types([v.type for v in inputs], attrs)
        if out_names:
            names = list(out_names)
            for name in names:
                self._claim(name)
        else:
            names = [self.fresh_name() for _ in out_types]
        return self.add_typed_node(op, inputs, attrs, list(zip(names, out_types)), source, index)

    def add_typed_node(self, op: str, inputs: Sequence[Value], attrs: BaseModel,
                       outputs: Sequence[tuple[str, TensorType]], source: Optional[str] = None,
                       index: "int | None" = None) -> Node:
        """Append (or insert at ``index``) a call whose output names and types are given:
        nothing looked up or inferred, for a graph rebuilt from one already checked (a copy,
        the same graph at other sizes)."""
        node = Node(op, inputs, attrs, source)
        node.outputs = [Value(n, t, node) for n, t in outputs]
        for v in node.inputs:
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
        """Every value: the inputs, then each node's outputs in node order."""
        yield from self.inputs
        for n in self.nodes:
            yield from n.outputs

    def copy(self) -> "Graph":
        """A deep structural copy (attrs are frozen and shared)."""
        g = type(self)(self.name, self.call)
        g._next = self._next
        env = {id(v): g.add_input(v.name, v.type) for v in self.inputs}
        for n in self.nodes:
            m = g.add_typed_node(n.op, [env[id(v)] for v in n.inputs], n.attrs,
                                 [(v.name, v.type) for v in n.outputs], n.source)
            for old, new in zip(n.outputs, m.outputs):
                env[id(old)] = new
        g.outputs = [env[id(v)] for v in self.outputs]
        return g

    # --- checking -------------------------------------------------------------------------
    def verify(self) -> "Graph":
        """Check SSA, definition order, user lists, re-inferred types and effects; returns self."""
        defined: dict[str, Value] = {}
        for v in self.inputs:
            if v.name in defined:
                raise GraphError(f"value %{v.name} defined twice")
            defined[v.name] = v
        users = {id(v): {id(u) for u in v.users} for v in self.values()}  # (a list scan per use
        # made a value with thousands of users quadratic)
        for i, n in enumerate(self.nodes):
            try:
                opdef = get_op(n.op)
            except KeyError as e:
                raise GraphError(f"node {i}: {e.args[0]}: {n.header()}") from None
            for v in n.inputs:
                if defined.get(v.name) is not v:
                    raise GraphError(f"node {i} uses %{v.name} before it is defined: "
                                     f"{n.header()}")
                if id(n) not in users[id(v)]:
                    raise GraphError(f"node {i} is missing from the users of %{v.name}: "
                                     f"{n.header()}")
            try:
                types = opdef.infer_types([v.type for v in n.inputs], n.attrs)
            except ValueError as e:
                raise GraphError(f"node {i} does not type-check ({e}): {n.header()}") from None
            if types != [v.type for v in n.outputs]:
                raise GraphError(f"node {i} output types {[str(t) for t in types]} differ from "
                                 f"the recorded ones: {n.header()}")
            for k in opdef.written(n):
                dst = n.inputs[k]
                if dst.producer is not None:
                    raise GraphError(f"node {i} writes %{dst.name}, which is not a user tensor: "
                                     f"{n.header()}")
            for v in n.outputs:
                if v.name in defined:
                    raise GraphError(f"value %{v.name} defined twice: {n.header()}")
                if v.producer is not n:
                    raise GraphError(f"%{v.name} does not point back at its producer: {n.header()}")
                defined[v.name] = v
        for v in self.values():
            for u in v.users:
                if v not in u.inputs:
                    raise GraphError(f"%{v.name} lists a user that does not use it: {u.header()}")
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
        """The graph as plain JSON data (:func:`opgraph.core.serialize.graph_to_dict`)."""
        return serialize.graph_to_dict(self)

    def to_json(self, indent: "int | None" = 1) -> str:
        """The schema-versioned JSON dump (:func:`opgraph.core.serialize.to_json`; non-finite floats
        as strings); ``indent=None`` writes one line."""
        return serialize.to_json(self, indent)

    @classmethod
    def from_json(cls, text: "str | bytes") -> "Graph":
        """Rebuild a graph from :meth:`to_json` output (data only; never executes code)."""
        return serialize.from_json(text, cls)

    def to_dot(self) -> str:
        """Graphviz DOT text (:func:`opgraph.core.serialize.to_dot`); nodes that write in place are shaded."""
        return serialize.to_dot(self)

    def to_networkx(self) -> "nx.MultiDiGraph":
        """A ``networkx.MultiDiGraph`` of the graph (:func:`opgraph.core.serialize.to_networkx`;
        needs networkx)."""
        return serialize.to_networkx(self)

    def to_html(self, times: "dict[str, float] | None" = None, engine: Optional[str] = None) -> str:
        """A self-contained HTML page drawing the graph (:mod:`opgraph.core.html`); ``times``:
        seconds per node, keyed by the node's first output name."""
        return html.graph_html(self, times=times, engine=engine)

    def to_onnx(self) -> Any:
        """An ``onnx.ModelProto`` of the graph, for Netron (needs ``pip install onnx``;
        :mod:`opgraph.core.onnx_export`)."""
        return onnx_export.to_onnx(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]
