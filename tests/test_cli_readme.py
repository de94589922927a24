"""The README's tables against the code. "Command line": every option a command takes is in its
row, and every option a row names exists (the rows had lost syncbn's --seed and --timeout,
capture's --shape, --dtype and -o, emit-cpp's --embed-limit). "Public API": every name it gives
exists, and it gives every public name of the opgraph facade (it lacked get_opt_level,
get_backend_name, the dtypes, the IR classes and the errors). And every ``$ opgraph ...``
sample prints what the README shows."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import opgraph
from opgraph.cli import COMMANDS, build_parser, main

README = Path(__file__).resolve().parent.parent / "README.md"
OP = "aclnnBatchNormElemtBackward"
OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)")


def section(title: str) -> str:
    """The README's text under ``## title``, up to the next ``## ``."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    return text[start:text.index("\n## ", start + 1)]


def command_cells() -> list[str]:
    """The first cell of each row of the Command line table."""
    rows = [line for line in section("Command line").splitlines() if line.startswith("| `opgraph")]
    return [re.split(r"(?<!\\)\|", row)[1] for row in rows]


def subparsers(parser: argparse.ArgumentParser) -> "dict[str, argparse.ArgumentParser]":
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def spellings(name: str) -> list[set[str]]:
    """The options ``opgraph NAME`` takes, each as its spellings (``{"-o", "--output"}``); for
    an OP command, with OP."""
    parser = subparsers(build_parser())[name]
    ops = subparsers(parser)
    if ops:  # the op's own options: "opgraph COMMAND OP --help lists its own options (for ...)"
        parser = ops[OP]
    return [set(a.option_strings) - {"-h", "--help"} for a in parser._actions if a.option_strings]


def options(name: str) -> set[str]:
    """Every spelling of every option ``opgraph NAME`` takes."""
    return set().union(*spellings(name))


def op_options() -> set[str]:
    """The options the README lists as aclnnBatchNormElemtBackward's own."""
    found = re.search(r"\(for\s+aclnnBatchNormElemtBackward:\s+`([^`]*)`", section("Command line"))
    assert found, "the sentence naming the op's own options is gone"
    return set(found.group(1).split())


def names() -> list[str]:
    return [m.__name__.rsplit(".", 1)[-1].replace("_", "-") for m in COMMANDS]


@pytest.mark.parametrize("name", names())
def test_every_option_of_a_command_is_in_its_row(name):
    cells = [c for c in command_cells() if re.search(rf"`opgraph {re.escape(name)}[ `]", c)]
    assert cells, f"no row for opgraph {name}"
    shown = {o for c in cells for o in OPTION.findall(c)}
    if subparsers(subparsers(build_parser())[name]):  # an OP command: "[op options]", "..."
        shown |= op_options()
    missing = [sorted(o) for o in spellings(name) if o and not o & shown]
    assert not missing, f"opgraph {name}: {missing} not in its README row"


def test_every_option_a_row_names_exists():
    every = {"--load", "--traceback", "--version"}
    for cell in command_cells():
        commands = re.findall(r"`opgraph ([a-z-]+)", cell)
        known = every.union(*(options(c) for c in commands))
        if any(subparsers(subparsers(build_parser())[c]) for c in commands):
            known |= op_options()
        assert set(OPTION.findall(cell)) <= known, (cell, set(OPTION.findall(cell)) - known)


def test_the_op_options_the_readme_lists_are_the_ops():
    assert op_options() <= {o for a in subparsers(subparsers(build_parser())["dump"])[OP]._actions
                            for o in a.option_strings}


# --- the Public API table ------------------------------------------------------------------------
ROOTS = ("opgraph", "backends", "l0ops")


def api_names() -> list[str]:
    """The dotted names the first column of the Public API table gives, made whole: a bare name
    belongs where the name before it in its cell does (`opgraph.ops.batch_norm_stats`,
    `batch_norm_elemt` ...); `a.get/register` is two names; `aclnnXxx` and `executor.` are
    placeholders."""
    found = []
    for row in section("Public API").splitlines():
        if not row.startswith("| `"):
            continue
        where = ""
        for span in re.findall(r"`([^`]+)`", re.split(r"(?<!\\)\|", row)[1]):
            name = span.split("(")[0].strip()
            if not re.fullmatch(r"[A-Za-z_][\w.]*(/\w+)*", name) or name.startswith("executor."):
                continue
            if name.split(".")[0] not in ROOTS:
                name = f"{where}.{name}"
            where = name.rsplit(".", 1)[0]
            head, _, tail = name.rpartition(".")
            found += [f"{head}.{t}" for t in tail.split("/") if "Xxx" not in t]
    return found


def resolve(name: str) -> object:
    """The object a dotted name names (its longest importable module, then attributes)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for attr in parts[k:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_every_name_of_the_public_api_table_exists():
    names = api_names()
    assert "opgraph.ops.batch_norm_elemt" in names and "backends.available" in names
    if importlib.util.find_spec("torch") is None:  # opgraph.torch needs torch
        names = [n for n in names if not n.startswith("opgraph.torch.")]
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, missing


def test_the_public_api_table_names_every_public_name_of_opgraph():
    """Every name ``from opgraph import *`` gives, but the subpackages, is in the table."""
    subpackages = {n for n in opgraph.__all__ if inspect.ismodule(getattr(opgraph, n))}
    want = {f"opgraph.{n}" for n in opgraph.__all__} - {f"opgraph.{n}" for n in subpackages}
    assert not want - set(api_names()) - {"opgraph.__version__"}, sorted(want - set(api_names()))


# --- the README's sample outputs -----------------------------------------------------------------
TIMES = re.compile(r" \d+(\.\d+)? ms")  # syncbn's first-call times
def samples() -> list[tuple[str, list[str]]]:
    """``(command, the lines the README shows it printing)`` for every ``$ opgraph ...`` of its
    code blocks, and the dump of "What the op_api records"."""
    found = []
    for block in fenced_blocks(README.read_text(), ""):
        for cmd, out in re.findall(r"^\$ (opgraph .*)\n((?:(?!\$ ).*\n)*)", block, re.M):
            found.append((cmd, out.splitlines()))
    records = section("What the op_api records")
    cmd = re.search(r"^`(opgraph dump [^`]*)`", records, re.M).group(1)
    found.append((cmd, fenced_blocks(records, "")[0].splitlines()))
    return found


def fenced_blocks(text: str, lang: str) -> list[str]:
    """The contents of the ```LANG fenced blocks of ``text``."""
    blocks, inside, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if inside is None:
                inside, lines = line[3:].strip(), []
            else:
                if inside == lang:
                    blocks.append("\n".join(lines) + "\n")
                inside = None
        elif inside is not None:
            lines.append(line)
    return blocks


@pytest.mark.parametrize("cmd,shown", samples(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_readme_shows_what_the_command_prints(cmd, shown, capsys, monkeypatch):
    monkeypatch.chdir(README.parent)  # (examples/capture_syncbn.py)
    cmd, _, grep = cmd.partition(" | grep -v ")
    if cmd.startswith("opgraph syncbn"):  # gloo processes: needs torch; its times vary
        pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")
        shown = [TIMES.sub(" ms", line) for line in shown]
    assert main(cmd.split()[1:]) == 0
    out = capsys.readouterr().out.splitlines()
    if cmd.startswith("opgraph syncbn"):
        out = [TIMES.sub(" ms", line) for line in out]
    if grep:  # `| grep -v free`; the README's comments after '#' are "added here, not printed"
        out = [line for line in out if grep not in line]
        shown = [re.sub(r"\s+#.*$", "", line) for line in shown]
    assert [line.rstrip() for line in out] == [line.rstrip() for line in shown]
