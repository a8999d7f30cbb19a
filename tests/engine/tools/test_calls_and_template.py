"""Tool calls read back out of streamed text, and tool conversations rendered for templates that know tools and
for those that do not (the documented fallback)."""

from __future__ import annotations

import json
from typing import Any

from engine.tools.calls import Tool, ToolCallReader, ToolCalls, ToolChoice, ToolSpec, read_reply
from engine.tools.template import FALLBACK_SYSTEM, chat_inputs, template_knows_tools

SPEC = ToolSpec(
    (Tool("get_weather", "weather", {"type": "object"}), Tool("get_time", "", {"type": "object"})), ToolChoice.AUTO
)
TWO_CALLS = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_calls_are_read_whatever_the_pieces() -> None:
    for size in (1, 3, 7, len(TWO_CALLS)):
        reader = ToolCallReader(SPEC)
        content, names = "", []
        for i in range(0, len(TWO_CALLS), size):
            text, calls = reader.push(TWO_CALLS[i : i + size])
            content += text
            names += [c.name for c in calls]
            assert "<tool" not in text  # a block's start is never shown as content
        content += reader.flush()
        assert content.rstrip() == "Let me look." and names == ["get_weather", "get_time"]
    reply = read_reply(TWO_CALLS, SPEC)
    content, calls = reply.content, reply.calls
    assert content == "Let me look."
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {}]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_blocks_that_are_not_calls_stay_content() -> None:
    for text in (
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "get_time"',  # cut off by max_tokens
        "a < b and <tool",
    ):
        assert read_reply(text, SPEC) == ToolCalls(text, ())


CONVO: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
]


def test_fallback_for_templates_without_tools() -> None:
    messages, extra = chat_inputs(CONVO, SPEC, "{{ messages }}")
    assert extra == {}
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith(
        "Be brief.\n\nYou can call these tools:"
    )
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    # tool_choice "none": the tools are not described, the conversation still renders.
    none = ToolSpec(SPEC.tools, ToolChoice.NONE)
    assert chat_inputs(CONVO, none, None)[0][0] == {"role": "system", "content": "Be brief."}
    assert "{tools}" in FALLBACK_SYSTEM


def test_templates_that_know_tools_get_them() -> None:
    template = "{% for t in tools %}{{ t }}{% endfor %}<tool_call>"
    assert template_knows_tools(template) and not template_knows_tools(None)
    messages, extra = chat_inputs(CONVO, SPEC, template)
    assert [t["function"]["name"] for t in extra["tools"]] == ["get_weather", "get_time"]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object, as templates want
    assert messages[3] == CONVO[3]
