"""The import rule, read from the source: layers import one way, no import cycle among the
project's modules (imports inside functions count), and no import inside a function except of
optional third-party packages, or of a dependency only one function needs whose import is
dear (:data:`ON_DEMAND`).

    core (opgraph.core) ← l0ops ← passes ← op_apis (opgraph.aclnn) ← ops / testing
        ← backends ← CLI, integrations (opgraph.cli, opgraph.torch) and the opgraph facade
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("opgraph", "l0ops", "backends")
# (module prefix, layer): the longest matching prefix wins
LAYERS = [("opgraph.core", 0), ("l0ops", 1), ("opgraph.passes", 2), ("opgraph.aclnn", 3),
          ("opgraph.ops", 4), ("opgraph.testing", 4), ("opgraph.capture", 4), ("backends", 5),
          ("opgraph.cli", 6), ("opgraph.torch", 6), ("opgraph.viz", 6), ("opgraph.__main__", 6),
          ("opgraph", 6)]
OPTIONAL_THIRD_PARTY = {"torch", "onnx", "netron", "grandalf", "webbrowser"}
# required packages imported where used, with why (each process would pay the import otherwise)
ON_DEMAND = {"networkx": "~0.19 s to import; only Graph.to_networkx uses it"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = modules()


def layer(module: str) -> int:
    """The layer of the longest prefix in LAYERS that ``module`` falls under (-1: none)."""
    matches = [(len(prefix), lvl) for prefix, lvl in LAYERS
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1] if matches else -1


def resolve(name: str) -> "str | None":
    """The project module an imported name lands in (a name inside a module → the module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported name, line, inside a function) for every import statement of ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if is_pkg else module.split(".")[:-1]
                    base = base[:len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    found.append((sub if resolve(sub) == sub else target, child.lineno, in_function))
            visit(child, inside)

    visit(tree, False)
    return found


EDGES = {m: [(resolve(n), line, fn) for n, line, fn in imports(m) if resolve(n) not in (None, m)]
         for m in MODULES}


def test_every_module_has_a_layer():
    assert all(layer(m) >= 0 for m in MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    bad = [f"{module}:{line} imports {target} (layer {layer(target)} > {layer(module)})"
           for target, line, _ in EDGES[module] if layer(target) > layer(module)]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    graph.add_edges_from((m, t) for m in MODULES for t, _, _ in EDGES[m])
    # (networkx's components, not a recursive walk: that needed a raised recursion limit,
    # which then stayed raised for every later test)
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph)
              if len(c) > 1 or any(graph.has_edge(v, v) for v in c)]
    assert not cycles, f"import cycles: {cycles}"


def test_no_imports_inside_functions_except_optional_packages():
    bad = []
    for module in MODULES:
        for name, line, in_function in imports(module):
            if in_function and name.split(".")[0] not in OPTIONAL_THIRD_PARTY | set(ON_DEMAND):
                bad.append(f"{module}:{line} imports {name} inside a function")
    assert not bad, "\n".join(bad)


def test_lower_layers_never_import_the_facade():
    """``opgraph`` (the package __init__) re-exports everything; below the top layer, modules
    import the module that defines a name instead."""
    bad = [f"{m}:{line}" for m in MODULES if layer(m) < 6
           for target, line, _ in EDGES[m] if target == "opgraph"]
    assert not bad, f"modules importing the opgraph facade: {bad}"


def test_the_rule_catches_a_violation(tmp_path, monkeypatch):
    """The checker itself: an upward import and a function-level import are found."""
    fake = tmp_path / "opgraph" / "core"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("import backends\n\ndef f():\n    import l0ops\n")
    monkeypatch.setitem(MODULES, "opgraph.core.bad", fake / "bad.py")
    found = imports("opgraph.core.bad")
    assert ("backends", 1, False) in found and ("l0ops", 4, True) in found
    assert layer(resolve("backends")) > layer("opgraph.core.bad")


def test_on_demand_packages_stay_unimported_by_opgraph_and_its_cli():
    code = ("import sys, opgraph, opgraph.cli, backends.native; "
            f"print(sorted(set({sorted(ON_DEMAND)!r}) & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported at startup: {out.stdout.strip()}"
