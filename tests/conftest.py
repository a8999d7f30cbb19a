"""Shared pytest hooks."""

from __future__ import annotations

import platform
import sys

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `mac` tests need the real thing (pyobjc, sysctl, Core ML): skip them anywhere but macOS on Apple Silicon.
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return
    skip = pytest.mark.skip(reason="needs macOS on Apple Silicon")
    for item in items:
        if item.get_closest_marker("mac"):
            item.add_marker(skip)
