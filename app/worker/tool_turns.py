"""A turn that may call tools: the reply streams; the `<tool_call>` blocks it wrote are read back (the engine's
reader), each is run through the toolbox (the user's consent first), the results go back to the model as `tool`
messages and the reply continues, at most MAX_TOOL_ROUNDS times a turn. Send and Regenerate both run it.

The conversation keeps tools as plain messages, so its `.spark` file holds them and restores them exactly: a call
is the assistant's own text (the `<tool_call>` block it wrote), a result is a `tool` message whose content is a
small JSON object (`name`, `status`, `content`). What the model sees of them is its chat template's business: the
session renders its messages through `template_inputs`, engine.openai.tools' conversion, as the server does, so a
template that knows tools gets its own `tools` variable, assistant `tool_calls` and `tool` messages, and any other
gets the documented fallback (the tools listed in the system prompt, results as `<tool_response>` turns).

In the chat a turn is one reply (`display_messages`): its messages joined, each result as a `<tool_response>` block
after the call it answers, which app.tools.cards shows as a card. The live stream carries the same text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from enum import StrEnum
from typing import Any

from app.tools.toolbox import Toolbox, ToolRun
from app.worker.types import MessageView
from engine import GenerationEvent, GenerationSettings
from engine.openai.errors import ApiError
from engine.openai.tools import (
    Tool,
    ToolChoice,
    ToolSpec,
    chat_inputs,
    read_reply,
    template_knows_tools,
    tool_grammar,
)

MAX_TOOL_ROUNDS = 4  # a model that keeps calling tools still ends its turn
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TOOL_ROLE = "tool"


class ToolStatus(StrEnum):
    OK = "ok"  # allowed, ran, and the tool reported success
    ERROR = "error"  # allowed (or attempted), and it failed or reported an error
    DENIED = "denied"  # the user did not allow it: nothing ran


TemplateInputs = Callable[[list[dict[str, str]]], tuple[list[dict[str, Any]], dict[str, Any]]]


def tool_spec(openai_tools: list[dict[str, Any]]) -> ToolSpec:
    tools = tuple(
        Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"]) for t in openai_tools
    )
    return ToolSpec(tools, ToolChoice.AUTO)


def constrained(settings: GenerationSettings, spec: ToolSpec, reasons: bool) -> GenerationSettings:
    """The turn's settings with a tool call the model starts held to its tools' schemas: the grammar the server uses
    for `tool_choice: auto` (free text, and a started `<tool_call>` completed as a valid call), so a small model's
    call parses. Left as they are where the reply already has a grammar (Reply as JSON), where the model thinks in
    think tokens (a grammar cannot emit those special tokens: its thinking would be cut), or where a tool's schema
    admits no grammar (the call is then read as written, as before)."""
    if settings.grammar is not None or reasons:
        return settings
    try:
        grammar = tool_grammar(spec)
    except ApiError:
        return settings
    return replace(settings, grammar=grammar)


def template_inputs(spec: ToolSpec | None, template: str | None) -> TemplateInputs:
    """The session's messages -> the chat template's messages and variables, tools included (`spec`; None: no tools
    offered, though earlier calls and results still render)."""
    knows = template_knows_tools(template)

    def convert(messages: list[dict[str, str]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            if m["role"] == "assistant" and knows and spec is not None and spec.tools:
                content, calls = read_reply(m["content"], spec)  # the template writes the calls its own way
                out.append({"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        return chat_inputs(out, spec, template)

    return convert


def status_of(run: ToolRun) -> ToolStatus:
    if run.denied:
        return ToolStatus.DENIED
    return ToolStatus.OK if run.allowed and run.outcome.ok else ToolStatus.ERROR


def result_content(run: ToolRun) -> str:
    """The `tool` message's content for `run` (what the model reads, and what the file keeps)."""
    return json.dumps({"name": run.name, "status": status_of(run), "content": run.outcome.text}, ensure_ascii=False)


def response_block(content: str) -> str:
    """A result as the chat shows it inside a reply (after the call it answers)."""
    return f"\n{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}\n"


def display_messages(messages: list[MessageView]) -> list[tuple[int, MessageView]]:
    """The transcript as the chat shows it, with each message's index: a reply and the tool results and replies
    after it, up to the next user message, are one reply (indexed by its last message), as they streamed."""
    out: list[tuple[int, MessageView]] = []
    for i, m in enumerate(messages):
        if m.role in ("assistant", TOOL_ROLE) and out and out[-1][1].role == "assistant":
            part = response_block(m.content) if m.role == TOOL_ROLE else m.content
            out[-1] = (i, MessageView("assistant", out[-1][1].content + part))
        elif m.role == TOOL_ROLE:  # a result with no reply before it (a hand-made file): shown as a reply
            out.append((i, MessageView("assistant", response_block(m.content))))
        else:
            out.append((i, m))
    return out


def with_tools(
    first: Iterator[GenerationEvent],
    follow: Callable[[list[str]], Iterator[GenerationEvent]],
    toolbox: Toolbox,
    spec: ToolSpec,
    on_run: Callable[[ToolRun], None],
    stop: Callable[[], bool],
) -> Iterator[GenerationEvent]:
    """The events of the whole turn: `first` reply, then after each round of calls `follow(results)`, the results
    being the `tool` messages' contents in the order of the calls."""
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
        results = []
        for call in calls:
            if stop():
                return
            run = toolbox.run(call.name, call.arguments)
            on_run(run)
            results.append(result_content(run))
        events = follow(results)
