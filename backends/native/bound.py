"""A native executable's steps bound to one set of tensors and one workspace, for callers that
run a program again and again (a captured program's replay, a repeatable executor):
every operand array is made once, every C kernel's pointer array once, and a run is the kernel
calls and the numpy lowerings left, in order — no per-node layout lookups, views or address
fetches. Other tensors of the same layouts in the same workspace (a new input every training
step) rebind only the nodes that touch them: their views, their C calls' addresses.

What a run does is what :meth:`backends.numpy_backend.NumpyExecutable.run_nodes` does with the
same bindings, node by node, with the same lowerings and the same bits:

* a free node whose results view its operands (a reshape, a redirected copy) is evaluated once,
  when binding: its results are views of memory that does not move; so is a host constant
  (ConvertToTensor);
* a FusedElementwise kernel the C renderer covers with its per-channel prologue becomes one C
  call on fixed pointers (its destination: the user tensor or arena slot the plan gives it, else
  a buffer of the binding's own);
* a FusedReduce keeps its C plan (one serial C call below the threshold, else the passes);
* any other node runs its lowering on the fixed arrays; every result is copied into the array
  that holds it (its slot, or a buffer of the binding's own), so later kernels find it there.

The backend's size thresholds (``min_elements``, ``min_short_elements``,
``min_stepped_elements``, ``min_fused_elements``) are read when binding: they choose between implementations with the
same bits, and a rebinding reads them again.

    >>> import numpy as np, opgraph
    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType as D
    >>> from opgraph.core.memory import plan_memory
    >>> from opgraph.core.backend import get
    >>> from opgraph.core.platform import get_platform
    >>> from backends.native import available
    >>> g = Graph("square")
    >>> x, out = g.add_input("x", TensorType((4,), D.FLOAT)), g.add_input("out", TensorType((4,), D.FLOAT))
    >>> g.outputs = [g.add_node("ViewCopy", [g.add_node("Mul", [x, x]).outputs[0], out]).outputs[0]]
    >>> plan = plan_memory(g)
    >>> exe = get("numpy" if not available() else "native").compile(g, plan, get_platform())
    >>> xs, o, ws = np.arange(4, dtype=np.float32), np.zeros(4, np.float32), bytearray(plan.size)
    >>> bindings = {"x": opgraph.tensor(xs), "out": opgraph.tensor(o)}
    >>> for k in range(3):                         # the second run binds, the third runs bound
    ...     xs += 1
    ...     _ = exe.run_repeatable(bindings, ws)
    >>> o.tolist(), getattr(exe, "bound", "numpy") is not None
    ([9.0, 16.0, 25.0, 36.0], True)
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Mapping, Optional

import numpy as np

from l0ops.primitives import FusedAttrs
from opgraph.core.tensor import Tensor
from . import render, team
from .build import address
from .launch import fused_operands, fused_pointers, launch_for
from .reduce import plan_for
from .reduce_run import run_planned
from .small import plan_small, prepared_small, serial_below, serial_kind
from .unsupported import Unsupported

Step = Callable[[int, dict], None]  # one step of a bound run: (the team runner, the arrays by name)


def _is_view_of(r: Any, args: list) -> bool:
    """Whether ``r`` is an array in the memory of one of ``args`` (a view, or an operand
    itself), or empty (no memory to move)."""
    if not isinstance(r, np.ndarray):
        return False
    return r.size == 0 or any(isinstance(x, np.ndarray) and np.shares_memory(r, x) for x in args)


def _stores_unplaced(node: Any, outputs: tuple) -> bool:
    """A FusedElementwise storing into its last operand whose result the plan places nowhere:
    the result is that operand."""
    return node.op == "FusedElementwise" and node.attrs.store and outputs[0][1] is None


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return (a.shape, a.strides, a.dtype) == (b.shape, b.strides, b.dtype)


def repeats(last: Optional[tuple], key: tuple) -> bool:
    """Whether a run on ``key`` (workspace, then the bound tensors in input order) repeats the
    run on ``last``: the same workspace and, input by input, the same tensor or one of the same
    layout — a training step's new tensors as much as the same ones again."""
    return (last is not None and len(last) == len(key) and last[0] is key[0]
            and all(a is b or (isinstance(a, Tensor) and isinstance(b, Tensor) and _same_layout(a, b))
                    for a, b in zip(last[1:], key[1:])))


class Bound:
    """The steps of ``exe`` (a NativeExecutable) bound to ``bindings`` and ``workspace``; see
    the module docstring. ``native``: the lowerings of FusedElementwise and FusedReduce whose C
    calls may be prepared here. With ``like`` (a Bound of the same executable and workspace whose
    changed tensors have the same layouts: :meth:`rebinds`), only what lies in a changed tensor
    is bound anew — its views, its user-tensor results, the C calls that read or write it (their
    launch and plans kept, the addresses of unchanged operands too); the rest, own buffers
    included, is shared with ``like``, and so is the lock. :meth:`matches` says whether a call
    has the same tensor objects and workspace; :meth:`run` runs the steps (None when another
    thread is running them: the caller then takes the node-by-node path)."""

    def __init__(self, exe: Any, bindings: Mapping[str, Tensor], workspace: Any,
                 native: tuple = (), like: "Optional[Bound]" = None):
        self.exe, self.names, self.native = exe, exe.input_names, native
        self.key = (workspace, *[bindings[n] for n in self.names])
        self.outputs = [v.name for v in exe.graph.outputs]
        if like is None:
            self._bind_all(bindings, workspace)
        else:
            self._bind_like(like, bindings)
        self.steps = [st for st in self.node_steps if st is not None]

    def _bind_all(self, bindings: Mapping[str, Tensor], workspace: Any) -> None:
        exe = self.exe
        self.lock = threading.Lock()
        arena = None if workspace is None else memoryview(workspace).cast("B")
        env: dict[str, Any] = {n: bindings[n].view() for n in self.names}
        self.env = env
        # per node: its step (None: a view, evaluated here) and the bound tensors its operands
        # and results lie in; per bound tensor: the nodes touching it
        self.node_steps: list[Optional[Step]] = []
        lies_in: dict[str, frozenset] = {n: frozenset([n]) for n in self.names}
        uses: list[frozenset] = []
        for i, (node, lower, inputs, outputs, _) in enumerate(exe.program):
            args = [env[n] for n in inputs]
            mem = frozenset().union(*[lies_in.get(n, frozenset()) for n in inputs])
            if node.opdef.is_free(node) and self._as_view(exe, node, lower, args, outputs):
                for name, _ in outputs:
                    lies_in[name] = mem
                uses.append(mem)
                self.node_steps.append(None)
                continue
            fixed = [_holder(slot, node.outputs[k], arena, bindings) for k, (_, slot) in enumerate(outputs)]
            if _stores_unplaced(node, outputs):
                fixed[0] = args[-1]  # the kernel's result is its destination
            users = frozenset(slot.user for _, slot in outputs if slot is not None and slot.user)
            for (name, slot), f in zip(outputs, fixed):
                env[name] = f
                lies_in[name] = users if slot is not None else mem if f is args[-1] else frozenset()
            uses.append(mem | users)
            self.node_steps.append(self._step(i, args))
        self.touching = {n: [i for i, u in enumerate(uses) if n in u] for n in self.names}

    def _bind_like(self, like: "Bound", bindings: Mapping[str, Tensor]) -> None:
        exe = self.exe
        self.lock, self.touching = like.lock, like.touching
        changed = [n for n, t, was in zip(self.names, self.key[1:], like.key[1:]) if t is not was]
        env = self.env = dict(like.env)
        for n in changed:
            env[n] = bindings[n].view()
        steps = self.node_steps = list(like.node_steps)
        for i in sorted({i for n in changed for i in like.touching[n]}):
            node, lower, inputs, outputs, _ = exe.program[i]
            args = [env[n] for n in inputs]
            if steps[i] is None:  # a view: of the new operands
                for (name, _), r in zip(outputs, lower(exe, node, args)):
                    env[name] = r
                continue
            for name, slot in outputs:  # results in a user tensor: its new one
                if slot is not None and slot.user is not None:
                    env[name] = bindings[slot.user].view().reshape(slot.shape)
            if _stores_unplaced(node, outputs):
                env[outputs[0][0]] = args[-1]
            if hasattr(steps[i], "record"):  # a C call: its addresses anew (a generic step reads env)
                steps[i] = self._step(i, args, steps[i])

    def _step(self, i: int, args: list, like: Optional[Step] = None) -> Step:
        """Node ``i``'s step on the bound arrays (``like``: its C call in a Bound like this)."""
        exe, env = self.exe, self.env
        node, lower, inputs, outputs, _ = exe.program[i]
        step = None
        if lower in self.native and node.op == "FusedElementwise":
            step = _kernel(exe, node.attrs, args, env[outputs[0][0]], like)
        elif lower in self.native and node.op == "FusedReduce":
            step = _reduce(exe, node.attrs, args, inputs, outputs, like)
        return step or _generic(exe, exe.into.get(i) is not None, node, lower, inputs, outputs)

    def _as_view(self, exe: Any, node: Any, lower: Any, args: list, outputs: tuple) -> bool:
        """A free node whose results view its operands, evaluated now, once (a redirected copy:
        its destination; another free node: only if the plan gives its results no slot, which
        the node-by-node path would copy into); so is one without operands (a host constant).
        Any other free node (ReduceSum over no axes: a copy) runs as a step."""
        results = lower(exe, node, args)
        redirect = node.opdef.redirects(node)
        for (_, slot), r in zip(outputs, results):
            constant = not args and slot is None  # ConvertToTensor: a host value of its own
            if not (constant or _is_view_of(r, args)) or (slot is not None and not redirect):
                return False
        for (name, _), r in zip(outputs, results):
            self.env[name] = r
        return True

    def matches(self, bindings: Mapping[str, Tensor], workspace: Any) -> bool:
        """Whether ``bindings`` and ``workspace`` are the very objects this was bound to."""
        key = self.key
        if key[0] is not workspace:
            return False
        get = bindings.get
        return all(get(n) is t for n, t in zip(self.names, key[1:]))

    def rebinds(self, bindings: Mapping[str, Tensor], workspace: Any) -> bool:
        """Whether a Bound for ``bindings`` can be made ``like`` this one: the same workspace,
        and every tensor that changed of the same shape, strides and dtype (:func:`repeats`)."""
        get = bindings.get
        return repeats(self.key, (workspace, *[get(n) for n in self.names]))

    def run(self) -> Optional[dict[str, np.ndarray]]:
        """Run the steps; the graph outputs by value name (None: busy in another thread)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            run, env = team.runner(), self.env
            for step in self.steps:
                step(run, env)
            return {n: env[n] for n in self.outputs}
        finally:
            self.lock.release()


def _holder(slot: Any, value: Any, arena: Any, bindings: Mapping[str, Tensor]) -> np.ndarray:
    """The array that holds ``value`` on every run: its slot, else a buffer of its own."""
    if slot is None:
        return np.empty(value.shape, value.dtype.np)
    if slot.user is not None:
        return bindings[slot.user].view().reshape(slot.shape)
    if slot.size == 0:  # an empty value takes no workspace bytes (there may be no workspace)
        return np.empty(slot.shape, slot.dtype)
    return np.frombuffer(arena, slot.dtype, slot.size, slot.offset).reshape(slot.shape)


def _generic(exe: Any, into: bool, node: Any, lower: Any, inputs: tuple, outputs: tuple) -> Step:
    """Node ``node``'s lowering on the bound arrays, its results copied into their holders."""
    names = [name for name, _ in outputs]

    def generic(run: int, env: dict) -> None:
        ins = [env[n] for n in inputs]
        results = lower(exe, node, ins, out=env[names[0]]) if into else lower(exe, node, ins)
        for name, r in zip(names, results):
            f = env[name]
            if r is not f:
                np.copyto(f, r)
    return generic


def _kernel(exe: Any, a: FusedAttrs, args: list, dst: np.ndarray,
            like: Optional[Step] = None) -> Optional[Step]:
    """A FusedElementwise as one C call on fixed pointers, or None (its lowering then runs).
    ``like``: this node's kernel step in a Bound of the same layouts, whose launch is taken and
    whose operand addresses are kept where the operand is the same array."""
    if math.prod(a.shape) < exe.backend.min_fused_elements:
        return None
    ins, out = (args[:-1], args[-1]) if a.store else (args, dst)
    if not out.flags.writeable or (a.store and out is not dst and address(out) != address(dst)):
        return None
    record = getattr(like, "record", None)
    try:
        ln = record[0] if record is not None else launch_for(a, ins, out)
        if not ln.fused:
            return None
        if ln.empty:
            return lambda run, env: None
        arrays = fused_operands(ln, ins, out)
        if record is not None:
            addrs = [was if x is old else address(x) for x, old, was in zip(arrays, record[1], record[2])]
        else:
            addrs = [address(x) for x in arrays]
        ptrs = fused_pointers(ln, addrs)
    except Unsupported:
        return None
    fn, ndim, shape, strides, tab = ln.fn, ln.ndim, ln.shape, ln.strides, ln.tab

    def kernel(run: int, env: dict) -> None:
        if fn(ndim, shape, strides, render.BLOCK, run, tab, ptrs):
            raise MemoryError("native kernel: cannot allocate the per-channel scratch")
    kernel.record = (ln, arrays, addrs)  # type: ignore[attr-defined]
    return kernel


def _reduce(exe: Any, a: Any, args: list, inputs: tuple, outputs: tuple,
            like: Optional[Step] = None) -> Optional[Step]:
    """A FusedReduce with its C plan made once, or None (its lowering then runs): one serial
    C call (its pointers and scratch made once) below the backend's threshold
    (:func:`.small.serial_below`), else the passes.
    ``like``: this node's step in a Bound of the same layouts, whose plan is taken."""
    names = [name for name, _ in outputs]
    serial = sum(x.size for x in args) < serial_below(serial_kind(a), *exe.backend.limits())
    record = getattr(like, "record", None)
    plan = record[1] if record is not None and record[0] == serial else None
    try:
        if serial:
            plan = plan_small(a, args) if plan is None else plan
            call = prepared_small(plan, a, [address(args[k]) for k in plan.small])
        else:
            plan = plan_for(a, args) if plan is None else plan
    except Unsupported:
        return None

    def reduce(run: int, env: dict) -> None:
        results = call() if serial else run_planned(plan, a, [env[n] for n in inputs])
        for name, r in zip(names, results):
            np.copyto(env[name], r)
    reduce.record = (serial, plan)  # type: ignore[attr-defined]
    return reduce


__all__ = ["Bound"]
