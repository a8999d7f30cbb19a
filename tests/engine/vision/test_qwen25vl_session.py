"""A conversation about pictures with Qwen2.5-VL through the session: its multimodal rotary offsets come from the
ids and the registered pictures, so a full or compact `.spark` file restores in another engine and continues
exactly as never having stopped."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import httpx
import pytest

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.openai.server import LocalServer
from engine.openai.service import ModelService, ServeConfig
from engine.session.engine import Session, load, memory_factory_for
from engine.vision.images import DecodedImage
from engine.vision.model import attach_vision
from tests.helpers.pictures import picture, png
from tests.helpers.tiny_qwen25vl import make_tiny_qwen25vl

pytest.importorskip("transformers")
GREEDY = GenerationSettings(max_tokens=6, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen25vl(tmp_path_factory.mktemp("qwen25vl"))


def reply(session: Session, text: str, images: list[DecodedImage] = []) -> list[int]:  # noqa: B006 (never mutated)
    return [e.token for e in session.chat(text, GREEDY, images=images) if e.token is not None]


@pytest.mark.parametrize("compact", [False, True])
def test_restore_and_continue_exactly(folder: Path, tmp_path: Path, compact: bool) -> None:
    engine = load(folder, "cpu", prefix_cache=False)
    session = engine.new_session()
    pic, other = picture(40, 24, 11), picture(20, 30, 12)
    reply(session, "What is it?", [pic])
    reply(session, "Look again:", [pic])
    reply(session, "And this one?", [other])
    path = tmp_path / "pictures.spark"
    session.save(path, compact=compact)
    expected = reply(session, "Which was first?")

    fresh = load(folder, "cpu", prefix_cache=False)  # another engine: nothing of the pictures held
    restored = fresh.new_session()
    assert restored.load(path).applied
    assert restored.memory_source == ("recomputed" if compact else "file")
    assert reply(restored, "Which was first?") == expected


# Qwen's own template renders an image part as its vision block (a plain string as is).
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_a_template_that_marks_pictures_its_own_way(folder: Path, tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    shutil.copytree(folder, parts)
    (parts / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    pic = picture(40, 24, 11)
    plain = load(folder, "cpu", prefix_cache=False).new_session()
    session = load(parts, "cpu", prefix_cache=False).new_session()
    assert reply(session, "What is it?", [pic]) == reply(plain, "What is it?", [pic])
    vision = session.engine.vision
    assert vision is not None
    grid = vision.preprocessing.frames(pic.image)
    assert sum(t >= vision.vocab_size for t in session.memory.tokens) == grid.rows * grid.cols


def test_the_server_answers_as_the_session(folder: Path, tmp_path: Path) -> None:
    parts_dir = tmp_path / "parts"
    shutil.copytree(folder, parts_dir)
    (parts_dir / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    expected = reply(load(parts_dir, "cpu", prefix_cache=False).new_session(), "Hi?", [picture(40, 24, 5)])
    backend = TorchBackend(parts_dir)
    tok = Tokenizer.from_dir(parts_dir)
    vision = attach_vision(parts_dir, tok, backend)
    config = ServeConfig(model_id="tiny", api_key="k", max_batch=2, max_queue=4, max_prompt_tokens=600)
    factory = memory_factory_for(parts_dir, cache_dir=tmp_path / "cache")
    server = LocalServer(ModelService(backend.fork(), tok, factory, config, None, vision=vision), port=0).start()
    try:
        data = base64.b64encode(png(40, 24, 5)).decode()
        content = [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
            {"type": "text", "text": "Hi?"},
        ]
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 6}
        r = httpx.post(
            server.url.removesuffix("/v1") + "/v1/chat/completions",
            json=body | {"temperature": 0},
            headers={"Authorization": "Bearer k"},
            timeout=300,
        )
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(expected)
