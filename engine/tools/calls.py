"""Tools, calls and the events a reply with calls ends in; calls read back out of a reply's text.

The wire form of a call in the model's text is Hermes' (the form Qwen 2.5/3, Hermes and SmolLM3 templates teach):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, several in a row for parallel calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from engine.generation.loop import FinishReason, GenerationEvent

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolChoice(StrEnum):
    AUTO = "auto"  # free text; a call the model starts is held to the tools' schemas
    NONE = "none"  # the tools are neither described nor read back
    REQUIRED = "required"  # the whole reply is calls
    NAMED = "named"  # the whole reply is calls of the one tool `ToolSpec.named`


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema for the arguments object

    def as_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolSpec:
    """The tools a reply is offered and how it may use them."""

    tools: tuple[Tool, ...]
    choice: ToolChoice = ToolChoice.AUTO
    named: str | None = None  # the tool ToolChoice.NAMED names
    parallel: bool = True  # a forced reply may hold several calls

    @property
    def active(self) -> bool:
        """Tools are described to the model and calls are read back."""
        return bool(self.tools) and self.choice is not ToolChoice.NONE


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolCalls:
    """A reply read as content and calls; `Session.chat(..., tools=)` yields one after a reply that made calls
    (whose final GenerationEvent then ends in FinishReason.TOOL_CALLS, unless it was cut short)."""

    content: str  # the reply's text outside its calls
    calls: tuple[ToolCall, ...]


# What a conversation with tools streams.
ChatEvent = GenerationEvent | ToolCalls


def finish_with_calls(reason: FinishReason, calls: bool) -> FinishReason:
    """A reply's finish reason once its calls are read: a reply that ended by itself after calls ended in them."""
    return FinishReason.TOOL_CALLS if calls and reason is FinishReason.STOP else reason


def _read_call(block: str, spec: ToolSpec) -> ToolCall | None:
    """One `<tool_call>` block's JSON as a call of one of `spec`'s tools, or None when it is not one."""
    try:
        obj = json.loads(block)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(args := obj.get("arguments", {}), dict):
        return None
    name = obj.get("name")
    if not any(t.name == name for t in spec.tools):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", str(name), json.dumps(args, ensure_ascii=False))


class ToolCallReader:
    """Reads a reply's text as it streams: `push(text)` gives the content that is final and the calls completed.

    Text outside `<tool_call>` blocks is content; a block that parses as a call of one of the tools becomes a
    ToolCall, one that does not stays in the content as written. Text that could still become `<tool_call>` is held
    back until it cannot, and blank text until text that is not blank follows.
    """

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.buffer = ""  # held back: a possible start of OPEN, or an open block
        self.space = ""  # held back: blank content
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content: list[str] = []
        new: list[ToolCall] = []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = next(
                    (
                        n
                        for n in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                        if OPEN.startswith(self.buffer[-n:])
                    ),
                    0,
                )
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                break
            call = _read_call(self.buffer[start + len(OPEN) : end], self.spec)
            block_end = end + len(CLOSE)
            if call is None:
                content.append(self.buffer[:block_end])
            else:
                content.append(self.buffer[:start])
                new.append(call)
            self.buffer = self.buffer[block_end:]
        self.calls += new
        out = self.space + "".join(content)
        if out.strip():
            self.space = ""
            return out, new
        self.space = out  # blank text (between calls, say) waits for text that is not blank
        return "", new

    def flush(self) -> str:
        """End of the reply: whatever is held back is content (an unfinished block included); blank text is
        dropped when the reply made calls."""
        out, self.buffer, self.space = self.space + self.buffer, "", ""
        return "" if self.calls and not out.strip() else out


def read_reply(text: str, spec: ToolSpec) -> ToolCalls:
    """A whole reply's content and tool calls; blank content between calls is dropped."""
    reader = ToolCallReader(spec)
    content, calls = reader.push(text)
    content += reader.flush()
    return ToolCalls(content.strip() if calls else content, tuple(calls))
