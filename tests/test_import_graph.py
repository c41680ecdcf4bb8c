"""Imports flow one way: `LLM` → engine → scheduler / runner → models → layers → kernels.

The graph is read from the source with `ast` (imports inside functions and under
`if TYPE_CHECKING:` count too: a lazy import is still a dependency), at two grains:

- modules: no module reaches itself through imports;
- folders: every subpackage (`engine/worker`, `engine/models/layers`, ...) is one node, and
  each module directly in a top package (`engine/llm.py`, `gpu_kernels/gemv.py`) its own;
  no folder reaches itself either, so that one package never both uses and serves another.

`engine/core/` (scheduler, KV cache manager) is pure bookkeeping: it imports nothing from
the runners, the models or the kernels.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "engine": "batchlm.engine",
    "gpu_kernels": "batchlm.kernels",
    "operators": "batchlm.operators",
    "pipelines": "batchlm.pipelines",
}


def _module_files() -> dict[str, Path]:
    """Dotted module name → file, for every module of the four packages."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _module_files()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """The modules of the four packages that module `name` imports, anywhere in its body."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:  # `from pkg import module`
                    found.add(f"{target}.{alias.name}")
                elif target in MODULES:
                    found.add(target)
    found.discard(name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _folder(name: str) -> str:
    """The node of `name` in the folder graph: its subpackage, or itself when it sits
    directly in a top package."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    return name if package in PACKAGES.values() else package


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(cycles: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for component in cycles:
        members = set(component)
        lines.append(" <-> ".join(component))
        lines += [f"    {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "\n".join(lines)


def test_the_graph_sees_the_packages():
    """The walk finds the modules and their imports (an empty graph would pass the rest)."""
    assert "batchlm.engine.llm" in GRAPH and "batchlm.kernels.decode_attention" in GRAPH
    assert "batchlm.engine.llm_engine" in GRAPH["batchlm.engine.llm"]
    assert "batchlm.engine.core.scheduler" in GRAPH["batchlm.engine.llm_engine"]
    # A lazy import inside a function counts.
    assert "batchlm.engine.attention.triton_backend" in GRAPH["batchlm.engine.attention.selector"]


def test_no_module_imports_itself_through_others():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles between modules:\n" + _describe(cycles, GRAPH)


def test_no_folder_imports_itself_through_others():
    folders: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        node = _folder(name)
        folders.setdefault(node, set()).update(_folder(t) for t in targets)
        folders[node].discard(node)
    cycles = _cycles(folders)
    assert not cycles, "import cycles between folders:\n" + _describe(cycles, folders)


@pytest.mark.parametrize(
    "forbidden", ["batchlm.engine.worker", "batchlm.engine.models", "batchlm.kernels"]
)
def test_core_is_pure_bookkeeping(forbidden):
    core = [name for name in GRAPH if name.startswith("batchlm.engine.core")]
    assert core
    bad = sorted(
        f"{name} -> {target}"
        for name in core
        for target in GRAPH[name]
        if target == forbidden or target.startswith(forbidden + ".")
    )
    assert not bad, f"engine/core must not import {forbidden}: {bad}"


def test_a_cycle_is_found():
    """The detector itself: a two-module loop and a three-module loop are reported."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
