"""The MCP servers the model may call tools of, as Settings shows them: one stdio server a line,
`name: command arg…` (a shell's quoting for arguments with spaces), read back into `McpServerSpec`s."""

from __future__ import annotations

import re
import shlex

from app.tools.mcp_host import McpServerSpec

NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


class ToolServerError(ValueError):
    """One sentence naming the line that cannot be read."""


def servers_text(specs: list[McpServerSpec]) -> str:
    return "\n".join(f"{s.name}: {shlex.join([s.command, *s.args])}" for s in specs)


def parse_servers(text: str) -> list[McpServerSpec]:
    specs: list[McpServerSpec] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        name, sep, rest = line.partition(":")
        name = name.strip()
        if not sep or not NAME.match(name):
            raise ToolServerError(f"Line {n} needs a name (letters, digits, _ or -) and a colon before the command.")
        try:
            words = shlex.split(rest)
        except ValueError as exc:
            raise ToolServerError(f"Line {n}'s command cannot be read ({exc}).") from None
        if not words:
            raise ToolServerError(f"Line {n} names no command to start.")
        if any(s.name == name for s in specs):
            raise ToolServerError(f"Line {n} repeats the name '{name}'; each server needs its own.")
        specs.append(McpServerSpec(name, words[0], tuple(words[1:])))
    return specs
