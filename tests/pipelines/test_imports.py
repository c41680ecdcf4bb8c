"""How `operators/` and `pipelines/` import each other: no cycle, and a light command line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from .conftest import REPO

PACKAGES = {"operators": "batchlm.operators", "pipelines": "batchlm.pipelines"}


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((REPO / folder).glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules `path` imports anywhere: at the top, inside functions and under
    `if TYPE_CHECKING:`."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = node.module or ""
            if node.level:
                module = f"{base}.{module}" if module else base
            targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return [*path[path.index(dep) :], dep] if dep in path else [node, dep]
            if dep not in state:
                found = visit(dep, [*path, dep])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_no_import_cycle_in_operators_or_pipelines():
    modules = _modules()
    graph = {name: _imported(name, path, set(modules)) for name, path in modules.items()}
    assert "batchlm.pipelines.job" in graph and "batchlm.operators.rows" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_help_loads_neither_torch_nor_the_engine():
    code = (
        "import sys\n"
        "from batchlm.pipelines import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('torch', 'ray', 'pyspark', 'batchlm.engine', 'batchlm.operators.rows')\n"
        "print('loaded:', ','.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "batchlm run conf/generate_demo.yaml" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "loaded:"
