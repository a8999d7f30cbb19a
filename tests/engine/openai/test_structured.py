"""Structured output and tool calling through the official `openai` client, on a loopback server over the real
default model: json_schema replies validate; tool_choice "required" returns calls whose arguments validate against
the function's schema, streamed and not; a tool result continues the conversation; `n` gives that many choices;
`top_logprobs` lists the alternatives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from engine.openai.protocol import parse_chat
from engine.openai.server import LocalServer
from engine.openai.service import ModelService, ServeConfig
from engine.session.engine import Engine, memory_factory_for
from tests.helpers.http_clients import closed_after_test

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 50_000_000},
        "rivers": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["city", "country", "population", "rivers"],
    "additionalProperties": False,
}
WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_ARGS},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a timezone",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string", "maxLength": 32}},
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ModelService]]:
    from tests.helpers.real_model import real_gguf

    model = real_gguf()
    cache = tmp_path_factory.mktemp("kv")
    engine = Engine.load(model, "cpu", memory_factory=memory_factory_for(model, cache_dir=cache), quantize="auto")
    service = ModelService(engine.locked_fork(), engine.tokenizer, engine.memory_factory, ServeConfig(model_id="smol"))
    with LocalServer(service, port=0) as server:
        yield server.url, service


def connect(served: tuple[str, ModelService]) -> tuple[openai.OpenAI, ModelService]:
    url, service = served
    return closed_after_test(openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)), service


def test_json_schema_replies_validate_in_each_of_n_choices(served: tuple[str, ModelService]) -> None:
    client, _ = connect(served)
    reply = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}},
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=120,
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), CITY)
        assert choice.finish_reason == "stop"
    assert len({c.message.content for c in reply.choices}) > 1  # each choice draws with its own seed


def test_required_tool_call_validates(served: tuple[str, ModelService]) -> None:
    client, _ = connect(served)
    reply = client.chat.completions.create(
        model="smol",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # a small model given the choice keeps calling until max_tokens
        temperature=0.8,
        seed=1,
        max_tokens=120,  # type: ignore[arg-type]
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_named_tool_call_streams_in_openais_shape(served: tuple[str, ModelService]) -> None:
    client, _ = connect(served)
    stream = client.chat.completions.create(
        model="smol",
        messages=ASK,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        stream=True,
        temperature=0.8,
        seed=2,
        max_tokens=120,
    )
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += (tc.function.name if tc.function else None) or ""
            entry["arguments"] += (tc.function.arguments if tc.function else None) or ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons == ["tool_calls"] and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_ARGS)


def test_a_tool_result_continues_the_conversation(served: tuple[str, ModelService]) -> None:
    client, service = connect(served)
    first = client.chat.completions.create(
        model="smol",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=120,  # type: ignore[arg-type]
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    messages: list[Any] = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "unit": "celsius"}'},
    ]
    second = client.chat.completions.create(
        model="smol",
        messages=messages,
        tools=TOOLS,
        temperature=0,
        max_tokens=40,  # type: ignore[arg-type]
    )
    # The default model's template knows no tools: the fallback renders the result as a <tool_response> turn.
    req = parse_chat({"model": "smol", "messages": messages, "tools": TOOLS}, service.config.limits)
    prompt = service.tokenizer.decode(service.prompt_ids(req), skip_special=False)
    assert '<tool_response>\n{"temperature": 18, "unit": "celsius"}\n</tool_response>' in prompt
    assert call.function.name in prompt  # the earlier call is in the transcript
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def test_top_logprobs(served: tuple[str, ModelService]) -> None:
    client, _ = connect(served)
    reply = client.chat.completions.create(
        model="smol", messages=ASK, max_tokens=4, temperature=0, logprobs=True, top_logprobs=5
    )
    content = (reply.choices[0].logprobs and reply.choices[0].logprobs.content) or []
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 5
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely


def test_refusals_are_400s(served: tuple[str, ModelService]) -> None:
    client, _ = connect(served)
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(60):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="smol",
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}},
        )
    assert "nests deeper" in str(err.value)
