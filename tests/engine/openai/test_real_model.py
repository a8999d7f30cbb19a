"""The server on the real default model: a two-turn chat through the openai client answers, and the second turn
reuses the first turn's memory."""

from __future__ import annotations

from pathlib import Path

import openai

from engine.openai.server import LocalServer
from engine.openai.service import ModelService, ServeConfig
from engine.session.engine import Engine, memory_factory_for
from tests.helpers.http_clients import closed_after_test


def test_two_turns_on_the_real_model(real_model_dir: Path, tmp_path: Path) -> None:
    engine = Engine.load(
        real_model_dir, "cpu", memory_factory=memory_factory_for(real_model_dir, cache_dir=tmp_path), quantize="auto"
    )
    service = ModelService(
        engine.locked_fork(), engine.tokenizer, engine.memory_factory, ServeConfig(model_id="smollm2")
    )
    with LocalServer(service, port=0) as server:
        client = closed_after_test(openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300))
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)  # type: ignore[arg-type]
        assert "Paris" in (first.choices[0].message.content or "")
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And of Germany?"},
        ]
        second = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)  # type: ignore[arg-type]
        assert "Berlin" in (second.choices[0].message.content or "")
        # Turn 2 goes to the row that kept turn 1's memory: everything turn 1 fed (its prompt and its reply but the
        # last sampled token) is reused, not re-read.
        turn1_ids = engine.tokenizer.encode_chat(messages[:2])
        assert second.usage.prompt_tokens_details.cached_tokens == len(turn1_ids) + first.usage.completion_tokens - 1  # type: ignore[union-attr]
