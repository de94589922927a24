"""Building a program graph from captured op_api calls: each call's recorded graph is copied in
call order; a tensor one call wrote and a later call reads becomes an edge (the value written,
not a memory round trip); other tensors become the program's named inputs. Collectives
(:func:`collective`) add AllGather / AllReduce nodes whose results are new arrays later calls
may read.

    >>> import numpy as np, opgraph
    >>> from opgraph.aclnn.batch_norm_stats import batch_norm_stats
    >>> from opgraph.core.capturing import recording
    >>> rec = Recorder()
    >>> with recording(rec):
    ...     mean, invstd = batch_norm_stats(np.ones((2, 3, 4), np.float32), 1e-5)
    >>> graph, tensors = rec.finish()
    >>> [v.name for v in graph.inputs], len(rec.calls)
    (['input', 'mean', 'invstd'], 1)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from l0ops.collectives import AllGather, AllReduce
from opgraph.core.collective import get_group
from opgraph.core.capturing import CaptureError
from opgraph.core.config import current_backend
from opgraph.core.executor import Executor, tensor_type
from opgraph.core.ir import Graph, Node, Value
from opgraph.core.platform import Platform
from opgraph.core.tensor import Tensor, extent, tensor


def key_of(t: Tensor) -> tuple:
    """Two tensors with the same key are the same view of the same memory."""
    return (extent(t)[0], t.shape, t.strides, t.dtype)


@dataclass
class Write:
    """A tensor some node of the program wrote: ``value`` is what a later reader sees."""

    key: tuple
    tensor: Tensor
    value: Value
    writer: Optional[Node]  # None: the value of a collective (an array the capture allocated)
    call: int
    read_later: bool = False
    inout: bool = False  # the writing call also read it: state the caller keeps (running stats)


@dataclass
class Recorder:
    """The :class:`~opgraph.core.capturing.CallRecorder` of :func:`opgraph.capture.capture`."""

    graph: Graph = field(default_factory=lambda: Graph("capture"))
    calls: list[str] = field(default_factory=list)
    call_graphs: list[Graph] = field(default_factory=list)  # each op_api call's own graph
    platform: Optional[Platform] = None
    backends: set = field(default_factory=set)
    on_replay: list[Callable[[], Any]] = field(default_factory=list)  # host effects per replay
    _inputs: dict[tuple, Value] = field(default_factory=dict)
    _tensors: dict[str, Tensor] = field(default_factory=dict)
    _writes: dict[tuple, Write] = field(default_factory=dict)
    _regions: list[tuple[int, int, tuple, bool]] = field(default_factory=list)
    _readers: dict[tuple, set[int]] = field(default_factory=dict)
    _executors: dict[int, Executor] = field(default_factory=dict)
    _seq: "itertools.count[int]" = field(default_factory=itertools.count)

    # --- the CallRecorder protocol ------------------------------------------------------------
    def on_phase1(self, ex: Executor, args: Sequence[Any]) -> None:
        """See :meth:`CallRecorder.on_phase1`; appends the call's graph to the program, its
        inputs bound to the tensors earlier calls read or wrote (CaptureError on another
        platform)."""
        if self.platform is None:
            self.platform = ex.platform
        elif ex.platform != self.platform:
            raise CaptureError(f"call #{len(self.calls)} {ex.name} runs on {ex.platform.soc}, the "
                               f"capture on {self.platform.soc}: capture one platform at a time")
        written = {n.inputs[k].name for n in ex.graph.nodes for k in n.opdef.written(n)}
        call = len(self.calls)
        env: dict[int, Value] = {}
        for v in ex.graph.inputs:
            env[id(v)] = self._resolve(v.name, ex.bindings[v.name], call, v.name in written,
                                       f"call #{call} {ex.name}", _reads(v))
        for n in ex.graph.nodes:
            new = self.graph.add_node(n.op, [env[id(v)] for v in n.inputs], n.attrs, source=n.source)
            for old, v in zip(n.outputs, new.outputs):
                env[id(old)] = v
            for k in n.opdef.written(n):
                self._wrote(ex.bindings[n.inputs[k].name], new, k, call)
        self.calls.append(ex.name)
        self.call_graphs.append(ex.graph)
        self._executors[id(ex)] = ex

    def on_phase2(self, ex: Executor) -> bool:
        """See :meth:`CallRecorder.on_phase2`; defers an executor recorded in this capture (True)
        and notes the current backend; one from before the capture runs now (False)."""
        if id(ex) not in self._executors:
            return False  # an executor from before the capture runs now
        self.backends.add(current_backend())
        return True

    # --- collectives ---------------------------------------------------------------------------
    def collective(self, op: str, group: str, arrays: Sequence[Any]) -> list[np.ndarray]:
        """Record an AllGather / AllReduce of ``arrays`` on ``group``; returns the new arrays
        (filled when the program runs) that later calls may read."""
        call = len(self.calls)
        what = f"call #{call} {op}"
        ts = [a if isinstance(a, Tensor) else tensor(a) for a in arrays]
        ins = [self._resolve(f"x{k}", t, call, False, what) for k, t in enumerate(ts)]
        seq = next(self._seq)
        if op == "AllGather":
            node = self.graph.add_node("AllGather", ins, AllGather.make_attrs(
                group=group, seq=seq, world=get_group(group).world_size))
        else:
            node = self.graph.add_node("AllReduce", ins, AllReduce.make_attrs(group=group, seq=seq))
        outs = []
        for v in node.outputs:
            a = np.empty(v.shape, v.dtype.np)
            t = tensor(a)
            w = Write(key_of(t), t, v, None, call)
            self._writes[w.key] = w
            self._regions.append((*extent(t), w.key, True))
            outs.append(a)
        self.calls.append(op)
        return outs

    # --- resolving tensors ---------------------------------------------------------------------
    def _resolve(self, name: str, t: Tensor, call: int, written: bool, what: str,
                 read: bool = True) -> Value:
        """The program value a call's tensor argument stands for."""
        key = key_of(t)
        readers = self._readers.setdefault(key, set())
        if read:
            readers.add(call)
        w = self._writes.get(key)
        if w is not None:
            if written:
                raise CaptureError(f"{what}: {name} was already written by call #{w.call}; a "
                                   "captured program writes each tensor once")
            w.read_later = True
            return w.value
        lo, hi = extent(t)
        for rlo, rhi, rkey, rwritten in self._regions:
            if rkey != key and lo < rhi and rlo < hi and (written or rwritten):
                raise CaptureError(f"{what}: {name} overlaps a tensor another call "
                                   f"{'wrote' if rwritten else 'read'} without being the same "
                                   "view of it; pass that very view, or copy")
        if written and readers - {call}:
            raise CaptureError(f"{what}: {name} was read by call #{min(readers - {call})} "
                               "and is written now; a captured program writes a tensor only "
                               "before it is read or in the call that reads it")
        v = self._inputs.get(key)
        if v is None:
            unique = next(n for n in itertools.chain([name], (f"{name}_{i}" for i in itertools.count(1)))
                          if n not in self._tensors)
            v = self.graph.add_input(unique, tensor_type(t))
            self._inputs[key] = v
            self._tensors[unique] = t
            self._regions.append((lo, hi, key, written))
        return v

    def _wrote(self, t: Tensor, node: Node, k: int, call: int) -> None:
        key = key_of(t)
        src = node.inputs[0]
        dst = node.inputs[k]
        logical = node.op == "ViewCopy" and src.shape == dst.shape and src.dtype == dst.dtype
        w = Write(key, t, src if logical else node.outputs[0], node, call,
                  inout=call in self._readers.get(key, ()))
        self._writes[key] = w
        self._regions = [(lo, hi, rk, rw or rk == key) for lo, hi, rk, rw in self._regions]

    # --- the result ----------------------------------------------------------------------------
    def finish(self, keep: str = "outputs") -> tuple[Graph, dict[str, Tensor]]:
        """The program graph and its input bindings. ``keep="outputs"``: a tensor a later call
        read is an edge only (not stored); ``"all"``: every written tensor is stored, as the
        calls one by one leave it."""
        if keep not in ("outputs", "all"):
            raise ValueError(f"keep must be 'outputs' or 'all', got {keep!r}")
        g = self.graph
        outputs: list[Value] = []
        for w in self._writes.values():
            store = keep == "all" or not w.read_later or w.inout
            if w.writer is None:  # a collective's result: stored through a copy if kept
                if store:
                    dst = self._input_for(f"{w.value.producer.op.lower()}{w.value.name}", w)
                    outputs.append(g.add_node("ViewCopy", [w.value, dst]).outputs[0])
                continue
            out = w.writer.outputs[0]
            if store or out.users:
                outputs.append(out)
            else:
                for v in w.writer.inputs:
                    v.users = [u for u in v.users if u is not w.writer]
                g.nodes.remove(w.writer)
        g.outputs = outputs
        g.inputs = [v for v in g.inputs if v.users]
        tensors = {v.name: self._tensors[v.name] for v in g.inputs}
        return g.verify(), tensors

    def _input_for(self, name: str, w: Write) -> Value:
        v = self.graph.add_input(name, tensor_type(w.tensor))
        self._tensors[name] = w.tensor
        return v


def _reads(v: Value) -> bool:
    """True when some node reads graph input ``v`` (not only writes it)."""
    return any(u.inputs[k] is v and k not in u.opdef.written(u)
               for u in v.users for k in range(len(u.inputs)))


__all__ = ["CaptureError", "Recorder", "Write", "key_of"]
