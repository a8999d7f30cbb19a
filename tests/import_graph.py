"""No import circles: `python -m tests.import_graph` (run by `make lint`) exits 1 naming each circle it finds.

Two graphs per top-level package (engine, app, coreml), built from every import statement in the source — at module
level, inside functions and under `if TYPE_CHECKING:` alike, since each is an arrow a reader has to follow:

- modules: `engine.memory.cascade.core` → `engine.memory.base`; a circle here is a real import-order hazard;
- packages: the first component under the top level (`engine.memory` → `engine.backends`); a circle here means the
  arrows between concerns run both ways. The package's own `__init__` counts as the package.

Imports that cross top levels (the backend registry's lazy `coreml` import, the app's engine imports) are the
layering DESIGN.md fixes and are not part of either graph.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("engine", "app", "coreml")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, here: str, is_package: bool, modules: Iterable[str]) -> Iterable[str]:
    """Every module of `modules` an import statement in `tree` names: `from package import submodule` names the
    submodule, `from module import name` the module; relative imports are resolved against `here`."""
    known = set(modules)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".") if is_package else here.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base


def graphs(top: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    files = {module_name(p): p for p in (ROOT / top).rglob("*.py")}
    modules: dict[str, set[str]] = {name: set() for name in files}
    packages: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for target in imported(tree, name, path.name == "__init__.py", files):
            if target in files and target != name:
                modules[name].add(target)
        own = _package(name)
        packages.setdefault(own, set())
        for target in modules[name]:
            if _package(target) != own:
                packages[own].add(_package(target))
    return modules, packages


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one node (Tarjan), as a path that closes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(_closed_path(graph, set(component)))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _closed_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle through the component's smallest member (breadth-first)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError("a strongly connected component always closes")


def all_circles() -> list[str]:
    lines = []
    for top in TOPS:
        modules, packages = graphs(top)
        for kind, graph in (("modules", modules), ("packages", packages)):
            lines += [f"{top} {kind}: {' -> '.join(c)}" for c in circles(graph)]
    return lines


def main() -> int:
    found = all_circles()
    for line in found:
        print(f"import circle in {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
