"""The import graph of the toolkit's packages (docs/architecture.md, "Layout"): no module imports itself through
others, and the base install (clover_common, clover_convert, clover_quantize, clover_cpp) imports no module of
clover_ref, the PyTorch reference, which only the [reference] extra installs.

The graph is read from the source (every import statement, inside functions too), so an import that would run
only on some path counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.support.native import REPO_ROOT

PACKAGES = ("clover_common", "clover_ref", "clover_convert", "clover_quantize", "clover_cpp")
BASE_INSTALL = ("clover_common", "clover_convert", "clover_quantize", "clover_cpp")


def modules() -> dict[str, Path]:
    """Every module of the packages: dotted name -> file (a package's name maps to its __init__.py)."""
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The toolkit modules that ``name`` imports: for ``from X import y``, X.y when it is a module, else X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    yield f"{target}.{alias.name}"
                elif target in known:
                    yield target


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imported(name, path, known)) - {name} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    edges = graph()
    assert len(edges) > 50  # the packages were found
    assert cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_base_install_imports_no_reference_module() -> None:
    """From every module of the base install, following every import (and the parent packages each one runs),
    no clover_ref module is reached."""
    edges = graph()
    seen: set[str] = set()
    todo = [name for name in edges if name.split(".")[0] in BASE_INSTALL]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += [n for n in [*edges[name], *parents] if n in edges]
    assert sorted(n for n in seen if n.split(".")[0] == "clover_ref") == []
    assert "clover_common.config" in seen and "clover_cpp.serve.routes" in seen
