"""Lowering an opgraph graph to a *call plan* of public aclnn C API calls (reference §4, §5).

A plan is plain data (pydantic, JSON round-trippable): the user buffers, the workspace arena size,
every aclTensor to create (dtype, format, view dims/strides/offset, storage dims and the buffer it
lives in) and the aclnn calls in order, each run with the two-phase pattern
``<api>GetWorkspaceSize(args..., &ws, &executor)`` → allocate ``ws`` → ``<api>(ws, executor)``.

    >>> import numpy as np, opgraph
    >>> from opgraph.aclnn import aclnnBatchNormElemtBackwardGetWorkspaceSize as ws
    >>> t = {k: opgraph.tensor(np.ones(s, np.float32)) for k, s in
    ...      [("go", (2, 3)), ("x", (2, 3)), ("gi", (2, 3))] + [(k, (3,)) for k in "miwdyc"]}
    >>> with opgraph.opt_level(1):
    ...     _, _, ex = ws(t["go"], t["x"], t["m"], t["i"], t["w"], t["d"], t["y"], t["c"], t["gi"])
    >>> [c.api for c in lower(ex.compiled, ex.bindings).calls][:3]
    ['aclnnReduceSum', 'aclnnDiv', 'aclnnDiv']

The lowering table is :data:`LOWERINGS` (l0 op name → function); free nodes (views, same-dtype
casts, contiguous inputs) become new aclTensors over the same address, and a redirected
``ViewCopy`` needs no call at all (its source is created over the user's address).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Literal, Mapping, Optional

from pydantic import BaseModel, Field

from opgraph.dtypes import DataType, Format
from opgraph.memory import ALIGN, align_up, plan_memory
from opgraph.tensor import row_major_strides

BNEB = "aclnnBatchNormElemtBackward"
BNEB_ARGS = ("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter",
             "gradInput")
COUNTER_ID = "counter_one"


class LoweringError(ValueError):
    """A graph cannot be lowered to aclnn calls; the message quotes the node's dump line."""


# --- the plan data model -----------------------------------------------------------------------
class UserBuffer(BaseModel):
    """A user tensor's memory: ``elems`` elements of ``dtype``; ``written`` if a call writes it."""

    name: str
    dtype: str
    elems: int
    written: bool = False


class TensorDesc(BaseModel):
    """One ``aclCreateTensor``: buffer is ``user`` (named user buffer) or ``workspace`` (byte
    offset into the arena)."""

    id: str
    dtype: str                      # aclDataType enumerator, e.g. "ACL_FLOAT16"
    format: str = "ACL_FORMAT_ND"   # aclFormat enumerator
    dims: list[int]
    strides: list[int]
    offset: int = 0                 # element offset of the view
    storage_dims: list[int]
    buffer: Literal["user", "workspace"]
    user: Optional[str] = None
    ws_offset: int = 0


class Arg(BaseModel):
    """One argument of a phase-1 call: an aclTensor (``tensor`` id, None = NULL), an aclIntArray,
    an aclScalar, an aclDataType or a bool."""

    kind: Literal["tensor", "int_array", "scalar", "dtype", "bool"]
    name: str
    tensor: Optional[str] = None
    ints: list[int] = Field(default_factory=list)
    value: float = 0.0
    dtype: str = ""
    flag: bool = False


class Call(BaseModel):
    """One aclnn API used in the two-phase pattern; ``source`` is the lowered node's dump line."""

    api: str
    args: list[Arg]
    source: str = ""

    @property
    def phase1(self) -> str:
        return self.api + "GetWorkspaceSize"


class CallPlan(BaseModel):
    """Everything a host program or runtime needs to run the graph with real aclnn calls."""

    op: str
    level: Optional[int] = None
    users: list[UserBuffer]
    workspace_size: int
    tensors: list[TensorDesc]
    calls: list[Call]

    def to_json(self, indent: Optional[int] = 1) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: "str | bytes") -> "CallPlan":
        return cls.model_validate_json(text)

    def tensor(self, tid: str) -> TensorDesc:
        return next(t for t in self.tensors if t.id == tid)

    def listing(self) -> str:
        """A readable listing: buffers, tensors and the calls in order."""
        out = [f"plan {self.op} (level {self.level}): {len(self.calls)} calls, "
               f"workspace arena {self.workspace_size} B"]
        for u in self.users:
            out.append(f"  user {u.name}: {u.dtype}[{u.elems}]{' (written)' if u.written else ''}")
        for t in self.tensors:
            where = f"user {t.user}" if t.buffer == "user" else f"ws+{t.ws_offset}"
            out.append(f"  tensor {t.id}: {t.dtype} dims={t.dims} strides={t.strides} "
                       f"offset={t.offset} storage={t.storage_dims} @ {where}")
        for i, c in enumerate(self.calls):
            out.append(f"  [{i}] {c.api}({', '.join(fmt_arg(a) for a in c.args)})")
        return "\n".join(out)


def fmt_arg(a: Arg) -> str:
    """How an argument prints in :meth:`CallPlan.listing`."""
    if a.kind == "tensor":
        return a.tensor or "NULL"
    if a.kind == "int_array":
        return "[" + ",".join(map(str, a.ints)) + "]"
    if a.kind == "scalar":
        return f"{a.value!r}:{a.dtype}"
    return a.dtype if a.kind == "dtype" else str(a.flag).lower()


def acl_dtype(d: DataType) -> str:
    return DataType(d).acl_name


def dtype_from_acl(name: str) -> DataType:
    """``"ACL_FLOAT16"`` → ``DataType.FLOAT16``."""
    return DataType[name[4:]]


def format_from_acl(name: str) -> Format:
    """``"ACL_FORMAT_NCHW"`` → ``Format.NCHW``."""
    return Format[name.replace("ACL_FORMAT_", "").replace("ACL_", "")]


def acl_format(f: Format) -> str:
    """``Format.ND`` → ``"ACL_FORMAT_ND"`` (the three old fractal names have no FORMAT_ part)."""
    name = Format(f).name
    return ("ACL_" if name in ("FRACTAL_Z", "FRACTAL_NZ", "FRACTAL_Z_3D") else "ACL_FORMAT_") + name


# --- argument helpers (used by the lowering table) ----------------------------------------------
def t_arg(name: str, tid: Optional[str]) -> Arg:
    return Arg(kind="tensor", name=name, tensor=tid)


def ints_arg(name: str, values) -> Arg:
    return Arg(kind="int_array", name=name, ints=[int(v) for v in values])


# --- lowering ---------------------------------------------------------------------------------
class Lowerer:
    """State of one lowering: value name → tensor id, the tensors and the calls so far."""

    def __init__(self, graph, bindings: Optional[Mapping[str, Any]] = None):
        self.graph, self.bindings = graph, bindings or {}
        self.mem = plan_memory(graph)
        self.tensors: dict[str, TensorDesc] = {}
        self.tid: dict[str, str] = {}            # value name -> tensor id
        self.calls: list[Call] = []
        self.extra = align_up(self.mem.size) if self.mem.size else 0  # arena tail for plan scratch
        self.written: set[str] = set()
        self.redirect = {n.inputs[0].name: n.inputs[1] for n in graph.nodes
                         if n.op == "ViewCopy" and n.attrs.redirect}
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

    def scratch(self, tid: str, shape, dtype: DataType) -> str:
        """A contiguous tensor in the plan's own part of the arena (after the memory plan)."""
        off = self.extra
        self.extra += align_up(max(math.prod(shape) * DataType(dtype).itemsize, 1), ALIGN)
        return self._add(TensorDesc(id=tid, dtype=acl_dtype(dtype), dims=list(shape),
                                    strides=list(row_major_strides(shape)),
                                    storage_dims=list(shape), buffer="workspace", ws_offset=off))

    def view(self, base: str, tid: str, shape, strides, dtype: Optional[DataType] = None) -> str:
        """A new aclTensor over ``base``'s memory with other dims/strides (no call)."""
        b = self.tensors[base]
        return self._add(b.model_copy(update={"id": tid, "dims": list(shape), "strides": list(strides),
                                              "dtype": acl_dtype(dtype) if dtype else b.dtype}))

    def new_value(self, v) -> str:
        """The tensor of a node output that owns a buffer (workspace, or a redirected user tensor)."""
        if v.name in self.redirect:
            dst = self.tensors[self.tid[self.redirect[v.name].name]]
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

    def of(self, v) -> str:
        return self.tid[v.name]

    def call(self, api: str, node, *args: Arg) -> None:
        self.calls.append(Call(api=api, args=list(args), source=dump_line(node)))

    def mark_written(self, v) -> None:
        u = self.tensors[self.of(v)].user
        if u:
            self.written.add(u)

    # -- driver --
    def run(self, level: Optional[int]) -> CallPlan:
        for node in self.graph.nodes:
            fn = LOWERINGS.get(node.op)
            if node.op != "ViewCopy" and node.inputs and node.opdef.is_free(node):
                fn = lower_free
            if fn is None:
                raise LoweringError(f"no aclnn lowering for node: {dump_line(node)}")
            fn(self, node)
        for name in self.written:
            for u in self.users:
                if u.name == name:
                    u.written = True
        return CallPlan(op=self.graph.name, level=level, users=self.users,
                        workspace_size=self.extra, tensors=list(self.tensors.values()),
                        calls=self.calls)


def dump_line(node) -> str:
    """The node's one-line dump (a fused body is elided)."""
    return str(node).split(" {\n", 1)[0]


def lower(graph, bindings: Optional[Mapping[str, Any]] = None, level: Optional[int] = None) -> CallPlan:
    """Lower ``graph`` (levels 0–2 of aclnnBatchNormElemtBackward, or any graph of lowerable
    nodes) to a :class:`CallPlan`. ``bindings`` (graph input → opgraph.Tensor) give user views'
    offsets and storage sizes; without them user tensors are taken as exactly their view."""
    return Lowerer(graph, bindings).run(level)


def lower_executor(executor) -> CallPlan:
    """The plan of a phase-1 executor's compiled graph."""
    return lower(executor.compiled or executor.graph, executor.bindings, executor.opt_level)


# --- the lowering table -----------------------------------------------------------------------
def lower_free(L: Lowerer, node) -> None:
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


def unsqueeze_strides(dims, strides, out_shape) -> list[int]:
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


def lower_cast(L: Lowerer, node) -> None:
    out = L.new_value(node.outputs[0])
    L.call("aclnnCast", node, t_arg("self", L.of(node.inputs[0])),
           Arg(kind="dtype", name="dtype", dtype=acl_dtype(node.attrs.to)), t_arg("out", out))


def lower_reduce_sum(L: Lowerer, node) -> None:
    x, v = node.inputs[0], node.outputs[0]
    out = L.new_value(v)
    axes = [a % max(x.type.rank, 1) for a in node.attrs.axes]
    L.call("aclnnReduceSum", node, t_arg("self", L.of(x)), ints_arg("dims", axes),
           Arg(kind="bool", name="keepDims", flag=node.attrs.keepdims),
           Arg(kind="dtype", name="dtype", dtype=acl_dtype(v.type.dtype)), t_arg("out", out))


def lower_div(L: Lowerer, node) -> None:
    out = L.new_value(node.outputs[0])
    L.call("aclnnDiv", node, t_arg("self", L.of(node.inputs[0])), t_arg("other", L.of(node.inputs[1])),
           t_arg("out", out))


def lower_broadcast(L: Lowerer, node) -> None:
    out = L.new_value(node.outputs[0])
    L.call("aclnnExpand", node, t_arg("self", L.of(node.inputs[0])), ints_arg("size", node.attrs.shape),
           t_arg("out", out))


def lower_fill(L: Lowerer, node) -> None:
    out = L.new_value(node.outputs[0])
    if node.attrs.value == 1:
        L.call("aclnnInplaceOne", node, t_arg("selfRef", out))
    else:
        L.call("aclnnInplaceFillScalar", node, t_arg("selfRef", out),
               Arg(kind="scalar", name="value", value=node.attrs.value, dtype=acl_dtype(node.attrs.dtype)))


def lower_copy(L: Lowerer, node) -> None:
    """Contiguous (a strided input) → copy into a workspace tensor; ViewCopy → copy into the user
    tensor, or nothing when redirected (the producer already wrote the user's memory)."""
    if node.op == "ViewCopy":
        L.tid[node.outputs[0].name] = L.of(node.inputs[1])
        L.mark_written(node.inputs[1])
        if node.attrs.redirect:
            return
        dst = L.of(node.inputs[1])
    else:
        dst = L.new_value(node.outputs[0])
    L.call("aclnnInplaceCopy", node, t_arg("selfRef", dst), t_arg("src", L.of(node.inputs[0])))


def channel_param(L: Lowerer, v, node) -> str:
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
                        f"{BNEB}: {dump_line(node)}")


def counter_one(L: Lowerer, node) -> str:
    """The FLOAT [1] counter holding total count 1 (filled by aclnnInplaceOne once)."""
    if COUNTER_ID not in L.tensors:
        L.scratch(COUNTER_ID, (1,), DataType.FLOAT)
        L.call("aclnnInplaceOne", node, t_arg("selfRef", COUNTER_ID))
    return COUNTER_ID


def lower_elemt(L: Lowerer, node) -> None:
    """The l0 kernel → the public op with per-channel params, sumDy := meanDy,
    sumDyXmu := meanDyXmu and a counter of total 1 (so the means pass through unchanged)."""
    go, x, mean, invstd, weight, md, mdx = node.inputs
    params = [channel_param(L, p, node) for p in (mean, invstd, weight, md, mdx)]
    cnt = counter_one(L, node)
    out = L.new_value(node.outputs[0])
    names = BNEB_ARGS
    tids = [L.of(go), L.of(x), *params[:3], params[3], params[4], cnt, out]
    L.call(BNEB, node, *(t_arg(n, t) for n, t in zip(names, tids)))


def lower_fused(L: Lowerer, node) -> None:
    """A level-2 fused kernel of the whole op (raw user tensors in, store into gradInput)."""
    ins = node.inputs
    names = [v.name for v in ins]
    ok = (L.graph.name == BNEB and node.attrs.store and all(v.producer is None for v in ins)
          and names[-1] == "gradInput" and set(names[:-1]) <= set(BNEB_ARGS[:-1])
          and set(BNEB_ARGS[:-1]) - {"weight"} <= set(names[:-1]))
    if not ok:
        raise LoweringError("FusedElementwise is lowerable only as a whole "
                            f"{BNEB} (its user tensors in, store into gradInput): {dump_line(node)}")
    L.tid[node.outputs[0].name] = L.of(ins[-1])
    L.mark_written(ins[-1])
    L.call(BNEB, node, *(t_arg(n, L.tid[n] if n in names else None) for n in BNEB_ARGS))


LOWERINGS: dict[str, Callable[[Lowerer, Any], None]] = {
    "Cast": lower_cast,
    "ReduceSum": lower_reduce_sum,
    "RealDiv": lower_div,
    "BroadcastTo": lower_broadcast,
    "Fill": lower_fill,
    "Contiguous": lower_copy,
    "ViewCopy": lower_copy,
    "SyncBatchNormBackwardElemt": lower_elemt,
    "FusedElementwise": lower_fused,
}

