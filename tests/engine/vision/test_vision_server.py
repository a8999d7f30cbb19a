"""Pictures through the server: OpenAI `image_url` parts with data URLs and Ollama's `images` answer as the engine's
own session does; a remote URL, a damaged picture and a text-only model are one-sentence 400s."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.openai.server import LocalServer
from engine.openai.service import ModelService, ServeConfig
from engine.session.engine import load, memory_factory_for
from engine.vision.model import attach_vision
from tests.engine.vision.test_vision_session import picture, png
from tests.engine.vision.tiny_idefics3 import make_tiny_idefics3

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def url(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    backend = TorchBackend(folder)
    tok = Tokenizer.from_dir(folder)
    vision = attach_vision(folder, tok, backend)
    factory = memory_factory_for(folder, cache_dir=tmp_path_factory.mktemp("cache"))
    config = ServeConfig(model_id="tiny", api_key=KEY, max_batch=2, max_queue=4, max_prompt_tokens=600)
    server = LocalServer(ModelService(backend.fork(), tok, factory, config, None, vision=vision), port=0).start()
    try:
        yield server.url
    finally:
        server.stop()


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    root = url.removesuffix("/v1")  # the server's url names its OpenAI routes
    return httpx.post(root + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)


def expected_tokens(folder: Path, text: str) -> list[int]:
    engine = load(folder, "cpu", prefix_cache=False)
    settings = GenerationSettings(max_tokens=6, sampling=SamplingSettings(temperature=0.0))
    events = engine.new_session().chat(text, settings, images=[picture(40, 24, 5)])
    return [e.token for e in events if e.token is not None]


def test_openai_image_url_and_ollama_images(url: str, folder: Path) -> None:
    data = base64.b64encode(png(40, 24, 5)).decode()
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": "Hi?"},
    ]
    body = {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0}
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    tok = Tokenizer.from_dir(folder)
    expected = expected_tokens(folder, "Hi?")
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(expected)

    ollama = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi?", "images": [data]}],
        "stream": False,
        "options": {"temperature": 0, "num_predict": 6},
    }
    r = post(url, "/api/chat", ollama)
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == tok.decode(expected)


@pytest.mark.parametrize(
    ("image_url", "words"),
    [
        ("https://example.com/cat.png", "remote image URL"),
        ("data:image/png;base64," + base64.b64encode(png(40, 24, 5)[:80]).decode(), "truncated or damaged"),
        ("data:image/png;base64,!!!", "not valid base64"),
    ],
)
def test_bad_pictures_are_400s(url: str, image_url: str, words: str) -> None:
    parts = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "Hi?"}]
    r = post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and words in r.json()["error"]["message"]
