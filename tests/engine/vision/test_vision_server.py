"""Pictures through the server: OpenAI `image_url` parts with data URLs, Ollama's `images` and Anthropic's `image`
blocks answer as the engine's own session does; a remote URL, a damaged picture, a picture too large and a text-only
model are one sentence each."""

from __future__ import annotations

import base64
import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.openai.anthropic import parse_messages
from engine.openai.errors import ApiError
from engine.openai.protocol import Limits
from engine.openai.server import LocalServer
from engine.openai.service import ModelService, ServeConfig
from engine.session.engine import load, memory_factory_for
from engine.vision.fetch import fetch_image
from engine.vision.images import MAX_IMAGE_BYTES, ImageError
from engine.vision.model import attach_vision
from tests.helpers.pictures import picture, png
from tests.helpers.tiny_idefics3 import make_tiny_idefics3

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


def serve(folder: Path, cache: Path, allow_image_urls: bool = False) -> LocalServer:
    backend = TorchBackend(folder)
    tok = Tokenizer.from_dir(folder)
    vision = attach_vision(folder, tok, backend)
    factory = memory_factory_for(folder, cache_dir=cache)
    config = ServeConfig(
        model_id="tiny", api_key=KEY, max_batch=2, max_queue=4, max_prompt_tokens=600, allow_image_urls=allow_image_urls
    )
    return LocalServer(ModelService(backend.fork(), tok, factory, config, None, vision=vision), port=0).start()


@pytest.fixture(scope="module")
def url(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = serve(folder, tmp_path_factory.mktemp("cache"))
    try:
        yield server.url
    finally:
        server.stop()


class Pictures(http.server.BaseHTTPRequestHandler):
    """A loopback web server: /a.png a picture, /big more bytes than an image may hold, anything else a 404."""

    def do_GET(self) -> None:  # http.server's name for it
        body = png(40, 24, 5) if self.path == "/a.png" else b"\0" * (MAX_IMAGE_BYTES + 10)
        self.send_response(200 if self.path in ("/a.png", "/big") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client stops reading what it refuses
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def web() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pictures)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_remote_urls_only_where_allowed(folder: Path, web: str, tmp_path: Path) -> None:
    server = serve(folder, tmp_path, allow_image_urls=True)
    try:
        parts = [{"type": "image_url", "image_url": {"url": f"{web}/a.png"}}, {"type": "text", "text": "Hi?"}]
        body = {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0}
        r = post(server.url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == Tokenizer.from_dir(folder).decode(
            expected_tokens(folder, "Hi?")
        )
    finally:
        server.stop()
    with pytest.raises(ImageError, match="answered HTTP 404"):
        fetch_image(f"{web}/missing.png")
    with pytest.raises(ImageError, match="holds more than 20 MB"):
        fetch_image(f"{web}/big")
    with pytest.raises(ImageError, match="not an http or https URL"):
        fetch_image("file:///etc/passwd")


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
        ("https://example.com/cat.png", "--allow-image-urls"),
        ("file:///etc/passwd", "neither data: nor http(s)"),
        ("data:image/png;base64," + base64.b64encode(png(40, 24, 5)[:80]).decode(), "truncated or damaged"),
        ("data:image/png;base64,!!!", "not valid base64"),
    ],
)
def test_bad_pictures_are_400s(url: str, image_url: str, words: str) -> None:
    parts = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "Hi?"}]
    r = post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and words in r.json()["error"]["message"]


def anthropic_body(*blocks: dict[str, Any]) -> dict[str, Any]:
    content = [*blocks, {"type": "text", "text": "Hi?"}]
    return {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": content}]}


def base64_block(data: str, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def test_anthropic_image_blocks(url: str, folder: Path) -> None:
    data = base64.b64encode(png(40, 24, 5)).decode()
    r = post(url, "/v1/messages", anthropic_body(base64_block(data)))
    assert r.status_code == 200, r.text
    text = "".join(b["text"] for b in r.json()["content"] if b["type"] == "text")
    assert text == Tokenizer.from_dir(folder).decode(expected_tokens(folder, "Hi?"))
    counted = post(url, "/v1/messages/count_tokens", anthropic_body(base64_block(data)))
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == r.json()["usage"]["input_tokens"] > 5 * 4  # the picture's tokens too


@pytest.mark.parametrize(
    ("block", "status", "words"),
    [
        (base64_block("AAAA", "image/bmp"), 400, "media_type must be one of image/png"),
        (base64_block(base64.b64encode(png(40, 24, 5)[:80]).decode()), 400, "truncated or damaged"),
        (base64_block("!!!"), 400, "not valid base64"),
        ({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}, 400, "--allow-image-urls"),
        ({"type": "image", "source": {"type": "file", "file_id": "x"}}, 400, "needs a 'source' of type base64"),
        (base64_block("A" * (9 * 2**20)), 413, "larger than the 8,388,608 bytes"),
    ],
)
def test_bad_anthropic_images_are_one_sentence(url: str, block: dict[str, Any], status: int, words: str) -> None:
    r = post(url, "/v1/messages", anthropic_body(block))
    assert r.status_code == status and r.json()["type"] == "error"
    assert words in r.json()["error"]["message"]


def test_a_50_mb_base64_image_is_refused_before_it_is_copied() -> None:
    huge = "A" * (50 * 10**6)
    with pytest.raises(ApiError, match=r"content\[0\] is 50 MB of base64; the limit is 20 MB\.") as err:
        parse_messages(anthropic_body(base64_block(huge)), Limits())
    assert err.value.status == 400
