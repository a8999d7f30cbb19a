"""MCP servers as tools: stdio servers (configured as other Mac clients do: a name, a command, its arguments and
environment) spoken to in MCP's JSON-RPC over their stdin and stdout, by this module itself.

Every byte a server writes is hostile input, read on threads of the server's own (`os.read` releases the GIL, and
no line is parsed until it is known to be small), so nothing a server does reaches the GUI thread:
- a line longer than `MAX_LINE_BYTES` is skipped to its end unparsed (a 200 MB result fails its call, and the
  session stays in step); bad UTF-8 is replaced, not fatal;
- at start-up, the first line that is not JSON-RPC fails the start at once, quoting the server's own words (a
  banner, a traceback); later, such a line closes the session and the next call starts it again;
- at most `MAX_TOOLS` tools are read, each name, description and schema bounded before it is kept;
- stderr is drained and only its last `MAX_STDERR_BYTES` kept (quoted when the server fails);
- a call that does not answer within its timeout, or a server that exits, closes the session; the next call
  starts the server again.

`McpHost` is called from the conversation worker's thread (never the GUI thread): every call blocks that thread
for at most its timeout. Processes: `app.tools.processes` (a group per server; on Linux nothing it started
survives it). Nothing here decides whether a call may run: `app.tools.consent` does, before `call` is reached.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from app.tools.display import shown
from app.tools.processes import ServerProcess

START_TIMEOUT_S = 20.0
CALL_TIMEOUT_S = 60.0
MAX_RESULT_CHARS = 16_000
MAX_TOOLS = 64
MAX_LINE_BYTES = 4 << 20  # one JSON-RPC message: a tools list of MAX_TOOLS rich schemas is well under this
MAX_SCHEMA_CHARS = 64 * 1024  # one tool's input schema, as JSON
MAX_SCHEMA_DEPTH = 32
MAX_TOOL_NAME = 128  # a raw MCP tool name (the model sees `server__tool`, cut to 64)
MAX_DESCRIPTION = 2000
MAX_STDERR_BYTES = 4096
MAX_PAGES = 8  # tools/list pages
PROTOCOL_VERSION = "2025-06-18"
REPLY_S = 5.0  # answering a server's own request (a ping)
EXIT_WORDS_S = 1.0  # after a server's output ends, how long its exit status and stderr are waited for
# What the chat's markup reads as a block boundary: escaped in a result, so a tool cannot close its own card.
_MARKUP = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


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


class _Broken(Exception):
    """The session cannot go on (the server exited, or wrote something that is not MCP)."""


def _one_line(text: str, limit: int = 200) -> str:
    """A server's own words as a clause: one line, escaped, bounded, no trailing period."""
    flat = " ".join(text.split())
    return shown(flat, limit).rstrip(".")


class _Session:
    """One running server: the process, a reader thread for its stdout and one for its stderr, and the requests
    waiting for their answers."""

    def __init__(self, spec: McpServerSpec) -> None:
        self.spec = spec
        self.process = ServerProcess(spec.command, spec.args, spec.env)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, list[Any]] = {}  # id -> [event, message or _Broken]
        self._broken: _Broken | None = None
        self._stderr = bytearray()
        self._write_lock = threading.Lock()
        assert self.process.popen.stdin is not None
        self._stdin = self.process.popen.stdin.fileno()
        os.set_blocking(self._stdin, False)
        self.tools: list[McpTool] = []
        self.left_out = 0  # listed tools not kept: past MAX_TOOLS, or a name or schema refused
        self._err_reader = threading.Thread(target=self._read_stderr, name=f"mcp-{spec.name[:16]}-err", daemon=True)
        self._err_reader.start()
        threading.Thread(target=self._read_stdout, name=f"mcp-{spec.name[:16]}-out", daemon=True).start()

    # -- reading -------------------------------------------------------------------------------------------------
    def _read_stdout(self) -> None:
        stdout = self.process.popen.stdout
        assert stdout is not None
        fd, buf, skipping = stdout.fileno(), bytearray(), False
        try:
            while True:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                while chunk:
                    end = chunk.find(b"\n")
                    piece, chunk = (chunk, b"") if end < 0 else (chunk[:end], chunk[end + 1 :])
                    if not skipping:
                        buf += piece
                    if len(buf) > MAX_LINE_BYTES and not skipping:
                        skipping, buf = True, bytearray()
                    if end >= 0:
                        if skipping:
                            self._fail_pending(f"sent a message larger than {MAX_LINE_BYTES >> 20} MiB")
                        elif buf.strip():
                            self._line(bytes(buf))
                        buf, skipping = bytearray(), False
        except OSError:
            pass
        # The output ended: the server is exiting. A moment for its status and its last words on stderr.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.popen.wait(EXIT_WORDS_S)
        self._err_reader.join(EXIT_WORDS_S)
        self._break(_Broken(self._exit_words()))

    def _read_stderr(self) -> None:
        stderr = self.process.popen.stderr
        assert stderr is not None
        with contextlib.suppress(OSError):
            while chunk := os.read(stderr.fileno(), 1 << 16):
                self._stderr += chunk
                del self._stderr[:-MAX_STDERR_BYTES]

    def _line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace")
        try:
            message = json.loads(text)
        except (ValueError, RecursionError):
            message = None
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            self._break(_Broken(f"wrote something that is not MCP on its output: '{_one_line(text, 160)}'"))
            return
        if "method" in message:
            if "id" in message:  # a request of the server's: a ping is answered, anything else declined
                reply: dict[str, Any] = {"jsonrpc": "2.0", "id": message["id"]}
                if message["method"] == "ping":
                    reply["result"] = {}
                else:
                    reply["error"] = {"code": -32601, "message": "not supported by this client"}
                with contextlib.suppress(_Broken, TimeoutError):
                    self._send(reply, time.monotonic() + REPLY_S)
            return  # a notification (logging, progress, list changed): nothing to do
        rid = message.get("id")
        with self._lock:
            waiting = self._pending.get(rid) if isinstance(rid, int) else None
        if waiting is not None:
            waiting[1] = message
            waiting[0].set()

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            pending = list(self._pending.values())
        for waiting in pending:
            waiting[1] = McpError(why)
            waiting[0].set()

    def _break(self, broken: _Broken) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = broken
            pending = list(self._pending.values())
        for waiting in pending:
            waiting[1] = self._broken
            waiting[0].set()

    def _exit_words(self) -> str:
        code = self.process.popen.poll()
        said = _one_line(self._stderr.decode("utf-8", errors="replace")[-400:], 200)
        ended = "closed its end of the pipes" if code is None else f"exited (status {code})"
        return f"{ended}{': ' + repr(said) if said else ''}"

    # -- writing -------------------------------------------------------------------------------------------------
    def _send(self, message: dict[str, Any], deadline: float) -> None:
        """Write one message by the deadline: the pipe is non-blocking, so a server that stops reading its input
        costs the caller its timeout, never a thread stuck in `write`."""
        view = memoryview((json.dumps(message, ensure_ascii=False) + "\n").encode())
        if not self._write_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError
        try:
            while view:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [self._stdin], [], left)[1]:
                    raise TimeoutError
                with contextlib.suppress(BlockingIOError):  # select saw room for less than the rest
                    view = view[os.write(self._stdin, view) :]
        except TimeoutError:
            raise
        except (OSError, ValueError):  # a closed pipe (TimeoutError is an OSError too: re-raised above)
            raise _Broken(self._exit_words()) from None
        finally:
            self._write_lock.release()

    def request(self, method: str, params: dict[str, Any], deadline: float) -> dict[str, Any]:
        """The result of one request; McpError (the server's error, a message too large, the deadline), or
        _Broken (the session is over)."""
        rid = next(self._ids)
        waiting: list[Any] = [threading.Event(), None]
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._pending[rid] = waiting
        try:
            self._send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}, deadline)
            if not waiting[0].wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError
        finally:
            with self._lock:
                self._pending.pop(rid, None)
        got = waiting[1]
        if isinstance(got, Exception):
            raise got
        error = got.get("error")
        if error is not None:
            detail = error.get("message") if isinstance(error, dict) else None
            raise McpError(f"answered with an error: {_one_line(str(detail or error))}")
        result = got.get("result")
        return result if isinstance(result, dict) else {}

    def notify(self, method: str, deadline: float) -> None:
        self._send({"jsonrpc": "2.0", "method": method}, deadline)

    def open(self, deadline: float) -> None:
        self.request(
            "initialize",
            {
                "protocolVersion": PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "mlot-spark", "version": "1"},
            },
            deadline,
        )
        self.notify("notifications/initialized", deadline)
        tools: list[McpTool] = []
        cursor: str | None = None
        for _ in range(MAX_PAGES):
            result = self.request("tools/list", {"cursor": cursor} if cursor else {}, deadline)
            listed = result.get("tools")
            listed = listed if isinstance(listed, list) else []
            kept = listed[: MAX_TOOLS - len(tools)]  # cut before anything in them is read
            self.left_out += len(listed) - len(kept)
            for raw in kept:
                tool = _tool(self.spec.name, raw)
                if tool is None:
                    self.left_out += 1
                else:
                    tools.append(tool)
            cursor = result.get("nextCursor") if isinstance(result.get("nextCursor"), str) else None
            if cursor is None or len(tools) >= MAX_TOOLS:
                break
        self.tools = tools

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def close(self) -> None:
        self._break(_Broken("was closed"))
        self.process.close()


def _schema_depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if deepest > MAX_SCHEMA_DEPTH:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _tool(server: str, raw: Any) -> McpTool | None:
    """One listed tool, or None for one that is not usable: a name that is not short printable text, a schema that
    is not a bounded JSON object."""
    if not isinstance(raw, dict):
        return None
    name = raw.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME or shown(name, MAX_TOOL_NAME) != name:
        return None
    schema = raw.get("inputSchema", {"type": "object"})
    if not isinstance(schema, dict) or _schema_depth(schema) > MAX_SCHEMA_DEPTH:
        return None
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        return None
    description = raw.get("description")
    text = description[:MAX_DESCRIPTION] if isinstance(description, str) else ""
    return McpTool(server, name, text, schema)


def _result_text(result: dict[str, Any]) -> str:
    """A tools/call result's content as text: text parts as they are, structured content as JSON, others named;
    bounded, and the chat's block markers escaped."""
    parts = []
    content = result.get("content")
    for block in content if isinstance(content, list) else []:
        kind = block.get("type", "") if isinstance(block, dict) else ""
        if kind == "text":
            parts.append(str(block.get("text", "")))
        else:
            parts.append(f"[{shown(str(kind), 40) or 'unknown'} content]")
    structured = result.get("structuredContent")
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False, default=str))
    text = "\n".join(parts)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"\n[cut: the result was {len(text):,} characters]"
    for tag in _MARKUP:
        text = text.replace(tag, tag.replace("<", "&lt;").replace(">", "&gt;"))
    return text


class McpHost:
    """Runs the configured servers; blocking methods for the worker's thread."""

    def __init__(self) -> None:
        self._servers: dict[str, _Session] = {}
        self._specs: dict[str, McpServerSpec] = {}
        self._lock = threading.Lock()

    def start(self, spec: McpServerSpec, timeout: float = START_TIMEOUT_S) -> list[McpTool]:
        """Start `spec`'s server and list its tools; McpError (one sentence) when it cannot."""
        self.stop(spec.name)
        session = self._open(spec, timeout)
        with self._lock:
            self._servers[spec.name] = session
            self._specs[spec.name] = spec
        return list(session.tools)

    def start_all(self, specs: list[McpServerSpec], timeout: float = START_TIMEOUT_S) -> list[list[McpTool] | McpError]:
        """Start every server at once (a silent one costs its own timeout, not the others'); per spec, its tools or
        the sentence saying why it did not start."""

        def one(spec: McpServerSpec) -> list[McpTool] | McpError:
            try:
                return self.start(spec, timeout)
            except McpError as exc:
                return exc

        if not specs:
            return []
        with ThreadPoolExecutor(max_workers=min(8, len(specs)), thread_name_prefix="mcp-start") as pool:
            return list(pool.map(one, specs))

    def _open(self, spec: McpServerSpec, timeout: float) -> _Session:
        who = f"The MCP server '{shown(spec.name, 64)}'"
        try:
            session = _Session(spec)
        except OSError as exc:
            raise McpError(f"{who} could not be started: {_one_line(exc.strerror or str(exc))}.") from None
        except ValueError as exc:  # a NUL in the command or an argument
            raise McpError(f"{who} could not be started: {_one_line(str(exc))}.") from None
        try:
            session.open(time.monotonic() + timeout)
        except TimeoutError:
            session.close()
            raise McpError(f"{who} did not answer within {timeout:g} seconds.") from None
        except (_Broken, McpError) as exc:
            session.close()
            raise McpError(f"{who} could not be started: it {exc}.") from None
        return session

    def left_out(self, name: str) -> int:
        """How many of the server's listed tools were not kept (past MAX_TOOLS, or a name or schema refused)."""
        with self._lock:
            session = self._servers.get(name)
        return session.left_out if session is not None else 0

    def tools(self) -> list[McpTool]:
        with self._lock:
            return [t for s in self._servers.values() for t in s.tools]

    def call(self, server: str, tool: str, arguments: dict[str, Any], timeout: float = CALL_TIMEOUT_S) -> ToolOutcome:
        """Run one tool; a failure is an outcome (ok=False, one line), never an exception. A session that broke
        (the server exited, or wrote junk) is started again first."""
        who = f"The tool '{shown(tool, 64)}' of MCP server '{shown(server, 64)}'"
        with self._lock:
            session, spec = self._servers.get(server), self._specs.get(server)
        if session is None or spec is None or not any(t.name == tool for t in session.tools):
            return ToolOutcome(False, f"{who} is not available.")
        if session.broken:
            try:
                session = self._restart(spec)
            except McpError as exc:
                return ToolOutcome(False, str(exc))
        try:
            result = session.request("tools/call", {"name": tool, "arguments": arguments}, time.monotonic() + timeout)
        except TimeoutError:
            self._retire(server, session)  # wedged: closed now, started again by the next call
            return ToolOutcome(False, f"{who} did not answer within {timeout:g} seconds.")
        except _Broken as exc:
            self._retire(server, session)
            return ToolOutcome(False, f"{who} failed: the server {exc}.")
        except McpError as exc:
            return ToolOutcome(False, f"{who} failed: it {exc}.")
        return ToolOutcome(result.get("isError") is not True, _result_text(result))

    def _restart(self, spec: McpServerSpec) -> _Session:
        session = self._open(spec, START_TIMEOUT_S)
        with self._lock:
            old = self._servers.get(spec.name)
            self._servers[spec.name] = session
        if old is not None and old is not session:
            old.close()
        return session

    def _retire(self, name: str, session: _Session) -> None:
        session._break(_Broken("was restarted"))
        threading.Thread(target=session.process.close, name="mcp-close", daemon=True).start()

    def stop(self, name: str) -> None:
        with self._lock:
            session = self._servers.pop(name, None)
            self._specs.pop(name, None)
        if session is not None:
            session.close()

    def close(self) -> None:
        """Stop every server at once (each may take its grace period to exit)."""
        with self._lock:
            names = list(self._servers)
        threads = [threading.Thread(target=self.stop, args=(name,), daemon=True) for name in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
