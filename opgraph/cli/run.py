"""``opgraph run OP``: random inputs, both aclnn phases on a backend, a summary, and the error
against a float64 evaluation of the op's formula.

    >>> from opgraph.cli import main
    >>> main(["run", "aclnnBatchNormElemtBackward", "--shape", "2,3,4"])  # doctest: +ELLIPSIS
    op:            aclnnBatchNormElemtBackward ...
    max rel error: ...
    0
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opgraph.core.backend import get
from opgraph.core.graphdiff import node_key
from opgraph.core.executor import Executor
from opgraph.core.platform import lookup
from opgraph.core.status import Status
from .cases import Case, Recorded, add_op_subparsers, build_case, check, execute, record
from .common import (CliError, add_fast_math_option, check_output, counted, fmt_status, fmt_type,
                     fmt_values, names_stdout, write_output)
from .tiling import trace_report

# what `run` holds at once, in multiples of the op's inputs and outputs: the float64 draws and
# reference and the graph's temporaries (peak RSS over the inputs and outputs at 16M elements,
# 2026-12-05: BatchNormElemtBackward 4.5x, BatchNormStats 4.9x, BatchNormReduceBackward 2.6x)
PEAK = 5


@dataclass
class Profile:
    """Phase 2 timed: ``(node, start, stop)`` per node in ``time.perf_counter()`` seconds
    (empty when the backend has no per-node hook), the whole run's ``start``/``stop``, and the
    backend's kernel traces (ascend-sim's per-core work)."""

    backend: str
    status: Status
    start: float
    stop: float
    nodes: list[tuple[Any, float, float]] = field(default_factory=list)
    kernel_traces: list[Any] = field(default_factory=list)

    def times(self) -> dict[str, float]:
        """Seconds per node, keyed by the node's first output name (what the viewer shows)."""
        return {node_key(n): b - a for n, a, b in self.nodes}


def profiled_execute(case: Case, rec: Recorded) -> Profile:
    """Phase 2 like :func:`execute`, timing every node when the backend's executable has a
    ``profile`` hook (numpy, native, ascend-sim); other backends get one event for the run."""
    assert rec.executor is not None and rec.executor.program is not None
    events: list[tuple[Any, float, float]] = []
    exe = None
    if rec.executor.program.compiled.nodes:
        try:
            exe = rec.executor.program.executable(get(case.backend))
        except Exception:  # execute() reports why the backend cannot run this program
            exe = None
    hooked = exe is not None and hasattr(exe, "profile")
    if hooked:
        exe.profile = lambda node, a, b: events.append((node, a, b))
    start = time.perf_counter()
    try:
        status = execute(case, rec)
    finally:
        stop = time.perf_counter()
        if hooked:
            exe.profile = None
    return Profile(case.backend, status, start, stop, events,
                   list(getattr(get(case.backend), "traces", None) or []))


def chrome_trace(profile: Profile, title: str) -> dict:
    """The Chrome trace-event JSON (Perfetto, chrome://tracing) of a profiled phase 2: one
    complete ("X") event per launched node on the "kernels" row, free nodes on their own row,
    the whole run on a third; ascend-sim adds one row per simulated core."""
    us = lambda t: round((t - profile.start) * 1e6, 3)  # noqa: E731
    meta = lambda what, pid, tid, name: {"name": what, "ph": "M", "pid": pid, "tid": tid,  # noqa: E731
                                         "args": {"name": name}}
    ev = [meta("process_name", 1, 0, f"{title} on {profile.backend}"),
          meta("thread_name", 1, 0, "phase 2"), meta("thread_name", 1, 1, "kernels"),
          meta("thread_name", 1, 2, "free nodes (no launch)"),
          {"name": "phase 2", "cat": "run", "ph": "X", "pid": 1, "tid": 0, "ts": 0.0,
           "dur": us(profile.stop), "args": {"status": int(profile.status),
                                             "per_node": bool(profile.nodes)}}]
    for node, a, b in profile.nodes:
        free = node.opdef.is_free(node)
        ev.append({"name": node.op, "cat": "free" if free else "kernel", "ph": "X", "pid": 1,
                   "tid": 2 if free else 1, "ts": us(a), "dur": round((b - a) * 1e6, 3),
                   "args": {"node": node.header(), "source": node.source or ""}})
    for k, trace in enumerate(profile.kernel_traces):
        pid = 10 + k
        ev.append(meta("process_name", pid, 0, f"ascend-sim kernel {k} on {trace.soc} "
                                                 f"(host time of the simulation)"))
        for c in trace.cores:
            ev.append(meta("thread_name", pid, c.core + 1, f"core {c.core}"))
            ev.append({"name": f"core {c.core}", "cat": "core", "ph": "X", "pid": pid,
                       "tid": c.core + 1, "ts": us(c.began), "dur": round(c.seconds * 1e6, 3),
                       "args": {"start": c.start, "elements": c.elements, "tiles": c.tiles,
                                "bytes_in": c.bytes_in, "bytes_out": c.bytes_out,
                                "peak_ub": c.peak_ub}})
        for f in trace.findings:
            ev.append({"name": f.kind, "cat": "finding", "ph": "i", "s": "p", "pid": pid,
                       "tid": (f.core or 0) + 1, "ts": us(trace.cores[0].began) if trace.cores else 0,
                       "args": {"finding": str(f)}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"tool": "opgraph run --trace-json", "op": title, "backend": profile.backend}}


def errors(out: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """``(max |out − ref|, max |out − ref| / max |ref|)`` over the finite reference values; a
    position where both are NaN, or both the same infinity, agrees; (0, 0) when nothing is left.

    >>> errors(np.float32([1, 2]), np.float64([1, 2.5]))
    (0.5, 0.2)
    >>> errors(np.float32([np.nan, np.inf, 1]), np.float64([np.nan, np.inf, 1]))
    (0.0, 0.0)
    >>> errors(np.float32([1, 2]), np.float64([np.nan, 2]))
    (nan, nan)
    """
    o, r = out.astype(np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    same = (np.isnan(o) & np.isnan(r)) | (np.isinf(r) & (o == r))
    o, r = o[~same], r[~same]
    if o.size == 0:
        return 0.0, 0.0
    with np.errstate(all="ignore"):  # huge or infinite values: the IEEE result, no warning
        diff = float(np.max(np.abs(o - r)))
    finite = r[np.isfinite(r)]
    scale = float(np.max(np.abs(finite))) if finite.size else 0.0
    return diff, (diff / scale if scale > 0 else diff)


def run(args: argparse.Namespace) -> int:
    """``opgraph run OP``: both phases on random inputs, a summary and each output's error against
    the float64 formula; returns 0, or raises CliError when a phase's status is not success."""
    if args.trace_json is not None and (args.trace_json == "" or names_stdout(args.trace_json)):
        raise CliError("--trace-json: expected a file name (the summary goes to stdout)", code=2)
    check_output(args.trace_json, "--trace-json")
    case = build_case(args, peak=PEAK)
    spec, p = case.spec, lookup(case.platform)
    print(f"op:            {spec.name} ({spec.summary})")
    print(f"platform:      {p.soc} ({p.arch_name}, {p.vector_cores} vector cores)")
    fm = ", fast-math (NOT bit-exact)" if case.fast_math else ""
    print(f"backend:       {case.backend}, opt level {case.level}{fm}, seed {args.seed}")
    written = case.outputs
    ins = ", ".join(f"{p.name} {fmt_type(case.tensors.get(p.name))}" if p.kind == "tensor"
                    else f"{p.name}={case.arrays.get(p.name)}"
                    for p in spec.params if p.name not in written or p.role == "inout")
    print(f"inputs:        {ins}")
    with np.errstate(all="ignore"):  # any op_api's formula: NaN/inf for odd options, no warning
        ref = spec.reference(case.arrays)  # on the inputs as given (in-out tensors before the call)
    rec = record(case)
    print(f"phase 1:       {fmt_status(rec.status)}, workspace {rec.workspace_size} B")
    check(rec.status, f"{spec.name}GetWorkspaceSize")
    ex = rec.executor
    compiled = ex.compiled or ex.graph
    launches = counted(ex.kernel_count, "kernel launch", "kernel launches")
    print(f"graph:         {len(ex.graph.nodes)} recorded nodes, {len(compiled.nodes)} after level "
          f"{ex.opt_level}{_fast_math_note(case, ex)}, {launches}")
    prof = profiled_execute(case, rec) if args.trace_json else None
    status = prof.status if prof is not None else execute(case, rec)
    print(f"phase 2:       {fmt_status(status)}")
    check(status, spec.name)
    if prof is not None:
        doc = json.dumps(chrome_trace(prof, spec.name), indent=None)
        what = (f"{len(prof.nodes)} nodes timed" if prof.nodes else
                f"backend {case.backend!r} reports no per-node times: one event for phase 2")
        write_output(doc + "\n", args.trace_json, f"Chrome trace events, {what}", "--trace-json")
    if args.trace:
        print(trace_report(case.backend))
    for name, out in written.items():
        print(f"output:        {name} {fmt_type(out)}")
        print(f"values:        {fmt_values(out)}")
        if name not in ref:
            print("reference:     none for this output")
            continue
        abs_err, rel_err = errors(out, ref[name])
        print(f"reference:     {fmt_values(ref[name])} (float64 formula)")
        print(f"max abs error: {abs_err:.3e}")
        print(f"max rel error: {rel_err:.3e}  (max abs error / max |reference|)")
    return 0


def _fast_math_note(case: Case, ex: Executor) -> str:
    if ex.fast_math:
        return " with fast-math"
    return " (no fast-math rewrite applies to it)" if case.fast_math else ""


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", action="store_true",
                   help="print the backend's kernel trace after phase 2 (ascend-sim: tiling, "
                        "per-core work, findings)")
    p.add_argument("--trace-json", metavar="FILE",
                   help="write phase 2's per-node timings as Chrome trace-event JSON (open in "
                        "Perfetto or chrome://tracing); ascend-sim adds one row per core")
    add_fast_math_option(p)
    p.set_defaults(func=run)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``opgraph run`` on ``subparsers``, one sub-parser per op_api; returns it."""
    p = subparsers.add_parser(
        "run", help="run an op_api on random inputs and check it against float64",
        description="Random valid inputs, phase 1 + phase 2 on --backend, a summary, and the max "
                    "abs / relative error of every output against the op's formula evaluated in "
                    "float64 on the same (rounded) inputs.",
        epilog="example: opgraph run aclnnBatchNormElemtBackward --shape 8,16,7,7 --dtype "
               "bfloat16 --platform Ascend950 --seed 1")
    add_op_subparsers(p, _options, backend=True, seed=True)  # --level: 1 for ascend-sim
    return p
