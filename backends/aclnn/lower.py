"""Lowering a compiled graph to a :class:`~backends.aclnn.plan.CallPlan` of public aclnn calls.

The lowering table is :data:`ACLNN_LOWERINGS` (l0 op name → function). Free nodes (views,
same-dtype casts, contiguous inputs) become new aclTensors over the same address, and a
redirected ``ViewCopy`` needs no call at all (its source is created over the user's address).
A graph holding nodes no aclnn API runs (the fused kernels of level 2) is lowered as one call of
the public API of the op_api that recorded it (``graph.call``; its spec's ``aclnn_api``).

    >>> import numpy as np, opgraph
    >>> from opgraph.aclnn import aclnnBatchNormElemtBackwardGetWorkspaceSize as ws
    >>> t = {k: opgraph.tensor(np.ones(s, np.float32)) for k, s in
    ...      [("go", (2, 3)), ("x", (2, 3)), ("gi", (2, 3))] + [(k, (3,)) for k in "miwdyc"]}
    >>> with opgraph.opt_level(1):
    ...     _, _, ex = ws(t["go"], t["x"], t["m"], t["i"], t["w"], t["d"], t["y"], t["c"], t["gi"])
    >>> [c.api for c in lower_executor(ex).calls][:3]
    ['aclnnReduceSum', 'aclnnDiv', 'aclnnDiv']
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from opgraph.core.backend import LoweringTable
from opgraph.core.dtypes import DataType
from opgraph.core.ir import Graph, Node, Value
from opgraph.core.memory import MemoryPlan, plan_memory
from opgraph.core.opapi import get_op_api
from opgraph.core.tensor import row_major_strides
from .plan import (Arg, Call, CallPlan, PlanBuffer, TensorDesc, UserBuffer, acl_dtype, acl_format)

COUNTER_ID = "counter_one"


class LoweringError(ValueError):
    """A graph cannot be lowered to aclnn calls; the message quotes the node's dump line."""


# --- argument helpers (used by the lowering table) ----------------------------------------------
def t_arg(name: str, tid: Optional[str]) -> Arg:
    """A tensor argument called ``name`` of tensor id ``tid`` (None: a NULL aclTensor)."""
    return Arg(kind="tensor", name=name, tensor=tid)


def ints_arg(name: str, values: Iterable[int]) -> Arg:
    """An aclIntArray argument called ``name`` holding ``values``."""
    return Arg(kind="int_array", name=name, ints=[int(v) for v in values])


# --- lowering ---------------------------------------------------------------------------------
class Lowerer:
    """State of one lowering: value name → tensor id, the tensors and the calls so far."""

    def __init__(self, graph: Graph, mem: MemoryPlan, bindings: Optional[Mapping[str, Any]] = None):
        self.graph, self.mem, self.bindings = graph, mem, bindings or {}
        self.tensors: dict[str, TensorDesc] = {}
        self.tid: dict[str, str] = {}            # value name -> tensor id
        self.calls: list[Call] = []
        self.plan_buffers: list[PlanBuffer] = []
        self.written: set[str] = set()
        self.users = [self._user(v) for v in graph.inputs]

    # -- buffers and tensors --
    def _user(self, v) -> UserBuffer:
        t = self.bindings.get(v.name)
        shape, strides = v.type.shape, v.type.strides or row_major_strides(v.type.shape)
        offset = int(getattr(t, "offset", 0) or 0)
        extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if math.prod(shape) else 0
        elems = int(t.storage.size) if t is not None else extent
        contiguous_exact = tuple(strides) == row_major_strides(shape) and offset == 0 \
            and elems == math.prod(shape)
        self._add(TensorDesc(id=v.name, dtype=acl_dtype(v.type.dtype), format=acl_format(v.type.format),
                             dims=list(shape), strides=list(strides), offset=offset,
                             storage_dims=list(shape) if contiguous_exact else [elems],
                             buffer="user", user=v.name), v.name)
        return UserBuffer(name=v.name, dtype=acl_dtype(v.type.dtype), elems=elems)

    def _add(self, desc: TensorDesc, value: Optional[str] = None) -> str:
        self.tensors[desc.id] = desc
        if value is not None:
            self.tid[value] = desc.id
        return desc.id

    def scratch(self, tid: str, shape: Sequence[int], dtype: DataType) -> str:
        """A contiguous tensor in a buffer the plan owns (outside the workspace arena)."""
        self.plan_buffers.append(PlanBuffer(name=tid, nbytes=max(math.prod(shape) * DataType(dtype).itemsize, 1)))
        return self._add(TensorDesc(id=tid, dtype=acl_dtype(dtype), dims=list(shape),
                                    strides=list(row_major_strides(shape)),
                                    storage_dims=list(shape), buffer="plan", user=tid))

    def view(self, base: str, tid: str, shape: Sequence[int], strides: Sequence[int],
             dtype: Optional[DataType] = None) -> str:
        """A new aclTensor over ``base``'s memory with other dims/strides (no call)."""
        b = self.tensors[base]
        return self._add(b.model_copy(update={"id": tid, "dims": list(shape), "strides": list(strides),
                                              "dtype": acl_dtype(dtype) if dtype else b.dtype}))

    def new_value(self, v: Value) -> str:
        """The tensor of a node output that owns a buffer (workspace, or a redirected user tensor)."""
        if v.name in self.mem.placed_in:
            dst = self.tensors[self.tid[self.mem.placed_in[v.name]]]
            self.written.add(dst.user or "")
            return self._add(dst.model_copy(update={"id": v.name, "dtype": acl_dtype(v.type.dtype)}),
                             v.name)
        if v.name in self.mem.offsets:
            off, _ = self.mem.offsets[v.name]
            return self._add(TensorDesc(id=v.name, dtype=acl_dtype(v.type.dtype),
                                        format=acl_format(v.type.format), dims=list(v.shape),
                                        strides=list(row_major_strides(v.shape)),
                                        storage_dims=list(v.shape), buffer="workspace",
                                        ws_offset=off), v.name)
        tid = self.scratch(v.name, v.shape, v.type.dtype)  # a graph output that is not a user tensor
        self.tid[v.name] = tid
        return tid

    def of(self, v: Value) -> str:
        """The tensor id of value ``v`` (KeyError until its producer was lowered)."""
        return self.tid[v.name]

    def of_input(self, name: str) -> str:
        """The tensor id of graph input ``%name``."""
        return self.tid[name]

    def call(self, api: str, node: Node, *args: Arg) -> None:
        """Append a call of ``api`` with ``args``, its source the dump line of ``node``."""
        self.calls.append(Call(api=api, args=list(args), source=dump_line(node)))

    def mark_written(self, v: Value) -> None:
        """Record that the user buffer under ``v``'s tensor is written (none: nothing to record)."""
        u = self.tensors[self.of(v)].user
        if u:
            self.written.add(u)

    # -- driver --
    def run(self, level: Optional[int]) -> CallPlan:
        """Lower every node through the table into a :class:`CallPlan` tagged ``level``; if any node
        has no lowering, the whole graph becomes one call of its op_api's public API."""
        steps = [(node, lowering_of(node)) for node in self.graph.nodes]
        if all(fn is not None for _, fn in steps):
            for node, fn in steps:
                fn(self, node)
        else:
            lower_whole_call(self, next(n for n, fn in steps if fn is None))
        for name in self.written:
            for u in self.users:
                if u.name == name:
                    u.written = True
        return CallPlan(op=self.graph.name, level=level, users=self.users,
                        workspace_size=self.mem.size, plan_buffers=self.plan_buffers,
                        tensors=list(self.tensors.values()), calls=self.calls)


def dump_line(node: Node) -> str:
    """The node's one-line dump (a fused body is elided)."""
    return node.header()


def lower(graph: Graph, bindings: Optional[Mapping[str, Any]] = None, level: Optional[int] = None,
          mem: Optional[MemoryPlan] = None) -> CallPlan:
    """Lower ``graph`` (any op_api's graph at any level, or any graph of lowerable nodes) to a
    :class:`CallPlan` whose arena is ``mem`` (default: the graph's memory plan). ``bindings``
    (graph input → opgraph.Tensor) give user views' offsets and storage sizes; without them user
    tensors are taken as exactly their view."""
    return Lowerer(graph, mem if mem is not None else plan_memory(graph), bindings).run(level)


def lower_executor(executor: Any) -> CallPlan:
    """The plan of a phase-1 executor's compiled graph."""
    return lower(executor.compiled, executor.bindings, executor.opt_level, executor.memory_plan)


# --- the lowering table -----------------------------------------------------------------------
def lower_free(L: Lowerer, node: Node) -> None:
    """A node that launches nothing: its output is a view over its input's memory."""
    src, out = L.tensors[L.of(node.inputs[0])], node.outputs[0]
    if node.op == "UnsqueezeNd":
        strides = unsqueeze_strides(src.dims, src.strides, out.shape)
    elif tuple(src.dims) == out.shape:
        strides = src.strides
    else:
        raise LoweringError(f"free node changes the shape in an unsupported way: {dump_line(node)}")
    L.view(src.id, out.name, out.shape, strides, out.type.dtype)
    L.tid[out.name] = out.name


def unsqueeze_strides(dims: Sequence[int], strides: Sequence[int],
                      out_shape: Sequence[int]) -> list[int]:
    """Strides of ``out_shape`` (``dims`` with size-1 dims inserted) over the same memory.

    >>> unsqueeze_strides([3], [1], (1, 3, 1, 1))
    [3, 1, 1, 1]
    """
    out, k = [0] * len(out_shape), len(dims) - 1
    for i in range(len(out_shape) - 1, -1, -1):
        if k >= 0 and out_shape[i] == dims[k] and (out_shape[i] != 1 or len(out_shape) - i <= len(dims) - k):
            out[i] = strides[k]
            k -= 1
        else:
            out[i] = out[i + 1] * out_shape[i + 1] if i + 1 < len(out_shape) else 1
    return out


def lower_cast(L: Lowerer, node: Node) -> None:
    """Cast → ``aclnnCast(self, dtype, out)``."""
    out = L.new_value(node.outputs[0])
    L.call("aclnnCast", node, t_arg("self", L.of(node.inputs[0])),
           Arg(kind="dtype", name="dtype", dtype=acl_dtype(node.attrs.to)), t_arg("out", out))


def lower_reduce_sum(L: Lowerer, node: Node) -> None:
    """ReduceSum → ``aclnnReduceSum(self, dims, keepDims, dtype, out)``, negative axes made positive."""
    x, v = node.inputs[0], node.outputs[0]
    out = L.new_value(v)
    axes = [a % max(x.type.rank, 1) for a in node.attrs.axes]
    L.call("aclnnReduceSum", node, t_arg("self", L.of(x)), ints_arg("dims", axes),
           Arg(kind="bool", name="keepDims", flag=node.attrs.keepdims),
           Arg(kind="dtype", name="dtype", dtype=acl_dtype(v.type.dtype)), t_arg("out", out))


def lower_div(L: Lowerer, node: Node) -> None:
    """RealDiv → ``aclnnDiv(self, other, out)``."""
    out = L.new_value(node.outputs[0])
    L.call("aclnnDiv", node, t_arg("self", L.of(node.inputs[0])), t_arg("other", L.of(node.inputs[1])),
           t_arg("out", out))


def lower_broadcast(L: Lowerer, node: Node) -> None:
    """BroadcastTo → ``aclnnExpand(self, size, out)``."""
    out = L.new_value(node.outputs[0])
    L.call("aclnnExpand", node, t_arg("self", L.of(node.inputs[0])), ints_arg("size", node.attrs.shape),
           t_arg("out", out))


def lower_fill(L: Lowerer, node: Node) -> None:
    """Fill → ``aclnnInplaceOne(selfRef)`` for the value 1, else
    ``aclnnInplaceFillScalar(selfRef, value)`` with an aclScalar of the fill's dtype."""
    out = L.new_value(node.outputs[0])
    if node.attrs.value == 1:
        L.call("aclnnInplaceOne", node, t_arg("selfRef", out))
    else:
        L.call("aclnnInplaceFillScalar", node, t_arg("selfRef", out),
               Arg(kind="scalar", name="value", value=node.attrs.value, dtype=acl_dtype(node.attrs.dtype)))


def lower_copy(L: Lowerer, node: Node) -> None:
    """Contiguous (a strided input) → copy into a workspace tensor; ViewCopy → copy into the user
    tensor, or nothing when redirected (the producer already wrote the user's memory)."""
    if node.op == "ViewCopy":
        L.tid[node.outputs[0].name] = L.of(node.inputs[1])
        L.mark_written(node.inputs[1])
        if node.opdef.redirects(node):
            return
        dst = L.of(node.inputs[1])
    else:
        dst = L.new_value(node.outputs[0])
    L.call("aclnnInplaceCopy", node, t_arg("selfRef", dst), t_arg("src", L.of(node.inputs[0])))


def channel_param(L: Lowerer, v: Value, node: Node) -> str:
    """A [C] tensor holding the per-channel parameter that reaches the kernel broadcast as ``v``.

    Walks back through BroadcastTo / UnsqueezeNd (and a Cast applied after the broadcast) to the
    [C] value, checking that only the channel dim is broadcast from; a full-size Fill is constant.
    A [C] *user* tensor is passed as is. An intermediate [C] value may have been overwritten by
    the memory plan's buffer reuse by the time the kernel runs, so its values are read through a
    [C] view of the (live) kernel input ``v`` with the channel stride instead."""
    full = node.inputs[1].shape
    C = full[1]
    w, ok = v, False
    while w.shape != (C,) and w.producer is not None:
        p = w.producer
        if p.op == "Fill":
            ok = True
            break
        if p.op == "BroadcastTo":
            src = (1,) * (len(full) - p.inputs[0].type.rank) + p.inputs[0].shape
            if any(n != 1 for i, n in enumerate(src) if i != 1):
                break
        elif not (p.op == "UnsqueezeNd" or (p.op == "Cast" and w.shape == full)
                  or (p.op in ("Contiguous", "Cast") and p.opdef.is_free(p))):
            break
        w = p.inputs[0]
    if w.shape == (C,) and w.producer is None:
        return L.of(w)
    if ok or w.shape == (C,):
        base = L.tensors[L.of(v)]
        return L.view(base.id, f"{v.name}_c", (C,), [base.strides[1]])
    raise LoweringError(f"parameter %{v.name} is not a per-channel broadcast, cannot pass it to "
                        f"aclnnBatchNormElemtBackward: {dump_line(node)}")


def counter_one(L: Lowerer, node: Node) -> str:
    """The FLOAT [1] counter holding total count 1 (filled by aclnnInplaceOne once)."""
    if COUNTER_ID not in L.tensors:
        L.scratch(COUNTER_ID, (1,), DataType.FLOAT)
        L.call("aclnnInplaceOne", node, t_arg("selfRef", COUNTER_ID))
    return COUNTER_ID


ELEMT_ARGS = ("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter",
              "gradInput")


def lower_elemt(L: Lowerer, node: Node) -> None:
    """The l0 kernel → the public op with per-channel params, sumDy := meanDy,
    sumDyXmu := meanDyXmu and a counter of total 1 (so the means pass through unchanged)."""
    go, x, mean, invstd, weight, md, mdx = node.inputs
    params = [channel_param(L, p, node) for p in (mean, invstd, weight, md, mdx)]
    cnt = counter_one(L, node)
    out = L.new_value(node.outputs[0])
    tids = [L.of(go), L.of(x), *params[:3], params[3], params[4], cnt, out]
    L.call("aclnnBatchNormElemtBackward", node, *(t_arg(n, t) for n, t in zip(ELEMT_ARGS, tids)))


def lowering_of(node: Node) -> Optional[Callable[[Lowerer, Node], None]]:
    """The node's lowering: a view over its input when it launches nothing, else the table's."""
    if not node.opdef.has_effects and node.inputs and node.opdef.is_free(node):
        return lower_free
    return ACLNN_LOWERINGS.lookup(node.op)


def lower_whole_call(L: Lowerer, bad: Node) -> None:
    """A graph with nodes no aclnn API runs (fused kernels): one call of the public API of the op_api
    that recorded it, on the user tensors, with the recorded scalars and masks."""
    call = L.graph.call
    api = None
    if call is not None:
        try:
            api = get_op_api(call.api).aclnn_api
        except KeyError:
            api = None
    if api is None:
        raise LoweringError(f"no aclnn lowering for node {dump_line(bad)}, and the graph was not "
                            "recorded by an op_api with a public aclnn API to run whole")
    args = []
    for name, kind, value in call.args:
        if kind == "tensor":
            args.append(t_arg(name, None if value is None else L.of_input(value)))
        elif kind == "bool":
            args.append(Arg(kind="bool", name=name, flag=bool(value)))
        else:
            args.append(Arg(kind="int64" if kind == "int" else kind, name=name, value=float(value)))
    for node in L.graph.nodes:
        for k in node.opdef.written(node):
            L.mark_written(node.inputs[k])
    L.calls.append(Call(api=api, args=args, source=f"the whole {call.api} (level-2 graph)"))


ACLNN_LOWERINGS = LoweringTable({
    "Cast": lower_cast,
    "ReduceSum": lower_reduce_sum,
    "RealDiv": lower_div,
    "BroadcastTo": lower_broadcast,
    "Fill": lower_fill,
    "Contiguous": lower_copy,
    "ViewCopy": lower_copy,
    "UnsqueezeNd": lower_free,
    "SyncBatchNormBackwardElemt": lower_elemt,
})
