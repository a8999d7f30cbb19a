"""Request bodies are hostile: every shape either parses or is a 400 naming the field, never another exception."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.openai.errors import ApiError
from engine.openai.protocol import Limits, ParsedRequest, parse_chat, parse_completion

LIMITS = Limits()
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "stream",
        "stream_options",
        "logprobs",
        "n",
        "response_format",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(fields, json_values, max_size=8) | json_values)
def test_any_body_parses_or_is_a_400(body: object) -> None:
    for parse in (parse_chat, parse_completion):
        try:
            assert isinstance(parse(body, LIMITS), ParsedRequest)
        except ApiError as err:
            assert err.status == 400 and err.message.endswith(".")


def test_fields_reach_the_settings() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "stop": "x",
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
    }
    r = parse_chat(body, LIMITS)
    assert r.messages == [{"role": "user", "content": "hi"}]
    assert (r.settings.max_tokens, r.settings.stop, r.settings.sampling.seed, r.settings.sampling.top_p) == (
        7,
        ("x",),
        3,
        0.5,
    )
    assert r.settings.sampling.is_greedy and r.stream and r.include_usage and r.logprobs
    assert (
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, LIMITS).settings.max_tokens
        == LIMITS.max_tokens_default
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5}, "stop"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": "s" * 1000}, "stop"),
        ({"model": "m", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 99}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
            "response_format",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}},
                },
            },
            "response_format",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "code"}]}, "tools[0]"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "tool_choice": "always"},
            "tool_choice",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "other"}},
            },
            "tool_choice",
        ),
        ({"model": "m", "messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
        (
            {
                "model": "m",
                "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1"}}]}],
            },
            "messages[0].tool_calls",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ],
)
def test_refusals_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat(body, LIMITS)
    assert e.value.status == 400 and e.value.param == param


def test_completion_prompts() -> None:
    assert parse_completion({"model": "m", "prompt": ["one"]}, LIMITS).prompt == "one"
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}, LIMITS).prompt == [1, 2, 3]
    for bad in ([], [-1], [True], ["a", "b"], "", None):
        with pytest.raises(ApiError):
            parse_completion({"model": "m", "prompt": bad}, LIMITS)


def test_structured_fields_reach_the_request() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = parse_chat(
        {**base, "n": 3, "logprobs": True, "top_logprobs": 20, "response_format": {"type": "json_object"}}, LIMITS
    )
    assert (r.n, r.settings.top_logprobs) == (3, 20) and r.settings.grammar is not None and r.tools is None
    r = parse_chat({**base, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}, LIMITS)
    assert r.tools is not None and r.tools.active and not r.tools.parallel and r.settings.grammar is not None
    assert parse_chat({**base, "tools": [TOOL], "tool_choice": "none"}, LIMITS).settings.grammar is None
    convo = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    r = parse_chat({"model": "m", "messages": convo, "tools": [TOOL]}, LIMITS)
    assert r.messages is not None and r.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert r.messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "c1"}
    assert parse_completion({"model": "m", "prompt": "x", "logprobs": 5, "n": 2}, LIMITS).settings.top_logprobs == 5


def test_temperature_zero_is_the_argmax_with_no_penalty_unless_the_request_sets_one() -> None:
    from engine.openai import ollama

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    s = parse_chat(base, LIMITS).settings.sampling
    assert s.is_greedy and s.repetition_penalty == 1.0
    assert parse_chat({**base, "repetition_penalty": 1.2}, LIMITS).settings.sampling.repetition_penalty == 1.2
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "options": {"repeat_penalty": 1.3}}
    assert ollama.parse_chat(body, LIMITS).settings.sampling.repetition_penalty == 1.3
    with pytest.raises(ApiError):
        parse_chat({**base, "repetition_penalty": 0}, LIMITS)


anthropic_fields = st.sampled_from(
    ["model", "max_tokens", "system", "messages", "tools", "tool_choice", "stop_sequences", "temperature",
     "top_p", "top_k", "stream", "thinking", "output_config", "metadata"]
)  # fmt: skip
anthropic_blocks = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "x"])},
    optional={"text": json_values, "id": json_values, "name": json_values, "input": json_values,
              "tool_use_id": json_values, "content": json_values, "thinking": json_values},
)  # fmt: skip
anthropic_turns = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system"]),
            "content": st.text(max_size=8) | st.lists(anthropic_blocks, max_size=3),
        }
    ),
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(anthropic_fields, json_values, max_size=8)
    | st.fixed_dictionaries({"model": st.just("m"), "max_tokens": st.just(8), "messages": anthropic_turns})
    | json_values
)
def test_any_anthropic_body_parses_or_is_a_400(body: object) -> None:
    from engine.openai.anthropic import MessagesRequest, parse_messages

    for counting in (False, True):
        try:
            assert isinstance(parse_messages(body, LIMITS, counting=counting), MessagesRequest)
        except ApiError as err:
            assert err.status == 400 and err.message.endswith(".")
