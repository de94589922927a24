"""A compiled fused body's straight-line run as one generated Python function: the fast path
for small tensors, where a loop over the steps costs as much as the numpy calls it makes
(aclnnBatchNormElemtBackward at [1,2,4], 17 steps: ~25 µs looped, ~16 µs generated).

The generated source holds nothing but register and step numbers (``r9 = f1(r8)``); the
callables reach it through its namespace, so no text from a graph file or a user is ever
compiled.

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
    calls = [f"f{k}({', '.join(f'r{i}' for i in args)}" for k, (_, args) in enumerate(steps)]
    lines = [f"def run({', '.join([*(f'r{i}' for i in range(n)), 'out'])}):"]
    lines += [f"    r{i} = r{i}.astype(F32)" for i, wide in enumerate(narrow) if wide]
    lines += [f"    r{n + k} = {call})" for k, call in enumerate(calls)]
    if store and calls:
        lines[-1:] = ["    if out is not None:", f"        {calls[-1]}, out=out)",
                      "        return None", lines[-1]]
    lines.append(f"    return r{result}")
    namespace: dict = {f"f{k}": fn for k, (fn, _) in enumerate(steps)}
    namespace["F32"] = np.float32  # (not f32: that is step 32)
    exec(compile("\n".join(lines), "<opgraph straight line>", "exec"), namespace)  # noqa: S102
    return namespace["run"]


__all__ = ["Step", "straight_line"]
