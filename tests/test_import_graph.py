"""The import check (tests/import_graph.py) on small made-up trees: each wrong arrow it exists for is found, lazy and
TYPE_CHECKING imports included, and a tree that keeps the order passes."""

from __future__ import annotations

from pathlib import Path

from tests import import_graph as g

LAYERS = (("engine.errors",), ("engine.model",), ("engine.backends",), ("engine",), ("coreml", "app"))
FACES = {"app": ("engine", "engine.errors"), "coreml": ("engine", "engine.backends.coreml")}


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in {"engine/__init__.py": "", "coreml/__init__.py": "", "app/__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def found(root: Path) -> list[str]:
    modules = g.module_graph(root)
    return (
        [" -> ".join(c) for c in g.circles(modules)]
        + [" -> ".join(c) for c in g.circles(g.package_graph(modules, LAYERS))]
        + g.upward(modules, LAYERS, FACES)
    )


def test_a_tree_in_order_passes(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "engine/errors.py": "",
            "engine/model/__init__.py": "from engine.errors import x\n",
            "engine/backends/__init__.py": "def f():\n    from engine.backends.coreml.runtime import y\n",
            "engine/backends/coreml/__init__.py": "",
            "engine/backends/coreml/runtime.py": "from engine.model import z\n",
            "coreml/convert.py": "from engine.backends.coreml.runtime import y\nimport engine\n",
            "app/window.py": "from engine import Engine\nfrom engine.errors import E\n",
        },
    )
    assert found(root) == []


def test_the_lazy_circle_through_a_tool_above_the_engine_is_found(tmp_path: Path) -> None:
    """The circle the Core ML runtime once made: the registry imported `coreml` lazily, `coreml` imported it back."""
    root = tree(
        tmp_path,
        {
            "engine/backends/__init__.py": "def probe():\n    from coreml.runtime import probe\n",
            "coreml/runtime.py": "from engine.backends import AUTO_ORDER\n",
        },
    )
    problems = found(root)
    assert "coreml.runtime -> engine.backends -> coreml.runtime" in problems
    assert any("engine.backends -> coreml.runtime: coreml sits above engine.backends" in p for p in problems)


def test_an_arrow_up_is_found_even_without_a_circle(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "engine/model/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.backends import B\n",
            "engine/backends/__init__.py": "",
        },
    )
    assert found(root) == ["engine.model -> engine.backends: engine.backends sits above engine.model"]


def test_siblings_of_one_layer_and_imports_past_the_face_are_found(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "app/window.py": "from coreml import convert\nfrom engine.model import M\n",
            "coreml/convert.py": "",
            "engine/model/__init__.py": "",
        },
    )
    assert found(root) == [
        "app.window -> coreml.convert: coreml and app are one layer and may not import each other",
        "app.window -> engine.model: app may import of the engine only engine, engine.errors",
    ]


def test_a_package_in_no_layer_is_named(tmp_path: Path) -> None:
    root = tree(
        tmp_path, {"engine/documents/__init__.py": "from engine.model import M\n", "engine/model/__init__.py": ""}
    )
    assert found(root) == ["engine.documents -> engine.model: engine.documents is in no layer of LAYERS"]


def test_the_repository_keeps_the_order() -> None:
    assert g.problems() == []
