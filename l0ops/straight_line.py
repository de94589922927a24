"""A compiled fused body's straight-line run as one generated Python function: the fast path
for small tensors, where a loop over the steps costs as much as the numpy calls it makes
(aclnnBatchNormElemtBackward at [1,2,4], 17 steps: ~25 µs looped, ~16 µs generated).

The generated source holds nothing but register and step numbers (``r9 = f1(r8)``) and the
method names of :data:`METHODS` (``r10 = r3.reshape(f2)``, for a step marked as that call);
the callables and arguments reach it through its namespace, so no text from a graph file or a
user is ever compiled.

    >>> import numpy as np
    >>> run = straight_line([(np.add, (0, 1)), (np.multiply, (2, 2))], [False, False], 3, store=True)
    >>> out = np.zeros(2, np.float32)
    >>> run(np.float32([1, 2]), np.float32([1, 1]), out), out.tolist()   # (1+1)², (2+1)²
    (None, [4.0, 9.0])
    >>> run(np.float32([1, 2]), np.float32([1, 1]), None).tolist()
    [4.0, 9.0]
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

Step = tuple[Callable, tuple[int, ...]]  # a callable and the registers it reads


def straight_line(steps: Sequence[Step], narrow: Sequence[bool], result: int,
                  store: bool) -> Callable[..., Optional[np.ndarray]]:
    """``run(*inputs, out)``: the input registers (``r0`` ...; a ``narrow`` one — float16 or
    bfloat16 — first widened to float32), then step k computing register ``len(inputs) + k``
    from the registers it reads; returns register ``result``. With ``store`` the last step
    makes the result, and given an ``out`` it computes straight into it (``out=out``) and the
    function returns None."""
    n = len(narrow)
    made = [_call(k, fn, args) for k, (fn, args) in enumerate(steps)]
    calls = [call for call, _ in made]
    lines = [f"def run({', '.join([*(f'r{i}' for i in range(n)), 'out'])}):"]
    lines += [f"    r{i} = r{i}.astype(F32)" for i, wide in enumerate(narrow) if wide]
    lines += [f"    r{n + k} = {call})" for k, call in enumerate(calls)]
    if store and calls and made[-1][1] is steps[-1][0]:  # (a plain call: it takes out=)
        lines[-1:] = ["    if out is not None:", f"        {calls[-1]}, out=out)",
                      "        return None", lines[-1]]
    lines.append(f"    return r{result}")
    namespace: dict = {f"f{k}": value for k, (_, value) in enumerate(made)}
    namespace["F32"] = np.float32  # (not f32: that is step 32)
    exec(compile("\n".join(lines), "<opgraph straight line>", "exec"), namespace)  # noqa: S102
    return namespace["run"]


METHODS = ("reshape", "astype")  # a step marked ``fn.method = (name, arg)`` computes x.name(arg)


def _call(k: int, fn: Callable, args: tuple[int, ...]) -> tuple[str, object]:
    """Step ``k``'s call, its closing parenthesis left off (a last step may add ``out=out``),
    and what its name ``f{k}`` stands for: ``f{k}(r.., r..`` and ``fn`` — or, for a step
    marked as a method call on its one operand (:data:`METHODS`), that call itself and its
    argument: one Python call less."""
    method = getattr(fn, "method", None)
    if method is not None and method[0] in METHODS and len(args) == 1:
        return f"r{args[0]}.{method[0]}(f{k}", method[1]
    return f"f{k}({', '.join(f'r{i}' for i in args)}", fn


__all__ = ["Step", "straight_line"]
