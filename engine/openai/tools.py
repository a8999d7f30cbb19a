"""The server's tool fields: `tools`, `tool_choice`, `parallel_tool_calls` and `response_format` read out of a
request, and the tool grammar's refusal as a 400. What a tool and a call are, the grammar a reply with tools is
generated under, the chat template's inputs and the calls read back out of a reply are engine.tools', shared with
`Session.chat(..., tools=)`.
"""

from __future__ import annotations

from typing import Any

from engine.generation.constrained import Grammar, GrammarError, json_object_grammar, json_schema_grammar
from engine.openai.errors import bad_request
from engine.tools.calls import Tool, ToolChoice, ToolSpec
from engine.tools.grammar import tool_grammar

MAX_TOOLS = 128
MAX_NAME_CHARS = 64  # as OpenAI: a function name is at most 64 of [a-zA-Z0-9_-]
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


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


def grammar_for(spec: ToolSpec) -> Grammar | None:
    """engine.tools' grammar for a request's tools; a schema it refuses is the request's 400."""
    try:
        return tool_grammar(spec)
    except GrammarError as exc:
        raise bad_request(str(exc), "tools") from None
