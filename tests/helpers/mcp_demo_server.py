"""A stdio MCP server written with the `mcp` SDK's own server API, for the app's tool tests.

`add` answers, `record` leaves a trace on disk (so a test can see that a denied call never ran), `hang` sleeps
past any timeout, `flood` returns far more text than the app keeps. Run as `python tests/helpers/mcp_demo_server.py`.
"""

from __future__ import annotations

import time
from pathlib import Path

from mcp.server.mcpserver import MCPServer

server = MCPServer("demo")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def record(path: str, text: str) -> str:
    """Append a line to a file."""
    with Path(path).open("a") as f:
        f.write(text + "\n")
    return "recorded"


@server.tool()
def hang(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "woke"


@server.tool()
def flood() -> str:
    """A very long answer."""
    return "x" * 1_000_000


if __name__ == "__main__":
    server.run()
