"""The engine's public face: every exported name resolves on first use, importing the package loads none of the parts
a process may not need (PEP 562, engine/__init__.py), and the process-wide settings are in place before PyTorch
loads, whichever way the engine starts running."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import engine

ROOT = Path(__file__).resolve().parents[2]


def test_every_exported_name_resolves_to_the_import_that_lists_it() -> None:
    """The face is listed once, as imports: what mypy reads is what the names resolve to at run time."""
    tree = ast.parse((ROOT / "engine" / "__init__.py").read_text(encoding="utf-8"))
    listed = {
        alias.asname or alias.name: (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module != "engine.process"
        for alias in node.names
        if node.module.startswith("engine.")
    }
    assert listed == engine._PUBLIC
    assert set(engine.__all__) == set(listed) | {"exit_process", "prepare_process"}
    for name, (module, there) in engine._PUBLIC.items():
        assert getattr(engine, name) is getattr(importlib.import_module(module), there), name
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        engine.nothing_here  # noqa: B018


def _run(code: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    full = {**clean, "PYTHONPATH": str(ROOT), "QT_QPA_PLATFORM": "offscreen", **env}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_importing_the_package_loads_no_part_and_sets_nothing_until_asked() -> None:
    code = (
        "import os, sys, engine\n"
        "print('engine.openai.client' in sys.modules, 'engine.session.engine' in sys.modules, 'torch' in sys.modules)\n"
        "print(os.environ.get('OMP_WAIT_POLICY'))\n"
        "engine.Engine\n"
        "print('engine.openai.client' in sys.modules, 'engine.session.engine' in sys.modules)\n"
    )
    assert _run(code) == ["False", "False", "False", "None", "False", "True"]


# Records OMP_WAIT_POLICY at the moment torch is first imported (OpenMP reads it once, when PyTorch loads it).
_WATCH_TORCH = """
import os, sys
class Watch:
    seen = "torch never imported"
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and Watch.seen == "torch never imported":
            Watch.seen = os.environ.get("OMP_WAIT_POLICY")
        return None
sys.meta_path.insert(0, Watch())
"""


@pytest.mark.parametrize(
    "start",
    [
        "import engine; engine.load",  # a script through the face
        "import runpy, sys; sys.argv = ['engine', 'hw', '--json']; runpy.run_module('engine', run_name='__main__')",
        "import runpy; runpy.run_module('app', run_name='app_imported')",  # the app's imports, without its window
    ],
    ids=["face", "python -m engine", "python -m app"],
)
def test_openmp_workers_sleep_from_before_pytorch_loads(start: str) -> None:
    code = f"{_WATCH_TORCH}\ntry:\n    {start}\nexcept SystemExit:\n    pass\nprint('policy', Watch.seen)\n"
    assert _run(code)[-2:] == ["policy", "PASSIVE"]
    assert _run(code, OMP_WAIT_POLICY="ACTIVE")[-2:] == ["policy", "ACTIVE"]  # a user's own setting wins
