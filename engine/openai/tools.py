"""Tool calling and structured replies for the OpenAI-compatible server: `tools`, `tool_choice`,
`response_format`, the messages a tool conversation carries, and tool calls read back out of the reply.

The wire form of a call in the model's text is Hermes' (the form Qwen 2.5/3, Hermes and SmolLM3 templates teach):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, several in a row for parallel calls. A chat template that itself writes `<tool_call>` gets the
request's `tools` and the conversation's tool calls and tool results as its own variables (transformers'
convention: `tools`, assistant `tool_calls` with `arguments` as an object, `role: "tool"` messages). Any other
template gets the documented fallback: a system message that lists the tools as JSON and shows the form above,
earlier calls written into the assistant's text in that form, and each tool result as a user turn wrapped in
`<tool_response>` tags (what Qwen's own template renders).

Constraints (engine.generation.constrained): `tool_choice: "required"` or a named function constrains the whole
reply to one call (or several, when `parallel_tool_calls` allows) whose arguments match the function's
parameters; `"auto"` leaves the text free and constrains only what follows a `<tool_call>` the model starts
(a lazy trigger); `"none"` neither describes the tools nor reads calls back.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from engine.generation.constrained import (
    JSON_OPTIONS,
    Grammar,
    GrammarError,
    GrammarKind,
    check_schema,
    json_object_grammar,
    json_schema_grammar,
    text_grammar,
)
from engine.openai.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
MAX_NAME_CHARS = 64  # as OpenAI: a function name is at most 64 of [a-zA-Z0-9_-]
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


class ToolChoice(StrEnum):
    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


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
    tools: tuple[Tool, ...]
    choice: ToolChoice
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

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


# -- request fields -----------------------------------------------------------------------------------------------


def _name(v: Any, field: str) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_NAME_CHARS or not set(v) <= NAME_CHARS:
        raise bad_request(f"'{field}' must be a function name of 1 to {MAX_NAME_CHARS} letters, digits, _ or -.", field)
    return v


def parse_tools(body: dict[str, Any]) -> ToolSpec | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request; None when it has no tools."""
    raw = body.get("tools")
    choice_raw = body.get("tool_choice")
    if raw is None or raw == []:
        if choice_raw not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools' to choose from.", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} function tools.", "tools")
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}.", f"tools[{i}]")
        name = _name(fn.get("name"), f"tools[{i}].function.name")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise bad_request(f"tools[{i}].function.description must be a string.", f"tools[{i}].function.description")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object.", f"tools[{i}].function")
        if any(t.name == name for t in tools):
            raise bad_request(f"tools[{i}] repeats the function name '{name}'.", f"tools[{i}].function.name")
        tools.append(Tool(name, description, params))
    named = None
    if choice_raw is None:
        choice = ToolChoice.AUTO
    elif isinstance(choice_raw, str) and choice_raw in ("auto", "none", "required"):
        choice = ToolChoice(choice_raw)
    elif isinstance(choice_raw, dict) and choice_raw.get("type") == "function":
        fn = choice_raw.get("function")
        named = _name(fn.get("name") if isinstance(fn, dict) else None, "tool_choice.function.name")
        if not any(t.name == named for t in tools):
            raise bad_request(f"'tool_choice' names '{named}', which is not among 'tools'.", "tool_choice")
        choice = ToolChoice.NAMED
    else:
        raise bad_request(
            "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}.",
            "tool_choice",
        )
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be true or false.", "parallel_tool_calls")
    return ToolSpec(tuple(tools), choice, named, parallel)


def parse_response_format(body: dict[str, Any]) -> Grammar | None:
    """`response_format`: text (None), json_object, or json_schema (constrained whether `strict` or not)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise bad_request(
                "'response_format.json_schema' must be {'name': ..., 'schema': {...}, 'strict': true}.",
                "response_format",
            )
        try:
            return json_schema_grammar(spec.get("schema", {}), "response_format schema")
        except GrammarError as exc:
            raise bad_request(str(exc), "response_format") from None
    raise bad_request("'response_format' must be of type 'text', 'json_object' or 'json_schema'.", "response_format")


def _call_schema(tools: tuple[Tool, ...]) -> dict[str, Any]:
    """The JSON schema of one call's object, compact like every constrained JSON (JSON_OPTIONS)."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ],
        "x-guidance": JSON_OPTIONS,
    }


def tool_grammar(spec: ToolSpec) -> Grammar | None:
    """The constraint for a reply under `spec` (None: free text)."""
    if not spec.active:
        return None
    tools = tuple(t for t in spec.tools if spec.named in (None, t.name))
    try:
        for t in tools:  # each on its own first, so the sentence names the tool whose schema is refused
            check_schema(t.parameters, f"parameter schema of the tool {t.name[:64]!r}")
    except GrammarError as exc:
        raise bad_request(str(exc), "tools") from None
    body = f'%json {json.dumps(_call_schema(tools))} "\\n{CLOSE}"'
    if spec.choice is ToolChoice.AUTO:  # free text; a started <tool_call> must be completed as a valid call
        lark = f'start: call* TEXT\ncall: trigger "\\n" {body}\ntrigger[lazy]: TEXT "{OPEN}"\nTEXT: /(.|\\n)*/\n'
    else:
        more = ' ("\\n" call)*' if spec.parallel else ""
        lark = f'start: call{more}\ncall: "{OPEN}\\n" {body}\n'
    try:
        return text_grammar(lark, GrammarKind.LARK, "tools' parameter schemas")
    except GrammarError as exc:
        raise bad_request(str(exc), "tools") from None


# -- prompt -------------------------------------------------------------------------------------------------------

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
    """Messages and extra template variables for the chat template (see the module docstring for the two ways)."""
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
        if m["role"] == "tool":
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


# -- reply --------------------------------------------------------------------------------------------------------


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


def read_reply(text: str, spec: ToolSpec) -> tuple[str, list[ToolCall]]:
    """A whole reply's content and tool calls; blank content between calls is dropped."""
    reader = ToolCallReader(spec)
    content, calls = reader.push(text)
    content += reader.flush()
    return (content.strip() if calls else content), calls
