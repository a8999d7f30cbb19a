"""The tools a conversation offers the model: every configured MCP server's tools under one name each, in the
shape the engine's chat template takes (OpenAI's `tools`), and `run` for a call the model made: consent first,
then the server, the outcome as the text the transcript folds in.

The small typed interface the conversation worker hooks into:
    toolbox = Toolbox(McpHost(), ConsentGate(ask))
    toolbox.start_servers(specs)            # -> one line per server that could not start
    toolbox.openai_tools()                  # -> `tools` for the chat template
    toolbox.run(name, arguments_json)       # -> ToolRun (shown in the chat, saved with the conversation)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from app.tools.consent import ConsentGate, PendingCall
from app.tools.display import shown
from app.tools.mcp_host import MAX_TOOL_NAME, MAX_TOOLS, McpError, McpHost, McpServerSpec, McpTool, ToolOutcome

MAX_NAME = 64  # OpenAI's bound on a function name (and Hermes templates')
MAX_ARGUMENTS = 1 << 20  # a call's arguments as the model wrote them


def exposed_name(tool: McpTool) -> str:
    """`server__tool`, cut to the characters and length a function name may have."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{tool.server}__{tool.name}")[:MAX_NAME]


@dataclass(frozen=True)
class ToolRun:
    """One call the model made and what came of it (what the transcript shows and the session file keeps)."""

    name: str
    arguments: str  # JSON object text, as the model wrote it
    allowed: bool
    outcome: ToolOutcome
    denied: bool = False  # the user said no (else `allowed` False means the call could not be made)


class Toolbox:
    def __init__(self, host: McpHost, gate: ConsentGate) -> None:
        self.host = host
        self.gate = gate
        self._tools: dict[str, McpTool] = {}

    def start_servers(self, specs: list[McpServerSpec]) -> list[str]:
        """Start every server at once; one sentence per server that could not start (the others are used anyway)
        and per tool left out because its exposed name is another's (the first server in the list keeps it: a
        server cannot shadow another's tool)."""
        problems = []
        for spec, started in zip(specs, self.host.start_all(specs), strict=True):
            if isinstance(started, McpError):
                problems.append(str(started))
                continue
            if left_out := self.host.left_out(spec.name):
                problems.append(
                    f"The MCP server '{shown(spec.name, 64)}' lists {left_out:,} tools that were left out (past the "
                    f"first {MAX_TOOLS}, or with a name of control characters or over {MAX_TOOL_NAME} characters, or "
                    "a schema too large or too deep)."
                )
            for tool in started:
                name = exposed_name(tool)
                taken = self._tools.get(name)
                if taken is not None:
                    problems.append(
                        f"The tool '{shown(tool.name, 64)}' of MCP server '{shown(spec.name, 64)}' was left out: its "
                        f"name {name} is already the tool '{shown(taken.name, 64)}' of '{shown(taken.server, 64)}'."
                    )
                    continue
                self._tools[name] = tool
        return problems

    def openai_tools(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {"name": name, "description": t.description, "parameters": t.input_schema},
            }
            for name, t in self._tools.items()
        ]

    def run(self, name: str, arguments: str) -> ToolRun:
        tool = self._tools.get(name)
        if tool is None:
            return ToolRun(name, arguments, False, ToolOutcome(False, f"There is no tool named '{shown(name, 64)}'."))
        try:
            args = json.loads(arguments) if len(arguments) <= MAX_ARGUMENTS else None
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            return ToolRun(name, arguments, False, ToolOutcome(False, "The call's arguments are not a JSON object."))
        if not self.gate.allows(PendingCall(tool.server, tool.name, args)):
            return ToolRun(name, arguments, False, ToolOutcome(False, "The user did not allow this call."), denied=True)
        return ToolRun(name, arguments, True, self.host.call(tool.server, tool.name, args))

    def close(self) -> None:
        self.host.close()
