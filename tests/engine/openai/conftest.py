"""A server on a free loopback port over a tiny random checkpoint, for the `openai` client tests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.backends.torch_backend import TorchBackend
from engine.loading.tokenizer import Tokenizer
from engine.openai.server import LocalServer
from engine.openai.service import ModelService, ServeConfig
from engine.session.engine import memory_factory_for
from tests.helpers.real_model import real_gguf
from tests.helpers.tiny import make_tiny_model

KEY = "sk-test-key"
# A small cascade so a short conversation spans several prefix blocks, and a longer one leaves the window.
CASCADE = {"sink_tokens": 2, "window": 128, "block_size": 8, "retrieval_blocks": 2}


@dataclass
class Served:
    server: LocalServer
    service: ModelService
    tokenizer: Tokenizer
    backend: TorchBackend
    model_dir: Path
    cache_dir: Path

    @property
    def url(self) -> str:
        return self.server.url


def start_server(model_dir: Path, cache_dir: Path, **config: object) -> Served:
    backend = TorchBackend(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    factory = memory_factory_for(model_dir, cache_dir=cache_dir, **CASCADE)
    settings = {"model_id": "tiny", "api_key": KEY, "max_batch": 4, "max_queue": 8, "max_prompt_tokens": 600, **config}
    service = ModelService(backend.fork(), tok, factory, ServeConfig(**settings))  # type: ignore[arg-type]
    return Served(LocalServer(service, port=0).start(), service, tok, backend, model_dir, cache_dir)


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
    """The real default model (SmolLM2-135M-Instruct, the shipped GGUF), or a skip where its wheel is not installed."""
    return real_gguf()
