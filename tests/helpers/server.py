"""A server on a free loopback port over a model, for the `openai` client tests and the app's remote tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.backends.torch_backend import TorchBackend
from engine.loading.tokenizer import Tokenizer
from engine.openai.server import LocalServer
from engine.openai.service import ModelService, ServeConfig
from engine.session.engine import memory_factory_for
from engine.vision.model import attach_vision

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


def start_server(
    model_dir: Path, cache_dir: Path, *, draft: Path | None = None, vision: bool = False, **config: object
) -> Served:
    """`draft`: a draft model for "speculative": "draft" requests; `vision`: the model folder's vision tower
    answers image parts."""
    backend = TorchBackend(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    factory = memory_factory_for(model_dir, cache_dir=cache_dir, **CASCADE)
    settings = {"model_id": "tiny", "api_key": KEY, "max_batch": 4, "max_queue": 8, "max_prompt_tokens": 600, **config}
    drafts = None if draft is None else TorchBackend(draft)
    tower = attach_vision(model_dir, tok, backend) if vision else None
    service = ModelService(backend.fork(), tok, factory, ServeConfig(**settings), drafts, vision=tower)  # type: ignore[arg-type]
    return Served(LocalServer(service, port=0).start(), service, tok, backend, model_dir, cache_dir)
