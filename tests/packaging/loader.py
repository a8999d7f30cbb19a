"""Import packaging/*.py by path: packaging/ is not a package (it would shadow PyPI's `packaging`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
PACKAGING = REPO / "packaging"


def load(name: str) -> ModuleType:
    key = f"spark_packaging_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, PACKAGING / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses and NamedTuples look their module up while the body runs
    spec.loader.exec_module(module)
    return module
