from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.tiny import make_tiny_model


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny models on a shared 2-core box: one torch thread avoids spin-wait contention (10x faster here).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cascade") / "tiny", max_positions=512)


@pytest.fixture(scope="session")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cascade") / "other", max_positions=512, seed=1)
