"""Pass infrastructure: passes return a new graph plus stats; rewrite rules live in tables run to
a fixed point with per-rule hit counts; a pass manager runs pipelines with instruments
(verify, print, numbered dumps, timing).

    >>> import l0ops
    >>> from opgraph.core.ir import Graph, TensorType
    >>> from opgraph.core.dtypes import DataType
    >>> g = Graph(); x = g.add_input("x", TensorType((2,), DataType.FLOAT))
    >>> g.outputs = [g.add_node("Cast", [x], to=DataType.FLOAT).outputs[0]]
    >>> drop = Rule("identity-cast", "Cast", lambda n: n.inputs[0].dtype == n.attrs.to,
    ...             lambda g, n: g.replace_all_uses_with(n.outputs[0], n.inputs[0]))
    >>> new, stats = RewritePass("demo", [drop]).run(g)
    >>> len(new.nodes), stats.counts
    (0, {'identity-cast': 1})
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, TextIO

from .ir import Graph
from .rules import Rule
from .types import GraphError


class PassError(RuntimeError):
    """A pass produced an invalid graph; the message names the pass."""


@dataclass
class PassStats:
    """What one pass did: ``counts`` per rule (or per kind of change) and its wall time."""

    name: str
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def changed(self) -> bool:
        """True when any count is non-zero (the pass changed the graph)."""
        return any(self.counts.values())

    def __str__(self) -> str:
        hits = ", ".join(f"{k}={v}" for k, v in self.counts.items() if v) or "no change"
        return f"{self.name}: {hits} ({self.seconds * 1e3:.2f} ms)"


class Pass:
    """A graph-to-graph transformation. ``bit_exact`` is False only for passes that change
    result bits; those must say so in their name and are never in a default pipeline."""

    name = "pass"
    bit_exact = True

    def run(self, graph: Graph) -> tuple[Graph, PassStats]:
        """``(new graph, stats)``: :meth:`apply` on a copy; ``graph`` is not changed. Stats carry no
        time here: :class:`PassManager` measures it."""
        g = graph.copy()
        counts = self.apply(g)
        return g, PassStats(self.name, counts)

    def apply(self, graph: Graph) -> dict[str, int]:
        """Mutate ``graph`` (already a copy) and return what changed."""
        raise NotImplementedError


class FunctionPass(Pass):
    """A pass from a function ``fn(graph) -> counts`` that edits the copy in place."""

    def __init__(self, name: str, fn: Callable[[Graph], dict[str, int]], bit_exact: bool = True):
        self.name, self.fn, self.bit_exact = name, fn, bit_exact

    def apply(self, graph: Graph) -> dict[str, int]:
        """See :meth:`Pass.apply`; returns what ``fn`` returns."""
        return self.fn(graph)


def sweep_dead(graph: Graph, only_free: bool = False) -> int:
    """Remove nodes whose outputs are unused and that have no effects (with ``only_free``: only
    those that launch no kernel); returns how many. One backward walk suffices: dropping a node
    can only kill nodes before it."""
    outputs = {id(v) for v in graph.outputs}
    dead = set()
    for node in reversed(graph.nodes):
        if node.opdef.written(node) or any(v.users or id(v) in outputs for v in node.outputs):
            continue
        if only_free and not node.opdef.is_free(node):
            continue
        for v in node.inputs:
            v.users = [u for u in v.users if u is not node]
        dead.add(id(node))
    if dead:
        graph.nodes[:] = [n for n in graph.nodes if id(n) not in dead]
    return len(dead)


class RewritePass(Pass):
    """Apply a table of rules until none fires (bounded by ``max_rounds``); dead nodes are swept
    after each round (``sweep_only_free``: only those that launch nothing)."""

    def __init__(self, name: str, rules: Sequence[Rule], max_rounds: int = 100,
                 sweep_only_free: bool = False):
        self.name, self.rules, self.max_rounds = name, list(rules), max_rounds
        self.sweep_only_free = sweep_only_free

    def apply(self, graph: Graph) -> dict[str, int]:
        """See :meth:`Pass.apply`; hits per rule name (every rule listed, 0 if it never fired).
        PassError if the rules still fire after ``max_rounds`` rounds."""
        counts = {r.name: 0 for r in self.rules}
        generic = [r for r in self.rules if r.op is None]
        by_op: dict = {}
        for rule in self.rules:  # table order kept: op-specific rules, then generic ones
            if rule.op is not None:
                by_op.setdefault(rule.op, []).append(rule)
        by_op = {op: rules + generic for op, rules in by_op.items()}
        for _ in range(self.max_rounds):
            fired = False
            for node in list(graph.nodes):
                if not node.outputs:  # removed by an earlier rule this round (detached)
                    continue
                for rule in by_op.get(node.op, generic):
                    # (a then that returns False found it could not rewrite after all)
                    if rule.when(node) and rule.then(graph, node) is not False:
                        counts[rule.name] += 1
                        fired = True
                        break
            if not fired:
                return counts
            sweep_dead(graph, self.sweep_only_free)
        raise PassError(f"pass {self.name}: rules did not reach a fixed point in {self.max_rounds} rounds")


# --- instruments ------------------------------------------------------------------------------
class Instrument:
    """Hooks around every pass of a pipeline."""

    def before(self, index: int, p: Pass, graph: Graph) -> None:
        """Called before pass ``p``, number ``index`` from 0, runs on ``graph``; does nothing."""

    def after(self, index: int, p: Pass, graph: Graph, stats: PassStats) -> None:
        """Called after pass ``p`` made ``graph``, with its ``stats`` (time included); does nothing."""


class VerifyInstrument(Instrument):
    """``graph.verify()`` after every pass; a failure names the pass."""

    def after(self, index: int, p: Pass, graph: Graph, stats: PassStats) -> None:
        """See :meth:`Instrument.after`; PassError naming pass ``index`` if the graph is invalid."""
        try:
            graph.verify()
        except GraphError as e:
            raise PassError(f"pass {index} ({p.name}) produced an invalid graph: {e}") from None


class PrintInstrument(Instrument):
    """Print the graph (and stats) after every pass."""

    def __init__(self, stream: Optional[TextIO] = None):
        self.stream = stream

    def after(self, index: int, p: Pass, graph: Graph, stats: PassStats) -> None:
        """See :meth:`Instrument.after`; the stats line, then the graph, to ``stream`` (stdout)."""
        out = self.stream or sys.stdout
        print(f"// after pass {index:02d} {stats}", file=out)
        print(graph, file=out)


class DumpInstrument(Instrument):
    """Write numbered dumps ``NN-<pass>.{txt,json,dot}`` into ``directory`` (made if missing),
    each ending in a newline, or hand each ``(path, text)`` to ``write`` (the CLI writes them all
    or none). Files already there that this run does not write stay: give a new directory per
    run (``opgraph dump --dump-dir`` removes an earlier run's dumps itself).

        >>> DumpInstrument("dumps", formats=("txt",)).formats
        ('txt',)
    """

    def __init__(self, directory: str, formats: Iterable[str] = ("txt", "json", "dot"),
                 write: Optional[Callable[[str, str], None]] = None):
        self.directory, self.formats = directory, tuple(formats)
        self.write = write or _write_text
        self.files: list[str] = []

    def _write(self, stem: str, graph: Graph) -> None:
        render = {"txt": str, "json": Graph.to_json, "dot": Graph.to_dot}
        for ext in self.formats:
            path = os.path.join(self.directory, f"{stem}.{ext}")
            text = render[ext](graph)
            self.write(path, text if text.endswith("\n") else text + "\n")
            self.files.append(path)

    def write_input(self, graph: Graph) -> None:
        """``00-input``: the graph before the first pass (a pipeline with none calls no hook)."""
        self._write("00-input", graph)

    def before(self, index: int, p: Pass, graph: Graph) -> None:
        """See :meth:`Instrument.before`; before the first pass, dumps ``00-input``."""
        if index == 0:
            self.write_input(graph)

    def after(self, index: int, p: Pass, graph: Graph, stats: PassStats) -> None:
        """See :meth:`Instrument.after`; dumps ``NN-<pass name>``, numbered from 01."""
        self._write(f"{index + 1:02d}-{p.name}", graph)


def _write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


class TimingInstrument(Instrument):
    """Collect ``(pass name, seconds)`` for every pass."""

    def __init__(self):
        self.times: list[tuple[str, float]] = []

    def after(self, index: int, p: Pass, graph: Graph, stats: PassStats) -> None:
        """See :meth:`Instrument.after`; appends ``(pass name, seconds)`` to :attr:`times`."""
        self.times.append((p.name, stats.seconds))


class PassManager:
    """Run passes in order with instruments; returns the final graph and per-pass stats."""

    def __init__(self, passes: Sequence[Pass], instruments: Sequence[Instrument] = (),
                 verify: bool = True):
        self.passes = list(passes)
        self.instruments = ([VerifyInstrument()] if verify else []) + list(instruments)

    def run(self, graph: Graph) -> tuple[Graph, list[PassStats]]:
        """The optimised copy of ``graph`` (never modified) and each pass's stats."""
        all_stats = []
        graph = graph.copy()  # one copy; passes that only define apply() then edit it in place
        for i, p in enumerate(self.passes):
            for ins in self.instruments:
                ins.before(i, p, graph)
            t0 = time.perf_counter()
            if type(p).run is Pass.run:
                stats = PassStats(p.name, p.apply(graph))
            else:
                graph, stats = p.run(graph)
            stats.seconds = time.perf_counter() - t0
            all_stats.append(stats)
            for ins in self.instruments:
                ins.after(i, p, graph, stats)
        return graph, all_stats
