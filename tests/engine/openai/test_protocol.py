"""Request bodies are hostile: every shape either parses or is a 400 naming the field, never another exception."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.openai.errors import ApiError
from engine.openai.protocol import Limits, ParsedRequest, parse_chat, parse_completion

LIMITS = Limits()
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
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
            "response_format",
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
