"""A turn that may call tools: the reply streams; the `<tool_call>` blocks it wrote are read back (the engine's
reader), each is run through the toolbox (the user's consent first), the results go back to the model as a message
and the reply continues, at most MAX_TOOL_ROUNDS times a turn.

The conversation carries tools the way the engine documents for templates that do not know them (the fallback of
engine.openai.tools): the tools are listed in the system prompt, a call is the reply's own text, a result is a
`<tool_response>` message. That is plain messages, so the conversation's file keeps them and restores them exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from app.tools.toolbox import Toolbox, ToolRun
from engine import GenerationEvent
from engine.openai.tools import FALLBACK_SYSTEM, Tool, ToolChoice, ToolSpec, chat_inputs, read_reply

MAX_TOOL_ROUNDS = 4  # a model that keeps calling tools still ends its turn
NOTE_START = FALLBACK_SYSTEM.split("{tools}")[0]  # how the tools' listing in a system prompt begins
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"  # the fallback's form of a tool result
FOLDED_CHARS = 300  # a result is shown folded to this many characters in the chat (the model gets it whole)


def tool_spec(openai_tools: list[dict[str, Any]]) -> ToolSpec:
    tools = tuple(
        Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"]) for t in openai_tools
    )
    return ToolSpec(tools, ToolChoice.AUTO)


def tools_note(spec: ToolSpec) -> str:
    """The system prompt's part that lists the tools and shows how to call them ("" without tools)."""
    if not spec.active:
        return ""
    messages, _ = chat_inputs([], spec, None)
    return str(messages[0]["content"])


def without_tools_note(system_prompt: str) -> str:
    """The user's system prompt without a tools' listing after it (one saved in a file with tools on included)."""
    if system_prompt.startswith(NOTE_START):
        return ""
    at = system_prompt.find(f"\n\n{NOTE_START}")
    return system_prompt[:at] if at >= 0 else system_prompt


def folded(run: ToolRun) -> str:
    """How a call and its result show in the reply: one quoted line, the result cut short."""
    if not run.allowed:
        return f"\n\n> Tool {run.name} did not run: {run.outcome.text}\n\n"
    text = " ".join(run.outcome.text.split())
    text = text if len(text) <= FOLDED_CHARS else text[:FOLDED_CHARS] + "…"
    status = "" if run.outcome.ok else " (the tool reported an error)"
    return f"\n\n> Tool {run.name}({run.arguments}){status} → {text}\n\n"


def folded_response(message: str) -> str | None:
    """A tool result message (as `response_message` wrote it) as the chat shows it folded; None for any other."""
    if not message.startswith(RESPONSE_OPEN) or not message.endswith(RESPONSE_CLOSE):
        return None
    parts = []
    for block in message.split(RESPONSE_CLOSE):
        body = block.strip().removeprefix(RESPONSE_OPEN).strip()
        if not body:
            continue
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(data, dict):
            return None
        text = " ".join(str(data.get("content", "")).split())
        text = text if len(text) <= FOLDED_CHARS else text[:FOLDED_CHARS] + "…"
        parts.append(f"Tool {data.get('name', '?')} → {text}")
    return "\n".join(parts) or None


def response_message(run: ToolRun) -> str:
    body = json.dumps({"name": run.name, "content": run.outcome.text}, ensure_ascii=False)
    return f"{RESPONSE_OPEN}\n{body}\n{RESPONSE_CLOSE}"


def with_tools(
    first: Iterator[GenerationEvent],
    follow: Callable[[str], Iterator[GenerationEvent]],
    toolbox: Toolbox,
    spec: ToolSpec,
    on_run: Callable[[ToolRun], None],
    stop: Callable[[], bool],
) -> Iterator[GenerationEvent]:
    """The events of the whole turn: `first` reply, then after each round of calls `follow(results message)`."""
    events = first
    for round_ in range(MAX_TOOL_ROUNDS + 1):
        text: list[str] = []
        for ev in events:
            text.append(ev.text)
            yield ev
        if stop() or round_ == MAX_TOOL_ROUNDS:
            return
        _, calls = read_reply("".join(text), spec)
        if not calls:
            return
        responses = []
        for call in calls:
            if stop():
                return
            run = toolbox.run(call.name, call.arguments)
            on_run(run)
            responses.append(response_message(run))
        events = follow("\n".join(responses))
