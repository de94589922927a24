"""``opgraph dump OP``: record an op_api on random tensors and dump its graph as text, JSON, DOT,
a table (one row per node) or ONNX, as recorded (level 0) or after
``opgraph.passes.optimize(graph, level)``; ``--passes`` shows what each pass changed (a diff of
the text dump, numbered like ``--dump-dir``'s files), ``--stats`` the cost at levels 0, 1, 2.

    >>> from opgraph.cli import main
    >>> main(["dump", "aclnnBatchNormElemtBackward", "--shape", "2,3", "--format", "text"])
    ... # doctest: +ELLIPSIS
    graph aclnnBatchNormElemtBackward(%gradOut: f32[2,3], ...
    0
"""
from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

from opgraph.core.graphdiff import NodeDiff, diff_nodes, node_key
from opgraph.core.ir import Graph
from opgraph.core.onnx_export import OnnxUnavailable
from opgraph.passes import (DumpInstrument, Instrument, Pass, PassManager, PassStats, RewritePass,
                            Rule, graph_stats, optimize, pipeline)
from opgraph.passes.stats import node_traffic
from .cases import add_op_subparsers, build_case, recorded_executor
from .common import (CliError, add_fast_math_option, check_output, conflict, counted, same_path,
                     write_output)

FORMATS = ("text", "json", "dot", "table", "onnx")


def render(graph: Graph, fmt: str) -> "str | bytes":
    """The graph in ``fmt`` (text / json / dot / table: a newline-ended string; onnx: bytes)."""
    if fmt == "onnx":
        try:
            return graph.to_onnx().SerializeToString()
        except OnnxUnavailable as e:
            raise CliError(f"--format onnx: {e}") from None
    text = {"text": str, "json": Graph.to_json, "dot": Graph.to_dot, "table": render_table}[fmt](graph)
    return text if text.endswith("\n") else text + "\n"


def render_table(graph: Graph) -> str:
    """One row per value like torch.fx's ``print_tabular``: name, op, inputs, type, kernel or
    free, bytes the node moves when launched (graph inputs and the output in their own rows)."""
    rows = [("name", "op", "inputs", "type", "cost", "bytes", "writes")]
    rows += [(f"%{v.name}", "(input)", "", str(v.type), "", "", "") for v in graph.inputs]
    for n in graph.nodes:
        free = n.opdef.is_free(n)
        rows.append((", ".join(f"%{v.name}" for v in n.outputs), n.op,
                     ", ".join(f"%{v.name}" for v in n.inputs),
                     ", ".join(str(v.type) for v in n.outputs), "free" if free else "kernel",
                     "0" if free else str(node_traffic(n)),
                     ", ".join(f"%{n.inputs[k].name}" for k in n.opdef.written(n))))
    rows += [("", "(output)", ", ".join(f"%{v.name}" for v in graph.outputs), "", "", "", "")]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {5}
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths))).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    st = graph_stats(graph)
    launches = counted(st.launches, "kernel launch", "kernel launches")
    lines.append(f"{counted(st.nodes, 'node')}, {launches}, {st.bytes_moved} bytes moved, "
                 f"workspace {st.workspace} B")
    return "\n".join(lines) + "\n"


def stats_rows(graph: Graph, fast_math: bool = False) -> list[dict]:
    """Nodes, kernel launches, bytes moved and workspace bytes at levels 0, 1, 2."""
    rows = []
    for level in (0, 1, 2):
        st = graph_stats(optimize(graph, level, fast_math=fast_math and level == 2))
        rows.append({"level": level, "nodes": st.nodes, "launches": st.launches,
                     "bytes_moved": st.bytes_moved, "workspace": st.workspace})
    return rows


def stats_text(rows: list[dict]) -> str:
    """The --stats table: levels side by side."""
    table = [("level", "nodes", "launches", "bytes moved", "workspace")]
    table += [tuple(str(r[k]) for k in ("level", "nodes", "launches", "bytes_moved", "workspace"))
              for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table) + "\n"


def fusion_note(graph: Graph) -> "str | None":
    """A line saying level 2 fused nothing, and which kernels could not be fused (None when it
    fused something or there was nothing to fuse)."""
    fused = optimize(graph, 2)
    if any(n.op in FUSED_KERNELS for n in fused.nodes):
        return None
    stuck = sorted({n.op for n in fused.nodes if not n.opdef.is_free(n) and n.opdef.expand is None
                    and not n.opdef.has_effects})
    if not stuck:
        return None
    return (f"note: level 2 fused nothing: {', '.join(stuck)} "
            f"{'defines' if len(stuck) == 1 else 'define'} no expansion into elementwise "
            "primitives (see README 'Define an l0 op')")


FUSED_KERNELS = ("FusedElementwise", "FusedReduce")  # what level 2's fusion passes make


# --- what each pass did --------------------------------------------------------------------------
@dataclass
class PassStep:
    """One pass of a pipeline run: ``index`` counts from 1 as ``--dump-dir`` numbers its files
    (``00-input`` is the graph before the first pass); ``hits``: rule → keys of the nodes it
    fired on (rewrite passes); ``diff``: what changed, node by node."""

    index: int
    name: str
    stats: PassStats
    before: Graph
    after: Graph
    hits: dict[str, list[str]]
    diff: NodeDiff

    @property
    def stem(self) -> str:
        """The file stem ``--dump-dir`` gives the graph after this pass, e.g. ``01-prune-identities``."""
        return f"{self.index:02d}-{self.name}"

    @property
    def changed(self) -> bool:
        """True when the pass counted a change or a node differs (added, removed, rewritten, rewired)."""
        return self.stats.changed or self.diff.changed

    def text_diff(self, before_stem: str) -> list[str]:
        """A unified diff of the text dumps, named like the --dump-dir files."""
        return list(difflib.unified_diff(str(self.before).splitlines(), str(self.after).splitlines(),
                                         f"{before_stem}.txt", f"{self.stem}.txt", lineterm=""))

    def summary(self) -> list[str]:
        """The rules that fired with the nodes they hit, then the nodes added/removed/changed."""
        lines = [f"{rule} on " + " ".join(f"%{k}" for k in keys) for rule, keys in self.hits.items()]
        d = self.diff
        for what, keys in (("removed", d.removed), ("added", d.added),
                           ("rewritten", d.rewritten), ("rewired", d.rewired)):
            if keys:
                lines.append(f"{what} {len(keys)}: " + " ".join(f"%{k}" for k in keys))
        return lines


class _Recorder(Instrument):
    """Snapshots before/after every pass (the pass manager edits its graph in place)."""

    def __init__(self, hits: list[dict[str, list[str]]]):
        self.hits, self.steps, self._before = hits, [], None

    def before(self, index: int, p: Pass, graph: Graph) -> None:
        self._before = graph.copy()

    def after(self, index: int, p: Pass, graph: Graph, stats: PassStats) -> None:
        after = graph.copy()
        self.steps.append(PassStep(index + 1, p.name, stats, self._before, after, self.hits[index],
                                   diff_nodes(self._before, after)))


def _recording(p: Pass, hits: dict[str, list[str]]) -> Pass:
    """``p`` with every rule noting the key of the node it fires on (other passes: ``p``)."""
    if not isinstance(p, RewritePass):
        return p

    def wrap(rule: Rule) -> Rule:
        def then(graph: Graph, node: Any) -> "bool | None":
            key = node_key(node)  # (before the rewrite detaches the node)
            done = rule.then(graph, node)
            if done is not False:
                hits.setdefault(rule.name, []).append(key)
            return done
        return Rule(rule.name, rule.op, rule.when, then)

    q = copy.copy(p)
    q.rules = [wrap(r) for r in p.rules]
    return q


def trace_passes(graph: Graph, level: int, fast_math: bool = False,
                 instruments: Sequence[Instrument] = ()) -> tuple[Graph, list[PassStep]]:
    """Run ``level``'s pipeline on ``graph`` recording every step (``instruments`` run too)."""
    passes = pipeline(level, fast_math)
    hits: list[dict[str, list[str]]] = [{} for _ in passes]
    rec = _Recorder(hits)
    out, _ = PassManager([_recording(p, h) for p, h in zip(passes, hits)],
                         [rec, *instruments]).run(graph)
    return out, rec.steps


def passes_text(steps: list[PassStep]) -> str:
    """--passes: for each pass that changed something, its stats, the rules that fired and the
    nodes they hit, and a unified diff of the text dump; then the passes that changed nothing."""
    out, prev = [], "00-input"
    for st in steps:
        if st.changed:
            hits = ", ".join(f"{k}={v}" for k, v in st.stats.counts.items() if v) or "no rule counts"
            out.append(f"// {st.stem}: {hits} ({st.stats.seconds * 1e3:.2f} ms)")
            out += [f"//   {line}" for line in st.summary()]
            out += st.text_diff(prev)
        prev = st.stem
    idle = [st.stem for st in steps if not st.changed]
    if not steps:
        out.append("// no passes at this level")
    if idle:
        out.append("// unchanged: " + ", ".join(idle))
    return "\n".join(out) + "\n"


def passes_doc(steps: list[PassStep]) -> list[dict]:
    """--passes --format json: every pass with its counts, hits, node diff and text diff."""
    prev, docs = "00-input", []
    for st in steps:
        d = st.diff
        docs.append({"index": st.index, "name": st.name, "stem": st.stem, "changed": st.changed,
                     "counts": st.stats.counts, "seconds": st.stats.seconds, "hits": st.hits,
                     "added": d.added, "removed": d.removed, "rewritten": d.rewritten,
                     "rewired": d.rewired, "diff": st.text_diff(prev)})
        prev = st.stem
    return docs


DUMP_FILE = re.compile(r"\d\d-([a-z0-9-]+)\.(?:txt|json|dot)")  # NN-<pass>.txt/.json/.dot


def dump_stems() -> frozenset[str]:
    """What follows ``NN-`` in the names of --dump-dir's files: ``input`` and every pass of
    every pipeline.

    >>> sorted(dump_stems())[:3]
    ['constant-fold', 'cse', 'dce']
    """
    return frozenset(["input"] + [p.name for level in (1, 2) for fast in (False, True)
                                  for p in pipeline(level, fast)])


def earlier_dumps(path: str, output: "str | None" = None) -> list[str]:
    """The files of an earlier run in --dump-dir ``path``, which this run replaces or removes
    (none when ``path`` does not exist yet). CliError naming --dump-dir unless ``path`` is a
    directory, or could become one, that holds nothing but such dumps (and -o's ``output``):
    another file there would be read as one of this run's dumps, or lost among them.

    >>> earlier_dumps("/nonexistent/dumps")
    []
    """
    if not path:
        raise CliError("--dump-dir: empty path", code=2)
    if not os.path.exists(path):
        return []
    if not os.path.isdir(path):
        raise CliError(f"--dump-dir {path!r}: exists and is not a directory", code=2)
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        raise CliError(f"--dump-dir {path!r}: cannot list it: {e.strerror or e}") from None
    stems, dumps = dump_stems(), []
    for name in names:
        full = os.path.join(path, name)
        if output not in (None, "-") and same_path(full, output):
            continue  # (-o's file: -o overwrites it)
        m = DUMP_FILE.fullmatch(name)
        if m is None or m.group(1) not in stems or os.path.isdir(full):
            raise CliError(f"--dump-dir {path!r}: holds {name!r}, which is no dump of opgraph's; "
                           "give a new or empty directory, or one holding only an earlier "
                           "run's dumps (they are replaced)", code=2)
        dumps.append(full)
    return dumps


def remove_files(paths: Sequence[str]) -> None:
    """Delete ``paths`` (one already gone is fine); CliError naming --dump-dir on a failure."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CliError(f"--dump-dir: cannot remove {path!r}, an earlier run's dump that this "
                           f"run does not replace: {e.strerror or e}") from None


def run_passes(graph: Graph, args: argparse.Namespace, level: int
               ) -> tuple[list[PassStep], list[tuple[str, str, str]]]:
    """Run --level's pipeline recording every step; returns the steps and --dump-dir's files
    as ``(path, text, option)`` for :func:`~.common.write_output` (none without --dump-dir)."""
    files: list[tuple[str, str, str]] = []
    dumps = None if args.dump_dir is None else DumpInstrument(
        args.dump_dir, write=lambda path, text: files.append((path, text, "--dump-dir")))
    _, steps = trace_passes(graph, level, args.fast_math, [dumps] if dumps else [])
    if dumps and not steps:  # level 0 runs no pass: its dump is the graph as recorded
        dumps.write_input(graph)
    return steps, files


def _report(graph: Graph, args: argparse.Namespace, level: int, earlier: Sequence[str] = ()
            ) -> tuple[str, list[tuple[str, str, str]], list[str]]:
    """What --stats, --passes and --dump-dir print (one JSON document with --format json),
    --dump-dir's files (see :func:`run_passes`) and the ``earlier`` dumps they do not replace
    (to remove once they are written)."""
    if args.format not in ("text", "json"):
        what = "--stats" if args.stats else "--passes" if args.passes else "--dump-dir"
        raise CliError(f"--format {args.format}: {what} prints text or json", code=2)
    as_json = args.format == "json"
    note = fusion_note(graph) if args.stats or level == 2 else None
    if args.stats:
        rows = stats_rows(graph, args.fast_math)
        if as_json:
            return json.dumps({"levels": rows, "note": note}, indent=1) + "\n", [], []
        return stats_text(rows) + (note + "\n" if note else ""), [], []
    steps, files = run_passes(graph, args, level)
    written = {path for path, _, _ in files}
    stale = [path for path in earlier if path not in written]
    if as_json:
        doc: dict[str, Any] = {"level": level, "passes": passes_doc(steps) if args.passes else None,
                               "note": note}
        if args.dump_dir is not None:
            doc["dump_dir"] = {"path": args.dump_dir, "files": len(files), "removed": len(stale)}
        return json.dumps(doc, indent=1) + "\n", files, stale
    text = passes_text(steps) if args.passes else ""
    if args.dump_dir is not None:
        removed = f"; removed {len(stale)} an earlier run wrote" if stale else ""
        text += f"wrote {len(files)} files to {args.dump_dir} (NN-<pass>.txt/.json/.dot{removed})\n"
    return text + (note + "\n" if note else ""), files, stale


def run(args: argparse.Namespace) -> int:
    """``opgraph dump OP``: the recorded graph (or, at ``--level`` 1 or 2, the optimised one) in
    ``--format``; with ``--stats``, ``--passes`` or ``--dump-dir`` the report instead. Returns 0."""
    for other, given in (("--passes", args.passes), ("--dump-dir", args.dump_dir is not None)):
        if args.stats and given:
            raise conflict("--stats", other, "--stats compares levels 0-2, "
                           f"{other} follows --level's pipeline")
    check_output(args.output)
    earlier = [] if args.dump_dir is None else earlier_dumps(args.dump_dir, args.output)
    if args.format == "onnx" and args.output in (None, "-") and not (args.stats or args.passes):
        raise CliError("--format onnx writes a binary file: give -o FILE.onnx", code=2)
    if args.level is None:  # as recorded, unless the fast-math rewrites (level 2) are asked for
        args.level = 2 if args.fast_math else 0
    case = build_case(args)
    graph = recorded_executor(case).graph
    if args.stats or args.passes or args.dump_dir is not None:
        text, files, stale = _report(graph, args, case.level, earlier)
        write_output(text, args.output, "report", also=files)  # all or none
        remove_files(stale)  # (only once this run's dumps are all in place)
        return 0
    if case.level > 0 or args.fast_math:
        graph = optimize(graph, case.level, fast_math=args.fast_math)
    text = render(graph, args.format)
    return write_output(text, args.output, f"{args.format}, {len(graph.nodes)} nodes (level {case.level})")


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMATS, default="text",
                   help="dump format: text, json, dot, table (one row per node), onnx (for "
                        "Netron; needs -o and the onnx package) (default: text)")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument("--passes", action="store_true",
                   help="for each pass of --level's pipeline that changed something: the rules "
                        "that fired, the nodes they hit and a diff of the text dump")
    p.add_argument("--dump-dir", metavar="DIR",
                   help="write the graph before and after each pass as numbered text/JSON/DOT "
                        "files; DIR must be new, empty or hold only an earlier run's dumps, "
                        "which are replaced (those this run does not write are removed)")
    p.add_argument("--stats", action="store_true",
                   help="print nodes, kernel launches, bytes moved and workspace for levels 0, 1, 2")
    add_fast_math_option(p)
    p.set_defaults(func=run)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``opgraph dump`` on ``subparsers``, one sub-parser per op_api; returns it."""
    p = subparsers.add_parser(
        "dump", help="record an op_api and dump its graph (text, json, dot, table, onnx)",
        description="Record OP on random tensors of --shape/--dtype (phase 1 only) and print "
                    "executor.graph (--level 0) or opgraph.passes.optimize(graph, level).",
        epilog="example: opgraph dump aclnnBatchNormElemtBackward --shape 2,3,1,4 "
               "--dtype float16 --format dot -o g.dot ('opgraph dump OP --help' lists OP's options)")
    add_op_subparsers(p, _options, level_shown="0, or 2 with --fast-math")
    return p
