"""Capture many op_api calls as one program graph, optimise across them, replay it.

Inside ``with opgraph.capture() as prog:`` every two-phase call records (phase 1 runs as usual)
and phase 2 is deferred: nothing is computed. At the end of the block the calls' graphs are one
graph (``prog.graph``) in which a tensor one call writes and a later call reads is an edge, the
program is optimised at the current level (``prog.compiled``) and ``prog.replay(**new_inputs)``
runs it, with the captured tensors or new ones of the same types, on a backend. Collectives
(:func:`all_gather`, :func:`all_reduce`) are nodes of the program too.

    >>> import numpy as np, opgraph
    >>> from opgraph.aclnn.batch_norm_stats import batch_norm_stats
    >>> from opgraph.aclnn.batch_norm_elemt import batch_norm_elemt
    >>> x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    >>> with opgraph.capture() as prog:
    ...     mean, invstd = batch_norm_stats(x, 1e-5)
    ...     y = batch_norm_elemt(x, None, None, mean, invstd, 1e-5)
    >>> prog.stats().launches, prog.stats_one_by_one().launches     # stats + elemt, fused
    (2, 2)
    >>> out = prog.replay()
    >>> np.allclose(y, (x - x.mean((0, 2), keepdims=True)) / x.std((0, 2), keepdims=True), atol=1e-4)
    True
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from opgraph.core import capturing
from opgraph.core.collective import get_group
from opgraph.core.config import check_level, get_fast_math, get_opt_level
from opgraph.core.platform import get_platform
from opgraph.core.tensor import Tensor, tensor
from .program import Program, ProgramStats, check_schedule
from .recorder import CaptureError, Recorder


class capture:
    """``with opgraph.capture(level=None, keep="outputs") as prog:`` — record the op_api calls
    of the block into a :class:`Program`, compiled at ``level`` (default: the current opt
    level) when the block ends, at level 2 with the opt-in, NOT bit-exact fast-math rewrites
    if ``fast_math`` (default: as :func:`opgraph.fast_math` has set it when ``capture()`` is
    called). ``keep="outputs"`` stores
    only the tensors no later call reads (and in-out state such as running statistics);
    ``"all"`` stores every written tensor as the calls one by one would. Inside the block,
    ``prog`` is not built yet."""

    def __init__(self, level: Optional[int] = None, *, keep: str = "outputs",
                 fast_math: Optional[bool] = None):
        if keep not in ("outputs", "all"):
            raise ValueError(f"keep must be 'outputs' or 'all', got {keep!r}")
        if fast_math is not None and not isinstance(fast_math, bool):
            raise TypeError(f"fast_math must be True, False or None, got {fast_math!r}")
        self.level = get_opt_level() if level is None else check_level(level)
        self.fast_math = get_fast_math() if fast_math is None else fast_math
        self.keep = keep
        self.recorder = Recorder()
        self.program: Optional[Program] = None
        self._ctx: Any = None

    def __enter__(self) -> Program:
        self.recorder = Recorder()  # each block its own (a capture object may be entered again)
        self._ctx = capturing.recording(self.recorder)
        self._ctx.__enter__()
        self.program = Program.__new__(Program)  # built (initialised) when the block ends
        return self.program

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
        if exc[0] is not None:
            return
        rec = self.recorder
        graph, tensors = rec.finish(self.keep)
        backend = next(iter(rec.backends)) if len(rec.backends) == 1 else None
        assert self.program is not None
        self.program.__init__(graph, tensors, self.level, rec.platform or get_platform(),  # type: ignore[misc]
                              backend, rec.call_graphs, rec.on_replay, fast_math=self.fast_math)


def _collective(op: str, arrays: tuple, group: str) -> list[np.ndarray]:
    rec = capturing.active()
    if isinstance(rec, Recorder):
        return rec.collective(op, group, arrays)
    impl = get_group(group)
    # each as a capture takes it (opgraph.tensor: a torch tensor too, bfloat16 or requiring
    # grad), 0-d staying 0-d
    xs = [np.asarray((a if isinstance(a, Tensor) else tensor(a)).view(), order="C") for a in arrays]
    return impl.all_gather(xs) if op == "AllGather" else impl.all_reduce(xs)


def all_gather(*arrays: Any, group: str = "local") -> list[np.ndarray]:
    """Each array gathered from every rank of ``group`` ([world, *shape]), in one exchange.
    Inside a capture: an AllGather node, the results filled when the program runs."""
    return _collective("AllGather", arrays, group)


def all_reduce(*arrays: Any, group: str = "local") -> list[np.ndarray]:
    """Each array summed over the ranks of ``group``, in one exchange (capture: an AllReduce
    node)."""
    return _collective("AllReduce", arrays, group)


def on_replay(effect: Callable[[], Any]) -> None:
    """Run ``effect`` (a host-side step effect, such as a step counter) after every replay of
    the program being captured, in the order registered; outside a capture, run it now.

        >>> steps = []
        >>> on_replay(lambda: steps.append(1)); steps
        [1]
    """
    rec = capturing.active()
    if isinstance(rec, Recorder):
        rec.on_replay.append(effect)
    else:
        effect()


def current() -> Optional[Recorder]:
    """The recorder of the capture block in progress in this context, or None (what tells one
    capture from another, or a call made inside one from a call made after it).

        >>> current() is None
        True
    """
    rec = capturing.active()
    return rec if isinstance(rec, Recorder) else None


def active() -> bool:
    """True inside a capture block (in this context)."""
    return current() is not None


__all__ = ["CaptureError", "Program", "ProgramStats", "active", "all_gather", "all_reduce",
           "capture", "check_schedule", "current", "on_replay"]
