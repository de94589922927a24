"""A native executable's steps bound to one set of tensors and one workspace, for callers that
run the same bindings again and again (a captured program's replay): every operand array is made
once, every C kernel's pointer array once, and a run is the kernel calls and the numpy lowerings
left, in order — no per-node layout lookups, views or address fetches.

What a run does is what :meth:`backends.numpy_backend.NumpyExecutable.run_nodes` does with the
same bindings, node by node, with the same lowerings and the same bits:

* a free node whose results view its operands (a reshape, a redirected copy) is evaluated once,
  when binding: its results are views of memory that does not move; so is a host constant
  (ConvertToTensor);
* a FusedElementwise kernel the C renderer covers with its per-channel prologue becomes one C
  call on fixed pointers (its destination: the user tensor or arena slot the plan gives it, else
  a buffer of the binding's own);
* a FusedReduce keeps its C plan (one serial C call below ``min_elements``, else the passes);
* any other node runs its lowering on the fixed arrays; every result is copied into the array
  that holds it (its slot, or a buffer of the binding's own), so later kernels find it there.

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
from .launch import check_overlap, launch_for
from .reduce import plan_for, run_planned
from .small import call_small, plan_small
from .unsupported import Unsupported

Step = Callable[[int], None]  # one step of a bound run; its argument: the team runner


def _is_view_of(r: Any, args: list) -> bool:
    """Whether ``r`` is an array in the memory of one of ``args`` (a view, or an operand
    itself), or empty (no memory to move)."""
    if not isinstance(r, np.ndarray):
        return False
    return r.size == 0 or any(isinstance(x, np.ndarray) and np.shares_memory(r, x) for x in args)


class Bound:
    """The steps of ``exe`` (a NativeExecutable) bound to ``bindings`` and ``workspace``; see
    the module docstring. ``native``: the lowerings of FusedElementwise and FusedReduce whose C
    calls may be prepared here. :meth:`matches` says whether a call has the same tensor objects
    and workspace; :meth:`run` runs the steps (None when another thread is running them: the
    caller then takes the node-by-node path)."""

    def __init__(self, exe: Any, bindings: Mapping[str, Tensor], workspace: Any,
                 native: tuple = ()):
        self.names = exe.input_names
        self.key = (workspace, *[bindings[n] for n in self.names])
        self.lock = threading.Lock()
        arena = None if workspace is None else memoryview(workspace).cast("B")
        env: dict[str, Any] = {n: bindings[n].view() for n in self.names}
        self.env = env
        self.steps: list[Step] = []
        for i, (node, lower, inputs, outputs, _) in enumerate(exe.program):
            args = [env[n] for n in inputs]
            if node.opdef.is_free(node) and self._as_view(exe, node, lower, args, outputs):
                continue
            fixed = [_holder(name, slot, node.outputs[k], arena, bindings)
                     for k, (name, slot) in enumerate(outputs)]
            if node.op == "FusedElementwise" and node.attrs.store and outputs[0][1] is None:
                fixed[0] = args[-1]  # the kernel's result is its destination
            for (name, _), f in zip(outputs, fixed):
                env[name] = f
            step = None
            if lower in native and node.op == "FusedElementwise":
                step = _kernel(exe, node.attrs, args, fixed[0])
            elif lower in native and node.op == "FusedReduce":
                step = _reduce(exe, node.attrs, args, fixed)
            self.steps.append(step or self._generic(exe, exe.into.get(i) is not None, node, lower,
                                                    inputs, fixed))
        self.outputs = [v.name for v in exe.graph.outputs]

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

    def _generic(self, exe: Any, into: bool, node: Any, lower: Any, inputs: tuple,
                 fixed: list) -> Step:
        """Node ``node``'s lowering on the fixed arrays, its results copied into ``fixed``."""
        env = self.env

        def generic(run: int) -> None:
            ins = [env[n] for n in inputs]
            results = lower(exe, node, ins, out=fixed[0]) if into else lower(exe, node, ins)
            for f, r in zip(fixed, results):
                if r is not f:
                    np.copyto(f, r)
        return generic

    def matches(self, bindings: Mapping[str, Tensor], workspace: Any) -> bool:
        """Whether ``bindings`` and ``workspace`` are the very objects this was bound to."""
        key = self.key
        if key[0] is not workspace:
            return False
        get = bindings.get
        return all(get(n) is t for n, t in zip(self.names, key[1:]))

    def run(self) -> Optional[dict[str, np.ndarray]]:
        """Run the steps; the graph outputs by value name (None: busy in another thread)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            run = team.runner()
            for step in self.steps:
                step(run)
            env = self.env
            return {n: env[n] for n in self.outputs}
        finally:
            self.lock.release()


def _holder(name: str, slot: Any, value: Any, arena: Any, bindings: Mapping[str, Tensor]) -> np.ndarray:
    """The array that holds ``value`` on every run: its slot, else a buffer of its own."""
    if slot is None:
        return np.empty(value.shape, value.dtype.np)
    if slot.user is not None:
        return bindings[slot.user].view().reshape(slot.shape)
    return np.frombuffer(arena, slot.dtype, slot.size, slot.offset).reshape(slot.shape)


def _kernel(exe: Any, a: FusedAttrs, args: list, dst: np.ndarray) -> Optional[Step]:
    """A FusedElementwise as one C call on fixed pointers, or None (its lowering then runs)."""
    if math.prod(a.shape) < exe.backend.min_fused_elements:
        return None
    ins, out = (args[:-1], args[-1]) if a.store else (args, dst)
    if not out.flags.writeable or (a.store and address(out) != address(dst)):
        return None
    try:
        ln = launch_for(a, ins, out)
        if not ln.fused:
            return None
        addrs = [address(x) for x in [ins[k] for k in ln.small] + [ins[k] for k in ln.big] + [out]]
        check_overlap(ln, addrs[len(ln.small):-1], addrs[-1])
    except Unsupported:
        return None
    if ln.empty:
        return lambda run: None
    ptrs, fn, ndim, shape, strides, tab = ln.ptrs(*addrs), ln.fn, ln.ndim, ln.shape, ln.strides, ln.tab

    def kernel(run: int) -> None:
        if fn(ndim, shape, strides, render.BLOCK, run, tab, ptrs):
            raise MemoryError("native kernel: cannot allocate the per-channel scratch")
    return kernel


def _reduce(exe: Any, a: Any, args: list, fixed: list) -> Optional[Step]:
    """A FusedReduce with its C plan made once, or None (its lowering then runs)."""
    try:
        if sum(x.size for x in args) < exe.backend.min_elements:
            small = plan_small(a, args)
            addrs = [address(args[k]) for k in small.small]

            def compute() -> list:
                return call_small(small, a, addrs)
        else:
            big = plan_for(a, args)

            def compute() -> list:
                return run_planned(big, a, args)
    except Unsupported:
        return None

    def reduce(run: int) -> None:
        for f, r in zip(fixed, compute()):
            np.copyto(f, r)
    return reduce


__all__ = ["Bound"]
