"""The tool the tool-calling tests offer: the demo MCP server's `add` (tests/helpers/mcp_demo_server.py), its
integers bounded so a random model's forced call stays short."""

from __future__ import annotations

from engine.tools.calls import Tool

ADD_PARAMETERS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}


def add_tool(name: str = "add") -> Tool:
    """`add` as a session offers it (`demo__add` as the app's toolbox names the demo server's)."""
    return Tool(name, "Add two integers.", ADD_PARAMETERS)
