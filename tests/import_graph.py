"""Arrows one way: `python -m tests.import_graph` (run by `make lint`) exits 1 naming each wrong import it finds.

One graph of every module of `engine`, `coreml` and `app`, built from every import statement in the source — at
module level, inside functions and under `if TYPE_CHECKING:` alike, since each is an arrow a reader has to follow:

- no circle between modules (`engine.memory.cascade.core` → `engine.memory.base`), nor between packages;
- no arrow up: LAYERS is the package order docs/DESIGN.md states, lowest first. A module's package is the longest
  name in LAYERS it falls under (`engine.backends.coreml.host` is in `engine.backends`); it may import its own
  package and those of earlier layers, never a later one nor another package of its own layer;
- the tools above the engine reach into it only through the packages FACES names for them (docs/DESIGN.md,
  "Top level").

To add a package, put its name in the layer where it sits (a package under one of these names, such as a new
backend under `engine.backends`, needs no entry).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("engine", "coreml", "app")

LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "engine.errors",
        "engine.fileio",
        "engine.paths",
        "engine.process",
        "engine.untrusted",
        "engine.version",
    ),  # leaves
    ("engine.model",),
    ("engine.loading",),
    ("engine.vision",),  # images in: decoding, a model's processor and encoder
    ("engine.backends",),  # native/, coreml/ and every backend inside it
    ("engine.hw",),
    ("engine.memory",),
    ("engine.generation",),
    ("engine.tools",),  # tool calling: the session's and the server's
    ("engine.session",),
    ("engine.documents",),  # documents and earlier conversations read into capsules
    ("engine.openai",),
    ("engine.library",),
    ("engine.heldout",),
    ("engine",),  # the public face, engine/__init__.py
    ("engine.bench", "engine.cli"),
    ("engine.__main__",),
    ("coreml", "app"),  # tools above the engine, neither importing the other
)

# What the tools above the engine may import of it: the face and the packages docs/DESIGN.md documents for them.
FACES: dict[str, tuple[str, ...]] = {
    "app": ("engine", "engine.hw", "engine.openai", "engine.paths", "engine.library", "engine.tools"),
    "coreml": (
        "engine",
        "engine.backends.coreml",  # the bundle format the converter writes and the runtime reads
        "engine.model",
        "engine.loading",
        "engine.memory.base",
        "engine.memory.cascade",
        "engine.fileio",
        "engine.paths",
        "engine.heldout",
        "engine.cli",
    ),
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
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


def module_graph(root: Path = ROOT, tops: Iterable[str] = TOPS) -> dict[str, set[str]]:
    """module -> the modules (of `tops`) it imports."""
    files = {module_name(p, root): p for top in tops for p in (root / top).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for target in imported(tree, name, path.name == "__init__.py", files):
            if target not in files:  # `import engine.x.y` names engine.x.y; a name in a module names the module
                target = next((t for t in _prefixes(target) if t in files), "")
            if target and target != name:
                graph[name].add(target)
    return graph


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def package_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> str:
    """The longest name in `layers` that `module` is or falls under; a top-level name with packages of its own in
    `layers` (`engine`, the face) is only itself. A module under none is its first package (`engine.documents`)."""
    known = {p for layer in layers for p in layer}
    split = {p for p in known if "." not in p and any(k.startswith(p + ".") for k in known)}
    for prefix in _prefixes(module):
        if prefix in known and (prefix == module or prefix not in split):
            return prefix
    return ".".join(module.split(".")[:2])


def package_graph(modules: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for name, targets in modules.items():
        own = package_of(name, layers)
        packages.setdefault(own, set())
        packages[own] |= {package_of(t, layers) for t in targets} - {own}
    return packages


def upward(
    modules: dict[str, set[str]],
    layers: tuple[tuple[str, ...], ...] = LAYERS,
    faces: dict[str, tuple[str, ...]] = FACES,
) -> list[str]:
    """Each import that runs against the order: to a later layer, across one layer, or from a tool above the
    engine past the packages it may use."""
    rank = {p: i for i, layer in enumerate(layers) for p in layer}
    found = []
    for name in sorted(modules):
        own = package_of(name, layers)
        for target in sorted(modules[name]):
            there = package_of(target, layers)
            if there == own:
                continue
            if own not in rank or there not in rank:
                found.append(f"{name} -> {target}: {own if own not in rank else there} is in no layer of LAYERS")
            elif rank[there] > rank[own]:
                found.append(f"{name} -> {target}: {there} sits above {own}")
            elif rank[there] == rank[own]:
                found.append(f"{name} -> {target}: {there} and {own} are one layer and may not import each other")
            elif own in faces and not any(_covers(p, target) for p in faces[own]):
                found.append(f"{name} -> {target}: {own} may import of the engine only {', '.join(faces[own])}")
    return found


def _covers(allowed: str, module: str) -> bool:
    """`engine` is the face alone; a package covers its modules."""
    return module == allowed or ("." in allowed and module.startswith(allowed + "."))


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


def problems(root: Path = ROOT) -> list[str]:
    modules = module_graph(root)
    lines = [f"import circle in modules: {' -> '.join(c)}" for c in circles(modules)]
    lines += [f"import circle in packages: {' -> '.join(c)}" for c in circles(package_graph(modules))]
    lines += [f"import against the order: {line}" for line in upward(modules)]
    return lines


def main() -> int:
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
