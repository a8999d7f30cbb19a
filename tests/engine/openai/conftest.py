"""Fixtures: a server on a free loopback port over a tiny random checkpoint (tests.helpers.server)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.real_model import real_gguf
from tests.helpers.server import Served, start_server
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("serve-tiny"), layers=2)


@pytest.fixture(scope="module")
def served(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start_server(tiny_dir, tmp_path_factory.mktemp("kv"))
    yield s
    s.server.stop()


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct, the shipped GGUF)."""
    return real_gguf()
