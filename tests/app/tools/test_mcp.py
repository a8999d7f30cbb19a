"""MCP servers as tools, driven from a worker thread as the conversation worker drives them, with the user's
decision injected: nothing runs without consent ("Allow once" asks again, "Always for this server" does not,
"Deny" runs nothing); a server that hangs, floods or is not a server costs one clear line and nothing else."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from app.tools.consent import ConsentGate, Decision, PendingCall
from app.tools.mcp_host import McpHost, McpServerSpec
from app.tools.toolbox import Toolbox
from tests.helpers.threads import on_worker

SERVER = str(Path(__file__).resolve().parents[2] / "helpers" / "mcp_demo_server.py")
DEMO = McpServerSpec("demo", sys.executable, (SERVER,))
T = TypeVar("T")


class Answers:
    def __init__(self, *decisions: Decision) -> None:
        self.decisions = list(decisions)
        self.asked: list[PendingCall] = []

    def __call__(self, call: PendingCall) -> Decision:
        self.asked.append(call)
        return self.decisions.pop(0)


@pytest.fixture
def host() -> Iterator[McpHost]:
    h = McpHost()
    yield h
    h.close()


def test_calls_run_only_with_consent(host: McpHost, tmp_path: Path) -> None:
    answers = Answers(Decision.DENY, Decision.ALLOW_ONCE, Decision.ALWAYS_FOR_SERVER)
    box = Toolbox(host, ConsentGate(answers))
    assert on_worker(lambda: box.start_servers([DEMO])) == []
    names = [t["function"]["name"] for t in box.openai_tools()]
    assert {"demo__add", "demo__record", "demo__hang", "demo__flood"} <= set(names)
    trace = tmp_path / "trace.txt"
    args = json.dumps({"path": str(trace), "text": "ran"})

    denied = on_worker(lambda: box.run("demo__record", args))
    assert not denied.allowed and "did not allow" in denied.outcome.text and not trace.exists()
    assert answers.asked[-1] == PendingCall("demo", "record", {"path": str(trace), "text": "ran"})

    once = on_worker(lambda: box.run("demo__add", '{"a": 2, "b": 40}'))
    assert once.allowed and once.outcome.ok and once.outcome.text == "42"

    always = on_worker(lambda: box.run("demo__record", args))
    assert always.allowed and trace.read_text() == "ran\n"
    again = on_worker(lambda: box.run("demo__record", args))  # not asked again
    assert again.allowed and len(answers.asked) == 3 and trace.read_text() == "ran\nran\n"


def test_hostile_servers_cost_one_line(host: McpHost) -> None:
    box = Toolbox(host, ConsentGate(lambda call: Decision.ALLOW_ONCE))
    problems = on_worker(
        lambda: box.start_servers(
            [
                DEMO,
                McpServerSpec("silent", sys.executable, ("-c", "import time; time.sleep(600)")),
                McpServerSpec("junk", sys.executable, ("-c", "print('x' * 100000); import time; time.sleep(600)")),
                McpServerSpec("missing", str(Path("/nonexistent/server"))),
            ]
        )
    )
    assert len(problems) == 3 and all("\n" not in p for p in problems)
    assert "'silent' did not answer within" in problems[0] and "'junk'" in problems[1]
    assert "'missing' could not be started" in problems[2]
    hung = on_worker(lambda: host.call("demo", "hang", {"seconds": 600}, timeout=2))
    assert not hung.ok and hung.text == "The tool 'hang' of MCP server 'demo' did not answer within 2 seconds."
    flood = on_worker(lambda: box.run("demo__flood", "{}"))
    assert flood.outcome.ok and len(flood.outcome.text) < 20_000 and "[cut: the result was" in flood.outcome.text
    assert on_worker(lambda: box.run("demo__add", "[1]")).outcome.text == "The call's arguments are not a JSON object."
    assert on_worker(lambda: box.run("demo__add", '{"a": 1, "b": 2}')).outcome.text == "3"  # still serving
