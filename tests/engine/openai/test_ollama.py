"""Ollama's /api/chat through Ollama's own Python client, on a loopback server over the real default model: a
`format` schema's reply validates, streamed JSON lines add up to JSON, `options` reach the sampler and the budget,
and a bad request is Ollama's error with one sentence."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import ollama
import pytest

from engine.openai.server import LocalServer
from engine.openai.service import ModelService, ServeConfig
from engine.session.engine import Engine, memory_factory_for
from tests.helpers.real_model import real_gguf

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = real_gguf()
    cache = tmp_path_factory.mktemp("kv")
    engine = Engine.load(model, "cpu", memory_factory=memory_factory_for(model, cache_dir=cache), quantize="auto")
    service = ModelService(engine.locked_fork(), engine.tokenizer, engine.memory_factory, ServeConfig(model_id="smol"))
    with LocalServer(service, port=0) as server:
        yield server.url.removesuffix("/v1")


@pytest.fixture
def client(host: str) -> Iterator[ollama.Client]:
    with ollama.Client(host=host) as c:
        yield c


def test_a_format_schema_reply_validates(client: ollama.Client) -> None:
    for seed in (1, 2):
        reply = client.chat(
            model="smol", messages=ASK, format=PERSON, options={"temperature": 1.0, "seed": seed}, stream=False
        )
        jsonschema.validate(json.loads(reply.message.content), PERSON)
        assert reply.done and reply.done_reason == "stop" and reply.message.role == "assistant"
        assert reply.eval_count and reply.prompt_eval_count and reply.total_duration


def test_streamed_lines_add_up_to_json(client: ollama.Client) -> None:
    parts = list(client.chat(model="smol", messages=ASK, format="json", options={"seed": 3}, stream=True))
    assert len(parts) > 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    assert isinstance(json.loads("".join(p.message.content for p in parts)), dict)


def test_options_set_the_budget_and_greedy_is_repeatable(client: ollama.Client) -> None:
    first, second = (
        client.chat(model="smol", messages=ASK, options={"temperature": 0, "num_predict": 5}, stream=False)
        for _ in range(2)
    )
    assert first.eval_count == 5 and first.done_reason == "length"
    assert first.message.content == second.message.content


@pytest.mark.parametrize(
    ("request_body", "words"),
    [
        ({"format": 5}, "'format' must be"),
        ({"messages": [{"role": "user", "content": "Look.", "images": ["aGk="]}]}, "text only"),
        ({"options": {"temperature": 9}}, "temperature"),
    ],
)
def test_a_bad_request_is_ollamas_error_in_one_sentence(host: str, request_body: dict[str, object], words: str) -> None:
    body = {"model": "smol", "messages": ASK, "stream": False, **request_body}
    reply = httpx.post(f"{host}/api/chat", json=body, timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and words in error and "\n" not in error and list(reply.json()) == ["error"]
