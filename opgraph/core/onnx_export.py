"""ONNX export, so that Netron (and any ONNX tool) can open a graph: l0 ops are nodes of the
custom domain ``opgraph.l0``, every value is typed, attributes are mapped to ONNX attributes,
and each fused kernel is an ONNX function (domain ``opgraph.fused``) whose body is made of the
elementwise primitives (domain ``opgraph.prim``). Needs the optional ``onnx`` package
(``pip install onnx`` or ``pip install 'opgraph[onnx]'``).

    >>> import l0ops
    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType
    >>> g = Graph("demo"); x = g.add_input("x", TensorType((2, 3), DataType.FLOAT16))
    >>> g.outputs = [g.add_node("Cast", [x], to=DataType.FLOAT).outputs[0]]
    >>> m = to_onnx(g)  # doctest: +SKIP
    >>> m.graph.node[0].op_type, m.graph.node[0].domain  # doctest: +SKIP
    ('Cast', 'opgraph.l0')

ONNX has no in-place writes: a node writing a user tensor (ViewCopy, a storing fused kernel)
takes it as an input, and its ``doc_string`` says that it writes it.
"""
from __future__ import annotations

from typing import Any

from .dtypes import DataType
from .graphdiff import node_key
from .types import format_attr

Graph = Node = Any  # opgraph.core.ir types (ir imports this module)

DOMAIN_L0, DOMAIN_FUSED, DOMAIN_PRIM = "opgraph.l0", "opgraph.fused", "opgraph.prim"
INSTALL_HINT = "pip install onnx (or pip install 'opgraph[onnx]')"
# aclDataType name -> onnx.TensorProto name, where they differ
_ONNX_NAMES = {"BF16": "BFLOAT16", "FLOAT8_E5M2": "FLOAT8E5M2", "FLOAT8_E4M3FN": "FLOAT8E4M3FN",
               "FLOAT8_E8M0": "FLOAT8E8M0", "FLOAT4_E2M1": "FLOAT4E2M1"}


class OnnxUnavailable(RuntimeError):
    """The ``onnx`` package is not installed; the message says how to install it."""


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise OnnxUnavailable(f"ONNX export needs the onnx package: {INSTALL_HINT}") from None
    return onnx


def elem_type(dtype: DataType) -> int:
    """The ``onnx.TensorProto`` element type of ``dtype`` (UNDEFINED where ONNX has none)."""
    tp = _onnx().TensorProto
    return int(getattr(tp, _ONNX_NAMES.get(dtype.name, dtype.name), tp.UNDEFINED))


def _attribute(helper: Any, name: str, value: Any) -> Any:
    """An ONNX attribute: ints, floats and lists of them typed; anything else as its dump text."""
    if isinstance(value, bool):
        return helper.make_attribute(name, int(value))
    if isinstance(value, (int, float)) and not isinstance(value, DataType):
        return helper.make_attribute(name, value)
    if isinstance(value, (tuple, list)) and value and all(
            isinstance(x, (int, float)) and not isinstance(x, (bool, DataType)) for x in value):
        if all(isinstance(x, int) for x in value):
            return helper.make_attribute(name, [int(x) for x in value])
        return helper.make_attribute(name, [float(x) for x in value])
    return helper.make_attribute(name, format_attr(value))


def _node_attrs(helper: Any, node: Node) -> list:
    return [_attribute(helper, k, v) for k, v in node.attr_items() if k != "body" and v is not None]


def _fused_function(helper: Any, node: Node, name: str) -> Any:
    """The fused kernel's body as an ONNX function: inputs in0.. (and ``dst`` when it stores),
    one primitive node per body step, then a final ``store``/``return`` node producing ``out``
    (an element-wise kernel) or one ``return`` node per result producing ``out0``.. (a fused
    reduction, :class:`l0ops.fused_reduce.FusedReduceAttrs`)."""
    a = node.attrs
    store = getattr(a, "store", False)
    n_in = len(node.inputs) - (1 if store else 0)
    inputs = [f"in{k}" for k in range(n_in)] + (["dst"] if store else [])
    nodes = []
    for k, ins in enumerate(a.body):
        attrs = {"dtype": ins.dtype.short}
        if ins.shape is not None:
            attrs["shape"] = list(ins.shape) if ins.shape else "[]"
        if ins.value is not None:
            attrs["value"] = float(ins.value)
        if getattr(ins, "over", None) is not None:  # (an empty list has no ONNX type: "[]")
            attrs["over"] = list(ins.over) if ins.over else "[]"
        nodes.append(helper.make_node(ins.op, list(ins.args), [f"t{k}"], name=f"t{k}",
                                      domain=DOMAIN_PRIM, **attrs))
    results = getattr(a, "results", None)
    if results is not None:
        outputs = [f"out{k}" for k in range(len(results))]
        nodes += [helper.make_node("return", [r], [o], name=f"return{k}", domain=DOMAIN_PRIM)
                  for k, (r, o) in enumerate(zip(results, outputs))]
    else:
        outputs = ["out"]
        last = ["store", [a.result, "dst"]] if store else ["return", [a.result]]
        nodes.append(helper.make_node(last[0], last[1], ["out"], name=last[0], domain=DOMAIN_PRIM))
    return helper.make_function(DOMAIN_FUSED, name, inputs, outputs, nodes,
                                [helper.make_opsetid(DOMAIN_PRIM, 1)])


def to_onnx(graph: Graph) -> Any:
    """The graph as an ``onnx.ModelProto`` (checked with ``onnx.checker.check_model``)."""
    onnx = _onnx()
    helper = onnx.helper

    def info(v: Any) -> Any:
        return helper.make_tensor_value_info(v.name, elem_type(v.dtype), list(v.shape),
                                             doc_string=str(v.type))

    nodes, functions = [], []
    for n in graph.nodes:
        key = node_key(n)
        written = [f"%{n.inputs[k].name}" for k in n.opdef.written(n)]
        doc = n.header() + (f"\nrecorded at {n.source}" if n.source else "") + (
            f"\nwrites user tensor {', '.join(written)}" if written else "")
        op, domain = n.op, DOMAIN_L0
        body = n.opdef.format_body(n.attrs) if n.opdef.format_body is not None else []
        if body and hasattr(n.attrs, "body"):
            op, domain = f"{n.op}_{key}", DOMAIN_FUSED
            functions.append(_fused_function(helper, n, op))
        onode = helper.make_node(op, [v.name for v in n.inputs], [v.name for v in n.outputs],
                                 name=f"%{key}", domain=domain, doc_string=doc)
        onode.attribute.extend(_node_attrs(helper, n))
        nodes.append(onode)
    call = f" (recorded by {graph.call.api})" if getattr(graph, "call", None) is not None else ""
    g = helper.make_graph(nodes, graph.name or "graph", [info(v) for v in graph.inputs],  # (ONNX needs one)
                          [info(v) for v in graph.outputs],
                          value_info=[info(v) for n in graph.nodes for v in n.outputs
                                      if v not in graph.outputs],
                          doc_string=f"opgraph graph {graph.name}{call}")
    domains = [DOMAIN_L0] + ([DOMAIN_FUSED, DOMAIN_PRIM] if functions else [])
    model = helper.make_model(g, producer_name="opgraph", functions=functions,
                              opset_imports=[helper.make_opsetid(d, 1) for d in domains])
    onnx.checker.check_model(model)
    return model


__all__ = ["DOMAIN_FUSED", "DOMAIN_L0", "DOMAIN_PRIM", "INSTALL_HINT", "OnnxUnavailable",
           "elem_type", "to_onnx"]
