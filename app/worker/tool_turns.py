"""A turn that may call tools, as a thin loop over the session's tool calling (`Session.chat(..., tools=)`): the
reply streams under the tools' grammar; when it ends in tool calls (a ToolCalls event) each is run through the
toolbox (the user's consent first), the results go back (`Session.tool_results`) and the reply continues, at most
MAX_TOOL_ROUNDS times a turn. Send and Regenerate both run it.

The conversation keeps tools as plain messages, so its `.spark` file holds them and restores them exactly: a call
is the assistant's own text (the `<tool_call>` block it wrote), a result is a `tool` message whose content is a
small JSON object (`name`, `status`, `content`). What the model sees of them is the session's business
(engine.tools.template, as the server renders them).

In the chat a turn is one reply (`display_messages`): its messages joined, each result as a `<tool_response>` block
after the call it answers, which app.tools.cards shows as a card. The live stream carries the same text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import Any

from app.tools.toolbox import Toolbox, ToolRun
from app.worker.types import MessageView
from engine import GenerationEvent
from engine.tools.calls import ChatEvent, Tool, ToolCall, ToolCalls, ToolChoice, ToolSpec
from engine.tools.template import TOOL_ROLE

MAX_TOOL_ROUNDS = 4  # a model that keeps calling tools still ends its turn
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


class ToolStatus(StrEnum):
    OK = "ok"  # allowed, ran, and the tool reported success
    ERROR = "error"  # allowed (or attempted), and it failed or reported an error
    DENIED = "denied"  # the user did not allow it: nothing ran


def tool_spec(openai_tools: list[dict[str, Any]]) -> ToolSpec:
    """The toolbox's tools as the session offers them: the model calls them when it likes (`auto`)."""
    tools = tuple(
        Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"]) for t in openai_tools
    )
    return ToolSpec(tools, ToolChoice.AUTO)


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
    first: Iterator[ChatEvent],
    follow: Callable[[list[str]], Iterator[ChatEvent]],
    toolbox: Toolbox,
    on_run: Callable[[ToolRun], None],
    stop: Callable[[], bool],
) -> Iterator[GenerationEvent]:
    """The events of the whole turn: `first` reply, then after each round of calls `follow(results)`, the results
    being the `tool` messages' contents in the order of the calls."""
    events = first
    for round_ in range(MAX_TOOL_ROUNDS + 1):
        calls: tuple[ToolCall, ...] = ()
        for ev in events:
            if isinstance(ev, ToolCalls):
                calls = ev.calls
            else:
                yield ev
        if stop() or round_ == MAX_TOOL_ROUNDS or not calls:
            return
        results = []
        for call in calls:
            if stop():
                return
            run = toolbox.run(call.name, call.arguments)
            on_run(run)
            results.append(result_content(run))
        events = follow(results)
