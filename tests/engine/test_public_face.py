"""The engine's public face: every exported name resolves on first use, and importing the package loads none of
the parts a process may not need (PEP 562, engine/__init__.py)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import engine


def test_every_exported_name_resolves_and_the_lists_agree() -> None:
    # The names are listed three times (the lazy map, the TYPE_CHECKING imports, __all__): the map and __all__ must
    # agree, and mypy checks the imports against the modules.
    assert set(engine.__all__) == set(engine._PUBLIC) | {"USER_OMP_WAIT_POLICY"}
    for name, (module, there) in engine._PUBLIC.items():
        assert getattr(engine, name) is getattr(importlib.import_module(module), there), name


def test_importing_the_package_loads_no_part_until_asked() -> None:
    code = (
        "import sys, engine\n"
        "print('engine.openai.client' in sys.modules, 'engine.session.engine' in sys.modules)\n"
        "engine.Engine\n"
        "print('engine.openai.client' in sys.modules, 'engine.session.engine' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "False", "True"]
