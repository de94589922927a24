"""Every docstring example in the library, and in the tests' helper modules, runs and prints
what it claims."""
from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import backends
import l0ops
import opgraph

SKIP = {"opgraph.__main__"}


def _modules():
    for pkg in (opgraph, l0ops, backends):
        yield pkg.__name__
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name not in SKIP:
                yield info.name


@pytest.mark.parametrize("name", sorted(set(_modules())))
def test_docstring_examples(name):
    if name == "opgraph.torch" or name.startswith("opgraph.torch."):  # the optional extra
        pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


# the tests' own helpers (tests/*.py but the test files and conftest), importable as the tests import them
HELPERS = sorted(p.stem for p in Path(__file__).parent.glob("*.py")
                 if not p.stem.startswith("test_") and p.stem != "conftest")


@pytest.mark.parametrize("name", HELPERS)
def test_test_helper_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name),
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in tests/{name}.py"


def test_cli_modules_are_checked_too():
    cli = {"opgraph.cli", "opgraph.cli.common", "opgraph.cli.demo", "opgraph.cli.tiling"}
    assert cli <= set(_modules())
