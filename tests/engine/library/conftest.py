"""Fixtures of the model library's tests: a small GGUF written by the test helpers, a loopback Hub serving it, and a
library wired to both (a temp models folder, no token and no stored login from this machine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.library.library import Library
from tests.engine.library.helpers import FILE, REPO, make_library
from tests.helpers.fake_hub import FakeHub, running_hub
from tests.helpers.gguf_files import write_gguf
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A 2-layer random Llama GGUF of about 7 MB: several of the downloader's 1 MiB chunks."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    model = make_tiny_model(root / "hf", hidden=256, intermediate=768, heads=4, kv_heads=2)
    return write_gguf(model, root / FILE, "f32").read_bytes()


@pytest.fixture
def hub(tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no login token of this machine's user
    with running_hub() as fake:
        fake.add(REPO, {FILE: tiny_gguf, "README.md": b"# tiny\n"})
        yield fake


@pytest.fixture
def library(hub: FakeHub, tmp_path: Path) -> Library:
    return make_library(hub, tmp_path / "models")
