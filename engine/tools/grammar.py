"""The constraint a reply with tools is generated under (engine.generation.constrained), the server's `tool_choice`
and the session's alike: `REQUIRED` or a named tool constrain the whole reply to one call (or several, when
`parallel`) whose arguments match the tool's parameters; `AUTO` leaves the text free and constrains only what follows
a `<tool_call>` the model starts (a lazy trigger), so a small model's call parses; `NONE` constrains nothing."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from engine.generation.constrained import (
    JSON_OPTIONS,
    Grammar,
    GrammarError,
    GrammarKind,
    check_schema,
    text_grammar,
)
from engine.generation.loop import GenerationSettings
from engine.tools.calls import CLOSE, OPEN, Tool, ToolChoice, ToolSpec


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
    """The constraint for a reply under `spec` (None: free text); GrammarError (one sentence, naming the tool) when
    a tool's parameter schema admits none."""
    if not spec.active:
        return None
    tools = tuple(t for t in spec.tools if spec.named in (None, t.name))
    for t in tools:  # each on its own first, so the sentence names the tool whose schema is refused
        check_schema(t.parameters, f"parameter schema of the tool {t.name[:64]!r}")
    body = f'%json {json.dumps(_call_schema(tools))} "\\n{CLOSE}"'
    if spec.choice is ToolChoice.AUTO:  # free text; a started <tool_call> must be completed as a valid call
        lark = f'start: call* TEXT\ncall: trigger "\\n" {body}\ntrigger[lazy]: TEXT "{OPEN}"\nTEXT: /(.|\\n)*/\n'
    else:
        more = ' ("\\n" call)*' if spec.parallel else ""
        lark = f'start: call{more}\ncall: "{OPEN}\\n" {body}\n'
    return text_grammar(lark, GrammarKind.LARK, "tools' parameter schemas")


def tool_settings(settings: GenerationSettings, spec: ToolSpec, reasons: bool) -> GenerationSettings:
    """A session's reply offering `spec`: `settings` under `tool_grammar(spec)`, so a small model's call parses.
    Left as they are where the reply already has a grammar (a JSON reply), or where the model thinks in think tokens
    (`reasons`: a grammar cannot emit those special tokens, its thinking would be cut). A schema that admits no
    grammar leaves an `auto` reply free (its calls read as written) and refuses a forced one (GrammarError)."""
    if settings.grammar is not None or reasons:
        return settings
    try:
        grammar = tool_grammar(spec)
    except GrammarError:
        if spec.choice is ToolChoice.AUTO:
            return settings
        raise
    return replace(settings, grammar=grammar)
