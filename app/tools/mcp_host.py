"""MCP servers as tools: stdio servers (configured as other Mac clients do: a name, a command, its arguments and
environment) started and spoken to through the `mcp` SDK, on an asyncio loop of their own.

`McpHost` is called from the conversation worker's thread (never the GUI thread): every call blocks that thread
for at most its timeout, so a server that hangs, floods or answers junk costs one clear line and the app goes on.
Bounds: starting a server and listing its tools `START_TIMEOUT_S`, one call `CALL_TIMEOUT_S`, a tool's text result
`MAX_RESULT_CHARS` (the rest is cut, and the cut is said), at most `MAX_TOOLS` tools per server. A server's stderr
goes to the null device (a flood there cannot fill a pipe or the app's log).

Nothing here decides whether a call may run: `app.tools.consent` does, before `call` is ever reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from mcp import ClientSession

START_TIMEOUT_S = 20.0
CALL_TIMEOUT_S = 60.0
MAX_RESULT_CHARS = 16_000
MAX_TOOLS = 64

T = TypeVar("T")


@dataclass(frozen=True)
class McpServerSpec:
    """One configured server (Claude Desktop's `mcpServers` entry: command, args, env)."""

    name: str
    command: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class McpTool:
    server: str
    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class ToolOutcome:
    """What a call gave: its text for the transcript, and whether the tool reported success."""

    ok: bool
    text: str


class McpError(Exception):
    """A server could not be started, listed or called; `str()` is one sentence naming the server."""


class _Connection:
    """One running server. Its SDK contexts are entered and left by one task (`serve`), as anyio's cancel scopes
    require: the task opens them, reports the tools, then waits until it is told to stop (or is cancelled)."""

    def __init__(self, spec: McpServerSpec) -> None:
        self.spec = spec
        self.session: ClientSession | None = None
        self.tools: list[McpTool] = []
        self.stopping = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def serve(self, ready: asyncio.Future[None]) -> None:
        # The SDK (and pydantic under it: ~37 MB resident) loads when a server first starts, not with the app.
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        params = StdioServerParameters(command=self.spec.command, args=list(self.spec.args), env=dict(self.spec.env))
        try:
            with open(os.devnull, "w") as devnull:
                async with stdio_client(params, errlog=devnull) as (read, write), ClientSession(read, write) as session:
                    await session.initialize()
                    listed = await session.list_tools()
                    self.tools = [
                        McpTool(self.spec.name, t.name, t.description or "", dict(t.input_schema or {}))
                        for t in listed.tools[:MAX_TOOLS]
                    ]
                    self.session = session
                    ready.set_result(None)
                    await self.stopping.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else McpError("stopped"))
            if not isinstance(exc, Exception):
                raise
        finally:
            self.session = None

    async def open(self) -> None:
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self.serve(ready))
        try:
            await ready
        except asyncio.CancelledError:  # the caller's timeout: the serving task must not outlive it
            self.task.cancel()
            raise

    async def close(self) -> None:
        self.stopping.set()
        if self.task is not None:
            try:
                await asyncio.wait_for(self.task, 5.0)
            except (TimeoutError, asyncio.CancelledError, Exception):
                self.task.cancel()


def _result_text(result: Any) -> str:
    """A CallToolResult's content as text: text parts as they are, structured content as JSON, others named."""
    parts = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(str(getattr(block, "text", "")))
        else:
            parts.append(f"[{kind or 'unknown'} content]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False, default=str))
    text = "\n".join(parts)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"\n[cut: the result was {len(text):,} characters]"
    return text


class McpHost:
    """Runs the configured servers on one asyncio loop in a daemon thread; blocking methods for the worker."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="spark-mcp", daemon=True)
        self._thread.start()
        self._servers: dict[str, _Connection] = {}

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise McpError(f"{what} did not answer within {timeout:g} seconds.") from None

    def start(self, spec: McpServerSpec, timeout: float = START_TIMEOUT_S) -> list[McpTool]:
        """Start `spec`'s server and list its tools; McpError (one sentence) when it cannot."""
        self.stop(spec.name)
        conn = _Connection(spec)
        try:
            self._run(conn.open(), timeout, f"The MCP server '{spec.name}'")
        except McpError:
            self._close_quietly(conn)
            raise
        except Exception as exc:  # the SDK and the OS raise many kinds; each means "this server cannot be used"
            self._close_quietly(conn)
            detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else exc.__class__.__name__
            raise McpError(f"The MCP server '{spec.name}' could not be started: {detail}.") from None
        self._servers[spec.name] = conn
        return list(conn.tools)

    def tools(self) -> list[McpTool]:
        return [t for conn in self._servers.values() for t in conn.tools]

    def call(self, server: str, tool: str, arguments: dict[str, Any], timeout: float = CALL_TIMEOUT_S) -> ToolOutcome:
        """Run one tool; a failure is an outcome (ok=False, one line), never an exception."""
        conn = self._servers.get(server)
        if conn is None or conn.session is None or not any(t.name == tool for t in conn.tools):
            return ToolOutcome(False, f"The tool '{tool}' of MCP server '{server}' is not available.")
        session = conn.session
        try:
            result = self._run(
                session.call_tool(tool, arguments), timeout, f"The tool '{tool}' of MCP server '{server}'"
            )
        except McpError as exc:
            return ToolOutcome(False, str(exc))
        except Exception as exc:  # junk, a closed pipe, a protocol error: one line, the conversation goes on
            detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else exc.__class__.__name__
            return ToolOutcome(False, f"The tool '{tool}' of MCP server '{server}' failed: {detail}.")
        return ToolOutcome(not getattr(result, "is_error", False), _result_text(result))

    def stop(self, name: str) -> None:
        conn = self._servers.pop(name, None)
        if conn is not None:
            self._close_quietly(conn)

    def _close_quietly(self, conn: _Connection) -> None:
        with contextlib.suppress(Exception):
            self._run(conn.close(), 5.0, f"The MCP server '{conn.spec.name}'")

    def close(self) -> None:
        for name in list(self._servers):
            self.stop(name)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()
