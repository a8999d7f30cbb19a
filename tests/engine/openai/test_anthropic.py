"""Anthropic's Messages API through Anthropic's own SDK on a loopback server over a tiny random checkpoint: a text
reply, a streamed one, a forced tool call whose input fits its schema, a tool_result round trip, count_tokens, and
Anthropic's errors for a malformed request and a wrong key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from tests.helpers.server import KEY, Served, start_server

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The SDK no longer names the sampling fields (Claude's newest models take none); the API still reads them.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def served(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start_server(tiny_dir, tmp_path_factory.mktemp("kv"), max_prompt_tokens=4000)  # tool turns are long here
    yield s
    s.server.stop()


@pytest.fixture
def client(served: Served) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(base_url=served.url.removesuffix("/v1"), api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()


def test_a_text_reply(client: anthropic.Anthropic) -> None:
    r = client.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=ASK, **GREEDY)  # type: ignore[arg-type]
    assert r.type == "message" and r.role == "assistant" and r.model == "tiny"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text  # type: ignore[union-attr]
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.input_tokens > 0
    assert 0 < r.usage.output_tokens <= 8


def test_a_streamed_reply_equals_the_whole_one(client: anthropic.Anthropic, served: Served) -> None:
    kwargs = {"model": "tiny", "max_tokens": 12, "messages": ASK, "extra_body": {"temperature": 0, "top_k": 5}}
    whole = client.messages.create(**kwargs)  # type: ignore[arg-type]
    kinds = []
    with client.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    # The SDK swallows pings; on the wire the sequence is Anthropic's.
    body = {"model": "tiny", "max_tokens": 4, "messages": ASK, "stream": True}
    r = httpx.post(served.url + "/messages", json=body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences_say_which_one_stopped(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="tiny", max_tokens=16, messages=ASK, **GREEDY)  # type: ignore[arg-type]
    text = whole.content[0].text  # type: ignore[union-attr]
    stop = text[3:5] if len(text) >= 5 and text[3:5].strip() else None
    if stop is None:
        pytest.skip("the tiny model's reply is too short to cut")
    r = client.messages.create(model="tiny", max_tokens=16, messages=ASK, stop_sequences=["@@", stop], **GREEDY)  # type: ignore[arg-type]
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert r.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


# One call each (a random model rarely ends a run of parallel calls before the budget does).
ONE = {"disable_parallel_tool_use": True}


@pytest.mark.parametrize("choice", [{"type": "any", **ONE}, {"type": "tool", "name": "get_weather", **ONE}])
def test_a_forced_tool_call_fits_its_schema_every_time(client: anthropic.Anthropic, choice: dict[str, str]) -> None:
    for seed in range(5):
        r = client.messages.create(
            model="tiny", max_tokens=200, messages=ASK, tools=[WEATHER], tool_choice=choice,  # type: ignore[arg-type,list-item]
            metadata={"user_id": f"u{seed}"}, extra_body={"temperature": 0.8},
        )  # fmt: skip
        uses = [b for b in r.content if b.type == "tool_use"]
        assert r.stop_reason == "tool_use" and uses, r.content
        for use in uses:
            assert use.name == "get_weather" and use.id.startswith("toolu_")
            jsonschema.validate(use.input, WEATHER["input_schema"])


def test_a_tool_result_round_trip(client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model="tiny", max_tokens=200, messages=ASK, tools=[WEATHER],  # type: ignore[arg-type,list-item]
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY,
    )  # fmt: skip
    use = next(b for b in first.content if b.type == "tool_use")
    turns = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}]},
    ]
    second = client.messages.create(model="tiny", max_tokens=8, messages=turns, tools=[WEATHER], **GREEDY)  # type: ignore[arg-type,list-item]
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.content
    more = client.messages.count_tokens(model="tiny", messages=turns, tools=[WEATHER])  # type: ignore[arg-type,list-item]
    assert more.input_tokens > client.messages.count_tokens(model="tiny", messages=ASK).input_tokens  # type: ignore[arg-type]
    assert more.input_tokens == second.usage.input_tokens


def test_count_tokens_counts_the_rendered_prompt(client: anthropic.Anthropic, served: Served) -> None:
    r = client.messages.count_tokens(model="tiny", system="Be brief.", messages=ASK)  # type: ignore[arg-type]
    msgs = [{"role": "system", "content": "Be brief."}, *ASK]
    assert r.input_tokens == len(served.tokenizer.encode_chat(msgs))


def test_a_malformed_request_is_an_invalid_request_error(client: anthropic.Anthropic, served: Served) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "robot", "content": "hi"}])  # type: ignore[arg-type,list-item]
    assert info.value.status_code == 400
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    r = httpx.post(served.url + "/messages", json={"model": "tiny", "messages": ASK}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_a_wrong_key_is_an_authentication_error(served: Served) -> None:
    wrong = anthropic.Anthropic(base_url=served.url.removesuffix("/v1"), api_key="sk-wrong", max_retries=0)
    with wrong as c, pytest.raises(anthropic.AuthenticationError) as info:
        c.messages.create(model="tiny", max_tokens=8, messages=ASK)  # type: ignore[arg-type]
    assert info.value.status_code == 401 and info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
