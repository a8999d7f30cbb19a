"""Tools and tool turns in the chat template.

A chat template that itself writes `<tool_call>` gets the tools and the conversation's tool calls and tool results
as its own variables (transformers' convention: `tools`, assistant `tool_calls` with `arguments` as an object,
`role: "tool"` messages). Any other template gets the documented fallback: a system message that lists the tools as
JSON and shows the call form, earlier calls written into the assistant's text in that form, and each tool result as
a user turn wrapped in `<tool_response>` tags (what Qwen's own template renders).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engine.tools.calls import CLOSE, OPEN, ToolSpec, read_reply

TOOL_ROLE = "tool"  # a tool result's role in a conversation

FALLBACK_SYSTEM = (
    "You can call these tools:\n{tools}\n"
    "To call a tool, reply with one block per call and nothing else in it:\n"
    '<tool_call>\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>\n'
    "Tool results come back inside <tool_response></tool_response>."
)


def template_knows_tools(template: str | None) -> bool:
    """The template writes Hermes-style calls itself (and so reads `tools`, `tool_calls` and tool messages)."""
    return template is not None and OPEN in template


def _call_text(call: dict[str, Any]) -> str:
    fn = call["function"]
    return f'{OPEN}\n{{"name": {json.dumps(fn["name"])}, "arguments": {fn["arguments"]}}}\n{CLOSE}'


def chat_inputs(
    messages: list[dict[str, Any]], spec: ToolSpec | None, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """OpenAI-shaped messages (assistant `tool_calls`, `tool` messages) -> the chat template's messages and extra
    variables, one of the two ways above; `spec` None or inactive: no tools offered (earlier calls still render)."""
    if template_knows_tools(template):
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [
                    {
                        "type": "function",
                        "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])},
                    }
                    for c in m["tool_calls"]
                ]
                m = {**m, "tool_calls": calls}
            out.append(m)
        extra = {"tools": [t.as_openai() for t in spec.tools]} if spec is not None and spec.active else {}
        return out, extra
    out = []
    for m in messages:
        if m["role"] == TOOL_ROLE:
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            text = "\n".join(([m["content"]] if m["content"] else []) + [_call_text(c) for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if spec is not None and spec.active:
        listing = "\n".join(json.dumps(t.as_openai()["function"]) for t in spec.tools)
        note = FALLBACK_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, {}


def transcript_inputs(
    messages: Sequence[dict[str, Any]], spec: ToolSpec | None, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A session's transcript -> the chat template's messages and variables. A session keeps a call as the
    assistant's own text (the `<tool_call>` block it wrote) and a result as a `tool` message, so the calls are read
    back out of that text for a template that writes calls its own way; any other template reads the text as is."""
    knows = template_knows_tools(template)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and knows and spec is not None and spec.tools:
            reply = read_reply(m["content"], spec)
            out.append(
                {"role": "assistant", "content": reply.content, "tool_calls": [c.as_openai() for c in reply.calls]}
            )
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return chat_inputs(out, spec, template)
