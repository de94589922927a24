"""The ``ascend-sim`` backend: SyncBatchNormBackwardElemt runs as a simulation of the DAV_2201
(910B) kernel — tiled over AI Vector cores, CopyIn → Compute → CopyOut, UB checked — and every
other node runs on numpy. Results are bit-identical to the numpy backend; each kernel launch
leaves a :class:`KernelTrace` (``backend.last_trace``). Only graphs recorded at levels 0 and 1
hold the vendor kernel: level 2 fuses it into opgraph's own kernel, which runs on numpy with no
trace (``last_trace`` None).

    >>> import numpy as np, opgraph, backends
    >>> x = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    >>> f = lambda *v: opgraph.tensor(np.float32(v))
    >>> out = np.zeros_like(x)
    >>> with opgraph.opt_level(0):
    ...     st, ws, ex = opgraph.aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
    ...         opgraph.tensor(x), opgraph.tensor(x), f(0, 0), f(1, 1), f(1, 1), f(0, 0), f(1, 1),
    ...         f(5, 5), opgraph.tensor(out))
    >>> with opgraph.use_backend("ascend-sim"):
    ...     opgraph.aclnn.aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex)
    <Status.ACLNN_SUCCESS: 0>
    >>> trace = backends.get("ascend-sim").last_trace
    >>> trace.tiling.block_dim, [f.kind for f in trace.findings][:1]
    (1, ['read-past-end'])
"""
from __future__ import annotations

import threading
from typing import Any, Mapping, Optional

import numpy as np

from opgraph.core.dtypes import dtype_of
from opgraph.core.ir import Graph
from opgraph.core.memory import MemoryPlan
from opgraph.core.platform import PRESETS, Platform, lookup
from ..numpy_backend import NUMPY_LOWERINGS, NumpyBackend, NumpyExecutable
from .sim import CoreTrace, Finding, KernelTrace, run_kernel, simulate
from .tiling import (NotModelledError, Tiling, TilingData, check_modelled, compute_tiling)

KERNEL_OP = "SyncBatchNormBackwardElemt"


class AscendSimBackend(NumpyBackend):
    """Numpy for every node except SyncBatchNormBackwardElemt, which runs on the simulated kernel.

    ``platform`` (name or Platform) fixes the SoC; by default it is the current platform when its
    NpuArch matches the node's ``arch`` attr, else the first preset with that arch. ``cores``
    and ``ub_size`` override the platform's vector-core count R and UB bytes. ``traces`` and
    ``last_trace`` are the calling thread's last run's (runs on other threads leave them be).
    """

    name = "ascend-sim"

    def __init__(self, platform: "str | Platform | None" = None, *, cores: Optional[int] = None,
                 ub_size: Optional[int] = None):
        self.platform = lookup(platform) if platform is not None else None
        self.cores, self.ub_size = cores, ub_size
        self._runs = threading.local()  # per thread: its last run's traces, its run's so far

    @property
    def traces(self) -> list[KernelTrace]:
        """Every launch of this thread's last run, in order."""
        return getattr(self._runs, "traces", [])

    @traces.setter
    def traces(self, value: list[KernelTrace]) -> None:
        """Set by :meth:`SimExecutable.run`, for this thread only."""
        self._runs.traces = value

    @property
    def last_trace(self) -> Optional[KernelTrace]:
        """The last launch of this thread's last run (None: it launched no simulated kernel)."""
        return getattr(self._runs, "last_trace", None)

    @last_trace.setter
    def last_trace(self, value: Optional[KernelTrace]) -> None:
        """Set by :meth:`SimExecutable.run`, for this thread only."""
        self._runs.last_trace = value

    def platform_for(self, arch: int, current: Optional[Platform] = None) -> Platform:
        """The SoC a node recorded for NpuArch ``arch`` runs on (NotModelledError if none)."""
        p = self.platform
        if p is None:
            cur = current or PRESETS["Ascend910B"]
            p = cur if cur.npu_arch == arch else next(
                (q for q in PRESETS.values() if q.npu_arch == arch), cur)
        if p.npu_arch != arch:
            raise NotModelledError(f"{KERNEL_OP} was recorded for DAV_{arch} but ascend-sim is "
                                   f"set to {p.soc} ({p.arch_name})")
        check_modelled(p)
        return p

    def tiling_for(self, numel: int, dtype: Any, param_dtype: Any, arch: int = 2201) -> Tiling:
        """The tiling this backend would launch for ``numel`` elements of (T, T1)."""
        p = self.platform_for(arch)
        return compute_tiling(numel, dtype, param_dtype, cores=self.cores_of(p))

    def cores_of(self, p: Platform) -> int:
        """R: the override, else the platform's vector-core count."""
        return p.vector_cores if self.cores is None else self.cores

    def ub_of(self, p: Platform) -> int:
        """UB bytes per core: the override, else the platform's."""
        return p.ub_size if self.ub_size is None else self.ub_size

    def compile(self, graph: Graph, memory_plan: MemoryPlan, platform: Platform) -> "SimExecutable":
        """Refuses a graph with an unmodelled kernel here, before anything runs."""
        for node in graph.nodes:
            if node.op == KERNEL_OP:
                self.platform_for(node.attrs.arch, platform)
        return SimExecutable(self, graph, memory_plan, platform, self.lowerings)


class SimExecutable(NumpyExecutable):
    """Runs like numpy; ``backend.traces`` / ``last_trace`` describe the last run."""

    def run(self, bindings: Mapping[str, Any], workspace: Any = None) -> dict[str, np.ndarray]:
        """See :meth:`Executable.run`; also sets this thread's ``backend.traces`` (every simulated
        launch, emptied first) and ``backend.last_trace``."""
        self.backend.traces, self.backend.last_trace = [], None
        outputs = super().run(bindings, workspace)
        self.backend.last_trace = self.backend.traces[-1] if self.backend.traces else None
        return outputs


def _lower_elemt(exe: SimExecutable, node, args: list) -> list:
    """SyncBatchNormBackwardElemt on the simulated kernel (tiling, UB, per-core trace)."""
    sim: AscendSimBackend = exe.backend
    arch = node.attrs.arch
    p = sim.platform_for(arch, exe.platform)
    shape, T = args[0].shape, args[0].dtype
    numel = int(np.prod(shape))
    if numel == 0:  # CANN launches no kernel for an empty tensor
        return [np.empty(shape, T)]
    tiling = compute_tiling(numel, dtype_of(T), dtype_of(args[2].dtype), cores=sim.cores_of(p))
    flat = [np.ascontiguousarray(a).reshape(-1) for a in args]
    out, trace = run_kernel(tiling, flat, ub_size=sim.ub_of(p), soc=p.soc, arch=arch)
    sim.traces.append(trace)
    return [out.reshape(shape)]


AscendSimBackend.lowerings = NUMPY_LOWERINGS.extend({KERNEL_OP: _lower_elemt})


__all__ = ["AscendSimBackend", "CoreTrace", "Finding", "KernelTrace", "NotModelledError",
           "Tiling", "TilingData", "check_modelled", "compute_tiling", "run_kernel", "simulate"]
