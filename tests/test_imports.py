"""The import graph of the repository's Python (docs/architecture.md, "Layout"): the installed packages, the
developer tooling (clover_dev), the benchmarks, the scripts and the tests. No module imports itself through others,
each package imports only the packages its row of LAYERS names, and the base install (clover_common, clover_native,
clover_convert, clover_quantize, clover_cpp) imports no module of clover_ref, the PyTorch reference, which only the
[reference] extra installs.

The graph is read from the source (every import statement, inside functions too), so an import that would run
only on some path counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from clover_dev import REPO_ROOT

PACKAGES = ("clover_common", "clover_native", "clover_ref", "clover_convert", "clover_quantize", "clover_cpp",
            "clover_dev", "bench", "scripts", "tests")
BASE_INSTALL = ("clover_common", "clover_native", "clover_convert", "clover_quantize", "clover_cpp")
ALL = frozenset(PACKAGES)
# package -> the other packages its modules may import: the floors below it
LAYERS: dict[str, frozenset[str]] = {
    "clover_common": frozenset(),
    "clover_native": frozenset({"clover_common"}),
    "clover_ref": frozenset({"clover_common"}),
    "clover_quantize": frozenset({"clover_common", "clover_native"}),
    "clover_convert": frozenset({"clover_common", "clover_native", "clover_quantize"}),
    "clover_cpp": frozenset({"clover_common", "clover_native"}),
    "clover_dev": ALL - {"tests", "bench"},
    "bench": ALL - {"tests"},
    "scripts": ALL - {"tests"},
    "tests": ALL,
}


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


def forbidden(edges: dict[str, set[str]], layers: dict[str, frozenset[str]]) -> list[str]:
    """Every import ``a -> b`` between two packages where ``b``'s package is not in the row of ``a``'s."""
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in layers[a.split(".")[0]])


def test_no_import_cycles() -> None:
    edges = graph()
    assert len(edges) > 50  # the packages were found
    assert cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_each_package_imports_only_its_floors() -> None:
    edges = graph()
    assert set(LAYERS) == set(PACKAGES)
    assert {name.split(".")[0] for name in edges} == set(PACKAGES)  # every package was read
    assert forbidden(edges, LAYERS) == []


def test_the_layer_checker_finds_a_forbidden_edge() -> None:
    edges = {"low.a": {"high.b", "low.c"}, "low.c": set(), "high.b": {"low.a", "mid"}, "mid": {"low.c"}}
    layers = {"low": frozenset(), "mid": frozenset({"low"}), "high": frozenset({"low", "mid"})}
    assert forbidden(edges, layers) == ["low.a -> high.b"]


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
    assert "clover_common.config" in seen and "clover_cpp.launch" in seen
