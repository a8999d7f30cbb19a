"""Shared pytest hooks; the shared fixtures live in tests/helpers and load as a plugin."""

from __future__ import annotations

import platform
import sys
from collections.abc import Iterator

import pytest
import torch

from tests.helpers.http_clients import close_all

pytest_plugins = ["tests.helpers.fixtures", "tests.helpers.coreml_fixtures"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `mac` tests need the real thing (pyobjc, sysctl, Core ML): skip them anywhere but macOS on Apple Silicon.
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return
    skip = pytest.mark.skip(reason="needs macOS on Apple Silicon")
    for item in items:
        if item.get_closest_marker("mac"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    # Tests run tiny models on small (2-core) CI machines: one intra-op thread avoids spin-wait contention that
    # makes tiny ops many times slower, and leaves a core for Qt's GUI thread in the app tests.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def close_http_clients() -> Iterator[None]:
    yield
    close_all()
