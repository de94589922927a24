"""``define_op``: define and register an l0 op. An op given by its expansion into elementwise
primitives is fusable, and its numpy semantics come from interpreting that expansion — so the
kernel's steps are written once.

    >>> from opgraph.core.dtypes import DataType as D
    >>> import numpy as np
    >>> Square = define_op("DocSquare", infer=lambda ts, a: [ts[0].with_()],
    ...                    expand=lambda emit, args, a, ts: emit("mul", [args[0], args[0]], ts[0].dtype))
    >>> Square.compute([np.float16([3.0])], Square.make_attrs())[0].tolist()
    [9.0]
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from opgraph.core.opdef import (ComputeFn, ExpandFn, Fidelity, InferFn, OpAttrs, OpDef, register)
from opgraph.core.rules import Rule
from .expansion import expansion_compute


def define_op(name: str, *, infer: InferFn, attrs: type[OpAttrs] = OpAttrs,
              compute: Optional[ComputeFn] = None, expand: Optional[ExpandFn] = None,
              expandable: Optional[Callable[[Any], bool]] = None,
              kind: str = "elementwise", num_inputs: Optional[int] = None,
              writes: tuple[int, ...] = (), writes_fn: Optional[Callable[[Any], Sequence[int]]] = None,
              free: Optional[Callable[[Any], bool]] = None,
              redirect: Optional[Callable[[Any], bool]] = None,
              format_body: Optional[Callable[[Any], list[str]]] = None,
              rewrites: Sequence[Rule] = (), fast_math: Sequence[Rule] = (),
              fidelity: Sequence[Fidelity] = (), doc: str = "", replace: bool = False) -> OpDef:
    """Register an l0 op and return its OpDef (callable as a builder: ``y = Op(ex, x, attr=1)``).

    Give ``compute`` (numpy semantics), ``expand`` (elementwise primitives; ``compute`` is then
    derived from it unless given), or both."""
    if compute is None:
        if expand is None:
            raise ValueError(f"op {name}: give compute (numpy semantics) or expand (primitives)")
        compute = expansion_compute(expand)
    op = OpDef(name, attrs, infer, compute, kind=kind, num_inputs=num_inputs, writes=tuple(writes),
               writes_fn=writes_fn, free=free, redirect=redirect, expand=expand, expandable=expandable,
               format_body=format_body, rewrites=tuple(rewrites), fast_math=tuple(fast_math),
               fidelity=tuple(fidelity), doc=doc)
    return register(op, replace=replace)
