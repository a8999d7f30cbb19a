"""A reasoning model over the API (a tiny Qwen3 with Qwen3's chat template, its reply forced by a grammar): OpenAI's
`reasoning_content` on the message and on stream deltas, the thinking switch per request, Ollama's `think` and
`thinking`, and an earlier turn's thinking given back only as the template asks."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import ollama
import openai
import pytest

from engine.generation.constrained import grammar_from_file_text
from engine.generation.reasoning import Think
from engine.openai import protocol
from engine.openai.errors import ApiError
from tests.helpers.http_clients import closed_after_test
from tests.helpers.reasoning import ANSWER, THINKING_REPLY, THOUGHT
from tests.helpers.server import KEY, Served, start_server
from tests.helpers.tiny_families import make_tiny_qwen3

ASK = [{"role": "user", "content": "What is Python?"}]
FORCED = {"type": "json_object"}  # stands for the grammar below: the API has no way to send a Lark grammar


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = make_tiny_qwen3(tmp_path_factory.mktemp("q3") / "m", think_tokens=False)
    s = start_server(model, tmp_path_factory.mktemp("kv"), max_prompt_tokens=2000)
    yield s
    s.server.stop()


@pytest.fixture(autouse=True)
def thinking_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `response_format` of json_object forces the model's reply to think, then answer."""
    grammar = grammar_from_file_text(THINKING_REPLY, "test grammar")
    monkeypatch.setattr(
        protocol, "parse_response_format", lambda body: grammar if body.get("response_format") else None
    )


def client(served: Served) -> openai.OpenAI:
    return closed_after_test(openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=60))


def test_reasoning_content_on_the_message_and_on_stream_deltas(served: Served) -> None:
    c = client(served)
    r = c.chat.completions.create(model="tiny", messages=ASK, response_format=FORCED, max_tokens=64)  # type: ignore[arg-type]
    msg = r.choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"]) == (ANSWER, THOUGHT)  # type: ignore[index]
    chunks = list(
        c.chat.completions.create(model="tiny", messages=ASK, response_format=FORCED, max_tokens=64, stream=True)
    )  # type: ignore[call-overload]
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER


def test_the_switch_per_request_reaches_the_template(served: Served) -> None:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 1}
    for extra, think in [({}, Think.AUTO), ({"reasoning_effort": "none"}, Think.OFF), ({"reasoning_effort": "high"}, Think.ON),
                         ({"chat_template_kwargs": {"enable_thinking": False}}, Think.OFF), ({"think": True}, Think.ON)]:  # fmt: skip
        req = protocol.parse_chat({**body, **extra}, protocol.Limits())
        assert req.settings.think is think, extra
        ids = served.service.prompt_ids(req)
        rendered = served.tokenizer.decode(ids, skip_special=False)
        assert rendered.endswith("<think>\n\n</think>\n\n") == (think is Think.OFF)
    for bad in ({"reasoning_effort": "max"}, {"think": "yes"}, {"think": True, "reasoning_effort": "none"}):
        with pytest.raises(ApiError):
            protocol.parse_chat({**body, **bad}, protocol.Limits())


def test_an_earlier_turns_thinking_goes_back_only_as_the_template_asks(served: Served) -> None:
    turns = [*ASK, {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}]
    req = protocol.parse_chat(
        {"model": "tiny", "messages": [*turns, {"role": "user", "content": "More?"}]}, protocol.Limits()
    )
    assert THOUGHT not in served.tokenizer.decode(
        served.service.prompt_ids(req), skip_special=False
    )  # before the query
    req = protocol.parse_chat({"model": "tiny", "messages": turns}, protocol.Limits())  # after it: Qwen3 shows it
    assert THOUGHT in served.tokenizer.decode(served.service.prompt_ids(req), skip_special=False)


def test_ollama_think_and_thinking(served: Served) -> None:
    host = served.url.removesuffix("/v1")
    with ollama.Client(host=host, headers={"Authorization": f"Bearer {KEY}"}) as c:
        r = c.chat(model="tiny", messages=ASK, format="json", think=True, options={"num_predict": 64})
        assert (r.message.content, r.message.thinking) == (ANSWER, THOUGHT)
        parts = list(c.chat(model="tiny", messages=ASK, format="json", stream=True, options={"num_predict": 64}))
        assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
        assert "".join(p.message.content or "" for p in parts) == ANSWER
    r2 = httpx.post(host + "/api/chat", json={"model": "tiny", "messages": ASK, "think": "maybe", "stream": False},
                    headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert r2.status_code == 400 and "think" in r2.json()["error"]


def test_the_remote_client_hears_reasoning_apart(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.generation.loop import GenerationSettings
    from engine.openai.client import RemoteClient, RemoteServer

    grammar = grammar_from_file_text(THINKING_REPLY, "test grammar")
    monkeypatch.setattr(protocol, "parse_response_format", lambda body: grammar)
    remote = closed_after_test(RemoteClient(RemoteServer(served.url, "tiny", KEY)))
    events = list(remote.stream_chat(ASK, GenerationSettings(max_tokens=64)))
    assert ("".join(e.reasoning for e in events), "".join(e.text for e in events)) == (THOUGHT, ANSWER)


def test_anthropic_thinking_blocks(served: Served) -> None:
    import anthropic

    forced = {"format": {"type": "json_schema", "schema": {"type": "object"}}}  # stands for the grammar, as above
    with anthropic.Anthropic(base_url=served.url.removesuffix("/v1"), api_key=KEY, max_retries=0) as c:
        r = c.messages.create(
            model="tiny", max_tokens=64, messages=ASK, output_config=forced,  # type: ignore[arg-type,typeddict-item]
            thinking={"type": "enabled", "budget_tokens": 1024},
        )  # fmt: skip
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == [
            ("thinking", THOUGHT),
            ("text", ANSWER),
        ]
        with c.messages.stream(model="tiny", max_tokens=64, messages=ASK, output_config=forced) as stream:  # type: ignore[arg-type,typeddict-item]
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == THOUGHT and final.content[1].text == ANSWER  # type: ignore[union-attr]
        # A thinking block sent back is the turn's reasoning; the request is read, not refused.
        turns = [
            *ASK,
            {"role": "assistant", "content": [b.model_dump() for b in r.content]},
            {"role": "user", "content": "More?"},
        ]
        assert c.messages.count_tokens(model="tiny", messages=turns).input_tokens > 0  # type: ignore[arg-type]
