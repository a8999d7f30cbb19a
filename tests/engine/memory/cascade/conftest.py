from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cascade") / "tiny", max_positions=512)


@pytest.fixture(scope="session")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cascade") / "other", max_positions=512, seed=1)
