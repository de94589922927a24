"""The simulated DAV_2201 SyncBatchNormBackwardElemt kernel: core by core, tile by tile, with a
trace of what every core moved and any safety findings.

Global memory is modelled as flat tensors of N elements that the kernel addresses in its padded
range (L elements, whole 512-byte blocks): reads past a tensor's end return zeros and writes past
it are dropped, and both are recorded as findings. A per-element write counter on the output
checks coverage (every element written exactly once). UB is modelled as the kernel's
``pipe.InitBuffer`` reservations, checked against the platform's UB size; an overflow is a
finding, never a crash. The math of each tile is :func:`l0ops.batchnorm.elemt_backward`.

    >>> import numpy as np
    >>> from backends.ascend_sim.tiling import compute_tiling
    >>> t = compute_tiling(8, "float32", cores=40)
    >>> ins = [np.arange(8, dtype=np.float32)] * 2 + [np.zeros(8, np.float32)] + \\
    ...       [np.ones(8, np.float32)] * 2 + [np.zeros(8, np.float32), np.full(8, 0.1, np.float32)]
    >>> out, trace = run_kernel(t, ins, ub_size=196608)
    >>> out.tolist()[:3]
    [0.0, 0.8999999761581421, 1.7999999523162842]
    >>> sorted({f.kind for f in trace.findings})
    ['read-past-end', 'write-past-end']
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import numpy as np

from l0ops.batchnorm import elemt_backward
from .tiling import Tiling, TilingData

INPUT_NAMES = ("gradOut", "input", "mean", "invstd", "weight", "meanDy", "meanDyXmu")
OUTPUT_NAME = "gradInput"
MAX_RUNS = 16  # coverage findings listed per kind before the rest are summarised


@dataclass(frozen=True)
class Finding:
    """A safety finding. ``kind``: read-past-end, write-past-end, double-write, unwritten or
    ub-overflow; ``start``/``stop``: the element range (bytes for ub-overflow)."""

    kind: str
    tensor: str
    start: int
    stop: int
    nbytes: int
    core: Optional[int] = None
    tile: Optional[int] = None
    note: str = ""

    def __str__(self) -> str:
        where = "" if self.core is None else f" core {self.core}" + (
            "" if self.tile is None else f" tile {self.tile}")
        if self.kind == "ub-overflow":
            return f"{self.kind:<14} {self.note}"
        text = f"{self.kind:<14} {self.tensor}{where}: elements [{self.start}, {self.stop}) ({self.nbytes} B)"
        return text + (f" {self.note}" if self.note else "")


@dataclass
class CoreTrace:
    """One core's work: its range, tiles, bytes moved GM→UB and UB→GM, and UB reserved."""

    core: int
    start: int
    elements: int
    tiles: int
    tile_elems: int
    tail_elems: int
    bytes_in: int = 0
    bytes_out: int = 0
    peak_ub: int = 0
    # host wall time of simulating this core (time.perf_counter() seconds; not NPU time): what
    # the per-core rows of ``opgraph run --trace-json`` show
    began: float = field(default=0.0, compare=False)
    seconds: float = field(default=0.0, compare=False)


@dataclass
class KernelTrace:
    """One kernel launch: the tiling, every core's trace and the safety findings."""

    tiling: Tiling
    ub_size: int
    soc: str = ""
    cores: list[CoreTrace] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the launch raised no finding."""
        return not self.findings

    def of(self, kind: str) -> list[Finding]:
        """The findings of one kind."""
        return [f for f in self.findings if f.kind == kind]

    @property
    def peak_ub(self) -> int:
        """The most UB bytes any core reserved (0 when no core ran)."""
        return max((c.peak_ub for c in self.cores), default=0)

    def __str__(self) -> str:
        t = self.tiling
        head = (f"ascend-sim SyncBatchNormBackwardElemt {t.dtype.short}/{t.param_dtype.short} "
                f"({t.path} path) on {self.soc or '?'}: N={t.numel} L={t.padded}, "
                f"blockDim {t.block_dim} of R={t.cores_available}, tiling key {t.key}, "
                f"UB {self.ub_size} B")
        lines = [head, "TilingData " + " ".join(f"{k}={v}" for k, v in t.data.items()),
                 "  core       start  elements  tiles  tile/last   bytes in  bytes out  peak UB"]
        for c in self.cores:
            lines.append(f"  {c.core:>4}  {c.start:>10}  {c.elements:>8}  {c.tiles:>5}  "
                         f"{f'{c.tile_elems}/{c.tail_elems}':>9}  {c.bytes_in:>9}  {c.bytes_out:>9}  "
                         f"{c.peak_ub:>7}")
        lines.append(f"  total bytes in {sum(c.bytes_in for c in self.cores)}, "
                     f"out {sum(c.bytes_out for c in self.cores)}")
        lines.append(f"findings: {len(self.findings) or 'none'}")
        lines += [f"  {f}" for f in self.findings]
        return "\n".join(lines)


class GlobalTensor:
    """A flat GM tensor of ``numel`` elements; ``data`` is None in a dry run (accounting only)."""

    def __init__(self, name: str, data: Optional[np.ndarray], numel: int, dtype: np.dtype,
                 findings: list[Finding]):
        self.name, self.data, self.numel, self.dtype = name, data, numel, np.dtype(dtype)
        self.findings = findings

    def _past_end(self, kind: str, start: int, stop: int, core: int, tile: int) -> None:
        lo = max(start, self.numel)
        if stop > lo:
            self.findings.append(Finding(kind, self.name, lo, stop, (stop - lo) * self.dtype.itemsize,
                                         core, tile, f"beyond the tensor's end ({self.numel} elements)"))

    def read(self, start: int, count: int, core: int, tile: int) -> Optional[np.ndarray]:
        """DataCopy GM→UB of ``count`` elements; the part past the end reads as zeros."""
        self._past_end("read-past-end", start, start + count, core, tile)
        if self.data is None:
            return None
        buf = np.zeros(count, self.dtype)
        stop = min(start + count, self.numel)
        if stop > start:
            buf[:stop - start] = self.data[start:stop]
        return buf


class OutputTensor(GlobalTensor):
    """The output in GM, with a per-element write counter over the addressed range."""

    def __init__(self, numel: int, extent: int, dtype: np.dtype, dry: bool, findings: list[Finding]):
        super().__init__(OUTPUT_NAME, None if dry else np.empty(numel, dtype), numel, dtype, findings)
        self.writes = np.zeros(max(extent, numel), np.int32)  # grows if a broken tiling overruns

    def write(self, start: int, values: Optional[np.ndarray], count: int, core: int, tile: int) -> None:
        """DataCopy UB→GM; the part past the end is dropped (and recorded)."""
        self._past_end("write-past-end", start, start + count, core, tile)
        if start + count > self.writes.size:
            self.writes = np.concatenate((self.writes, np.zeros(start + count - self.writes.size, np.int32)))
        self.writes[start:start + count] += 1
        stop = min(start + count, self.numel)
        if self.data is not None and values is not None and stop > start:
            self.data[start:stop] = values[:stop - start]

    def coverage_findings(self) -> list[Finding]:
        """Elements written more than once (anywhere) or never (within the tensor)."""
        out = []
        for kind, mask in (("double-write", self.writes > 1),
                           ("unwritten", self.writes[:self.numel] == 0)):
            runs = _runs(mask)
            for lo, hi in runs[:MAX_RUNS]:
                note = (f"(written up to {int(self.writes[lo:hi].max())} times)"
                        if kind == "double-write" else "(no core writes it)")
                out.append(Finding(kind, self.name, lo, hi, (hi - lo) * self.dtype.itemsize, note=note))
            if len(runs) > MAX_RUNS:
                rest = runs[MAX_RUNS:]
                out.append(Finding(kind, self.name, rest[0][0], rest[-1][1],
                                   sum(h - l for l, h in rest) * self.dtype.itemsize,
                                   note=f"(and {len(rest)} more ranges)"))
        return out


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal ``[start, stop)`` runs where ``mask`` is true."""
    if not mask.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


class UnifiedBuffer:
    """A core's UB: ``pipe.InitBuffer`` reservations, checked against ``size``."""

    def __init__(self, size: int):
        self.size, self.reserved = size, 0
        self.buffers: list[tuple[str, int]] = []

    def init_buffer(self, name: str, num: int, nbytes: int) -> None:
        """Record ``pipe.InitBuffer``: ``num`` slots of ``nbytes`` bytes named ``name`` (the overflow
        check against ``size`` is :func:`simulate`'s, a finding, not an error)."""
        self.buffers.append((name, num * nbytes))
        self.reserved += num * nbytes


class CoreKernel:
    """One AI Vector core running the kernel on block ``core`` of ``tiling``."""

    def __init__(self, tiling: Tiling, core: int, inputs: Sequence[GlobalTensor],
                 output: OutputTensor, ub_size: int, arch: int):
        self.tiling, self.inputs, self.output, self.arch = tiling, inputs, output, arch
        r = tiling.data.core(core)
        self.range = r
        self.trace = CoreTrace(core, r.start, r.elements, r.tiles, tiling.data.tileDataNum, r.tail)
        self.ub = UnifiedBuffer(ub_size)
        for b in tiling.ub_plan():
            self.ub.init_buffer(b.name, b.num, b.nbytes)
        self.trace.peak_ub = self.ub.reserved

    def process(self) -> None:
        """The kernel's main loop: every tile CopyIn → Compute → CopyOut, the last with the tail."""
        tile = self.tiling.data.tileDataNum
        for i in range(self.range.tiles):
            count = tile if i < self.range.tiles - 1 else self.range.tail
            offset = self.range.start + i * tile
            operands = self.copy_in(offset, count, i)
            result = self.compute(operands)
            self.copy_out(offset, result, count, i)

    def copy_in(self, offset: int, count: int, tile: int) -> list[Optional[np.ndarray]]:
        """CopyIn of tile ``tile``: ``count`` elements from ``offset`` of every input (zeros past an
        end, recorded as a finding; None in a dry run), counted in ``bytes_in``."""
        out = [g.read(offset, count, self.range.core, tile) for g in self.inputs]
        self.trace.bytes_in += count * sum(g.dtype.itemsize for g in self.inputs)
        return out

    def compute(self, operands: list[Optional[np.ndarray]]) -> Optional[np.ndarray]:
        """The T/T1 template paths: direct in T, or cast up to float temporaries, compute, and
        cast back round-to-nearest-even."""
        if operands[0] is None:
            return None
        if self.tiling.path == "direct":
            return elemt_backward(*operands, arch=self.arch)
        tmp = [a.astype(np.float32) for a in operands]
        return elemt_backward(*tmp, arch=self.arch).astype(operands[0].dtype)

    def copy_out(self, offset: int, values: Optional[np.ndarray], count: int, tile: int) -> None:
        """CopyOut of tile ``tile``: ``count`` elements of ``values`` to the output at ``offset``
        (writes past its end dropped and recorded), counted in ``bytes_out``."""
        self.output.write(offset, values, count, self.range.core, tile)
        self.trace.bytes_out += count * self.output.dtype.itemsize


def run_kernel(tiling: Tiling, inputs: Optional[Sequence[np.ndarray]], *, ub_size: int,
               soc: str = "", arch: int = 2201) -> tuple[Optional[np.ndarray], KernelTrace]:
    """Run the kernel on ``inputs`` (seven flat arrays of ``tiling.numel`` elements, in the order
    gradOut, input, mean, invstd, weight, meanDy, meanDyXmu) and return ``(output, trace)``.
    With ``inputs=None`` it is a dry run: the same accounting and findings, no data."""
    return simulate(tiling, tiling.data, tiling.block_dim, inputs, ub_size=ub_size, soc=soc, arch=arch)


def simulate(tiling: Tiling, data: TilingData, block_dim: int,
             inputs: Optional[Sequence[np.ndarray]], *, ub_size: int, soc: str = "",
             arch: int = 2201) -> tuple[Optional[np.ndarray], KernelTrace]:
    """Like :func:`run_kernel` but with an arbitrary TilingData and blockDim (e.g. a hand-made,
    broken one) launched over ``tiling``'s tensors, to see what the findings catch."""
    tiling = replace(tiling, data=data, block_dim=block_dim)
    n, T, T1 = tiling.numel, tiling.dtype.np, tiling.param_dtype.np
    if inputs is not None:
        if len(inputs) != len(INPUT_NAMES):
            raise ValueError(f"the kernel takes {len(INPUT_NAMES)} inputs, got {len(inputs)}")
        for name, a in zip(INPUT_NAMES, inputs):
            if a.ndim != 1 or a.size != n:
                raise ValueError(f"{name}: expected a flat array of {n} elements, got shape {a.shape}")
    trace = KernelTrace(tiling, ub_size, soc)
    gm = [GlobalTensor(name, None if inputs is None else inputs[k], n, T if k < 2 else T1,
                       trace.findings) for k, name in enumerate(INPUT_NAMES)]
    extent = max((data.core(i).stop for i in range(block_dim)), default=0)
    out = OutputTensor(n, extent, T, inputs is None, trace.findings)
    for i in range(block_dim):
        core = CoreKernel(tiling, i, gm, out, ub_size, arch)
        began = time.perf_counter()
        core.process()
        core.trace.began, core.trace.seconds = began, time.perf_counter() - began
        trace.cores.append(core.trace)
    trace.findings.extend(out.coverage_findings())
    over = [c.core for c in trace.cores if c.peak_ub > ub_size]
    if over:
        need = max(c.peak_ub for c in trace.cores)
        trace.findings.append(Finding(
            "ub-overflow", "UB", 0, need, need,
            note=f"cores {_ranges_text(over)} reserve {need} B of UB but the core has {ub_size} B "
                 f"(over by {need - ub_size} B)"))
    return out.data, trace


def _ranges_text(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``'0-2, 5'``."""
    parts, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)
