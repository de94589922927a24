"""``opgraph view OP``: one self-contained HTML page (works offline) with the graph at levels 0,
1 and 2 and a before/after tab for every pass of ``--level``'s pipeline that changed something;
``--run BACKEND`` adds each node's time on that backend, ``--netron`` opens the graph in Netron.

    >>> import tempfile, os
    >>> from opgraph.cli import main
    >>> path = os.path.join(tempfile.mkdtemp(), "g.html")
    >>> main(["view", "aclnnBatchNormElemtBackward", "--shape", "2,3", "-o", path])
    ... # doctest: +ELLIPSIS
    wrote ...g.html: 3 levels, ... pass tabs (layout: ...)
    0
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from typing import Any, Optional, TextIO

from opgraph.core.html import Panel, Tab, diff_tab, render_html
from opgraph.core.ir import Graph
from opgraph.core.layout import ENGINES, default_engine
from opgraph.core.onnx_export import OnnxUnavailable
from opgraph.passes import graph_stats, optimize
from .cases import Case, add_op_subparsers, build_case, check, execute, record, recorded_executor
from .common import (CliError, add_fast_math_option, check_output, names_stdout, parse_backend,
                     write_output)
from .dump import PassStep, trace_passes
from .run import Profile, profiled_execute

LEVELS = (0, 1, 2)
LEVEL_NAMES = {0: "as recorded", 1: "what CANN launches", 2: "fused"}


def level_graphs(case: Case, graph: Graph, backend: Optional[str], fast_math: bool = False
                 ) -> dict[int, tuple[Graph, Optional[Profile]]]:
    """The graph at each level; with ``backend``, phase 1 + phase 2 at each level there, the
    second run timed (the first warms caches and compiled kernels up)."""
    out: dict[int, tuple[Graph, Optional[Profile]]] = {}
    for level in LEVELS:
        if backend is None:
            out[level] = (optimize(graph, level, fast_math=fast_math and level == 2), None)
            continue
        c = dataclasses.replace(case, level=level, backend=backend)
        for warm_up in (True, False):  # an executor runs once: phase 1 again (a cache hit)
            rec = record(c)
            check(rec.status, f"{case.spec.name}GetWorkspaceSize (level {level})")
            if warm_up:
                check(execute(c, rec), f"{case.spec.name} on {backend} (level {level})")
        prof = profiled_execute(c, rec)
        check(prof.status, f"{case.spec.name} on {backend} (level {level})")
        assert rec.executor is not None and rec.executor.program is not None
        out[level] = (rec.executor.program.compiled, prof)
    return out


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def level_tab(level: int, graph: Graph, prof: Optional[Profile]) -> Tab:
    """The tab of one level: its graph, cost figures and (with a run) where the time went."""
    st = graph_stats(graph)
    notes = [f"level {level} ({LEVEL_NAMES[level]}): {st.nodes} nodes, {st.launches} kernel "
             f"launches, {st.bytes_moved} bytes moved, workspace {st.workspace} B"]
    times = None
    if prof is not None:
        times = prof.times()
        if times:
            key, slowest = max(times.items(), key=lambda kv: kv[1])
            notes.append(f"phase 2 on {prof.backend} (after a warm-up run): "
                         f"{_fmt_s(prof.stop - prof.start)}; nodes "
                         f"{_fmt_s(sum(times.values()))}; slowest %{key} ({_fmt_s(slowest)})")
        else:
            notes.append(f"phase 2 on {prof.backend}: {_fmt_s(prof.stop - prof.start)} (this "
                         "backend reports no per-node times)")
    return Tab(f"level{level}", f"level {level}", [Panel(graph, times=times)], notes)


def pass_tab(step: PassStep) -> Tab:
    """A before/after tab of one pass, numbered like ``--dump-dir``'s files."""
    counts = ", ".join(f"{k}={v}" for k, v in step.stats.counts.items() if v) or "no rule counts"
    return diff_tab(f"pass{step.index:02d}", step.stem, step.before, step.after,
                    [f"pass {step.stem}: {counts}"] + step.summary())


def build_tabs(case: Case, graph: Graph, args: argparse.Namespace) -> list[Tab]:
    """Level tabs, then one tab per pass of ``--level``'s pipeline that changed something."""
    levels = level_graphs(case, graph, args.run, args.fast_math)
    tabs = [level_tab(n, *levels[n]) for n in LEVELS]
    _, steps = trace_passes(graph, case.level, args.fast_math)
    tabs += [pass_tab(s) for s in steps if s.changed]
    return tabs


def onnx_path(args: argparse.Namespace, level: int) -> str:
    """Where --netron writes the ONNX file: beside -o, else (the page on stdout, by any name)
    in the current directory."""
    if not names_stdout(args.output):
        return os.path.splitext(args.output)[0] + f".level{level}.onnx"
    return f"{args.op}.level{level}.onnx"


def netron_module() -> Any:
    """The netron package (an optional dependency, imported only for --netron), or CliError."""
    try:
        return importlib.import_module("netron")
    except ImportError:
        raise CliError("--netron: the netron package is not installed: pip install netron "
                       "(or open 'opgraph dump OP --format onnx -o g.onnx' in any Netron)") from None


def onnx_bytes(graph: Graph) -> bytes:
    """``graph`` as serialised ONNX for --netron, or CliError when onnx is missing."""
    try:
        return graph.to_onnx().SerializeToString()
    except OnnxUnavailable as e:
        raise CliError(f"--netron: {e}") from None


def serve_in_netron(netron: Any, path: str, say: TextIO) -> int:
    """Serve the ONNX file ``path`` in Netron (until Ctrl+C), saying so on ``say``."""
    netron.start(path)
    print("Netron is serving the graph; press Ctrl+C to stop", file=say)
    try:
        netron.wait()
    except KeyboardInterrupt:
        pass
    return 0


def run(args: argparse.Namespace) -> int:
    """``opgraph view OP``: write the HTML page (and with ``--netron`` the ONNX file, both or
    none, then serve it until Ctrl+C); returns 0."""
    check_output(args.output)
    netron = netron_module() if args.netron else None  # before anything is written
    case = build_case(args)
    graph = recorded_executor(case).graph
    onnx, onnx_file = None, onnx_path(args, case.level)
    if netron is not None:
        onnx = onnx_bytes(optimize(graph, case.level, fast_math=args.fast_math))
        check_output(onnx_file, "--netron")
    engine = args.layout or default_engine()  # (no layout engine: main's one-line error)
    tabs = build_tabs(case, graph, args)
    spec = case.spec
    shape = ",".join(map(str, args.shape))
    title = f"{spec.name} {args.dtype.short}[{shape}] on {case.platform}"
    sub = (f"{spec.summary} · tabs: levels 0-2, then each pass of level {case.level} that "
           "changed something" + (f" · times on {args.run}" if args.run else ""))
    page = render_html(tabs, title, selected=f"level{case.level}", engine=engine, subtitle=sub)
    summary = f"{len(LEVELS)} levels, {len(tabs) - len(LEVELS)} pass tabs (layout: {engine})"
    if onnx is None:
        return write_output(page, args.output, summary)
    write_output(page, args.output, summary, also=[(onnx_file, onnx, "--netron")])  # both or none
    say = sys.stderr if names_stdout(args.output) else sys.stdout  # not into the page
    print(f"wrote {onnx_file}: ONNX for Netron", file=say)
    return serve_in_netron(netron, onnx_file, say)


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", metavar="FILE", help="write the page to FILE (default: stdout)")
    p.add_argument("--run", metavar="BACKEND", type=parse_backend,
                   help="also run phase 2 at each level on BACKEND and show each node's time")
    p.add_argument("--netron", action="store_true",
                   help="also write the --level graph as ONNX and open it in Netron "
                        "(needs: pip install onnx netron)")
    p.add_argument("--layout", choices=ENGINES,
                   help="layout engine (default: graphviz's dot when on PATH, else grandalf)")
    add_fast_math_option(p)
    p.set_defaults(func=run)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``opgraph view`` on ``subparsers``, one sub-parser per op_api; returns it."""
    p = subparsers.add_parser(
        "view", help="an offline HTML page of an op_api's graph: levels 0-2, each pass, times",
        description="Record OP on random tensors and write one self-contained HTML page (no "
                    "external URL): the graph at levels 0, 1, 2 and a before/after tab for every "
                    "pass of --level's pipeline that changed something. Hover or click a node for "
                    "its op, attributes, types and the op_api line that recorded it.",
        epilog="example: opgraph view aclnnBatchNormElemtBackward --shape 2,3,1,4 --dtype "
               "float16 -o graph.html --run numpy  (then open graph.html in a browser)")
    add_op_subparsers(p, _options, level_default=2)
    return p
