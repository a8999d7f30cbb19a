"""A wheel of the project carries every file the packages read at run time (the native kernels' sources, the bench's
question set): each non-Python file under a package matches one of pyproject's package-data patterns."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch

from tests.packaging.loader import REPO

SKIP_SUFFIXES = (".py", ".pyc", ".md")  # documentation beside the code is not read at run time


def test_every_runtime_file_is_package_data() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    package_data: dict[str, list[str]] = config["tool"]["setuptools"]["package-data"]
    missing = []
    for package in ("engine", "app", "coreml"):
        root = REPO / package
        for path in root.rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts or path.name.endswith(SKIP_SUFFIXES):
                continue
            relative = path.relative_to(root).as_posix()
            if not any(fnmatch(relative, pattern) for pattern in package_data.get(package, [])):
                missing.append(f"{package}/{relative}")
    assert missing == [], f"not in [tool.setuptools.package-data]: {missing}"
