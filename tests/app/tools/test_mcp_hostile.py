"""MCP tool servers that misbehave (tests/helpers/mcp_hostile_server.py): a banner fails the start at once in the
server's own words; 100,000 tools neither stall the GUI thread nor pass the cap; a server that exits mid-call or
writes junk is started again for the next call; a result that is huge, not UTF-8 or holds the chat's markup is
bounded and escaped; hostile tool names are escaped in the consent question and the cards, and cannot shadow
another server's tool; nothing a server started — a child in its group, a `setsid` daemon — outlives it."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.misc.gap_meter import GapMeter
from app.tools.consent import ConsentGate, Decision, PendingCall
from app.tools.mcp_host import MAX_TOOLS, McpError, McpHost, McpServerSpec, McpTool
from app.tools.toolbox import Toolbox
from app.window.markdown import Palette
from app.window.tool_cards import Card, card_html, segments
from app.worker.tool_turns import ToolStatus, response_block
from tests.helpers.fuzz import fuzz_examples
from tests.helpers.threads import on_worker

HOSTILE = str(Path(__file__).resolve().parents[2] / "helpers" / "mcp_hostile_server.py")
GUI_STALL_S = 0.1  # the GUI heartbeat's longest gap the brief allows while a server is started


def spec(name: str, *args: str) -> McpServerSpec:
    return McpServerSpec(name, sys.executable, (HOSTILE, *args))


@pytest.fixture
def host() -> Iterator[McpHost]:
    h = McpHost()
    yield h
    h.close()


def test_a_banner_fails_the_start_at_once_quoting_it(host: McpHost) -> None:
    problems = on_worker(
        lambda: Toolbox(host, ConsentGate(lambda c: Decision.DENY)).start_servers([spec("chatty", "banner")])
    )
    assert len(problems) == 1 and "\n" not in problems[0]
    assert "not MCP" in problems[0] and "Hostile server v1.0 starting" in problems[0]


def test_servers_start_in_parallel(host: McpHost, tmp_path: Path) -> None:
    """Three servers that each stay silent until all three have started: one after another, the first would wait
    out its timeout; together, all three start."""
    specs = [McpServerSpec(f"b{i}", sys.executable, (HOSTILE, "barrier", str(tmp_path), "3")) for i in range(3)]
    started = on_worker(lambda: host.start_all(specs, timeout=20))
    assert all(isinstance(tools, list) and [t.name for t in tools] == ["echo"] for tools in started), started


def test_a_server_that_dies_at_start_is_quoted_and_a_stderr_flood_is_drained(host: McpHost) -> None:
    box = Toolbox(host, ConsentGate(lambda c: Decision.DENY))
    problems = on_worker(lambda: box.start_servers([spec("dies", "die"), spec("loud", "stderr")]))
    assert len(problems) == 1 and "\n" not in problems[0]
    assert "exited (status 1)" in problems[0] and "No module named 'mcp_tools_x'" in problems[0]
    assert [t["function"]["name"] for t in box.openai_tools()] == ["loud__echo"]  # 16 MB of stderr did not block it


def test_a_hundred_thousand_tools_and_a_huge_result_do_not_stall_the_gui_thread(qtbot, host: McpHost) -> None:  # type: ignore[no-untyped-def]
    box = Toolbox(host, ConsentGate(lambda c: Decision.ALLOW_ONCE))
    done: list[tuple[list[str], str]] = []

    def work() -> None:
        problems = box.start_servers([spec("many", "many", "100000"), spec("big", "ok")])
        done.append((problems, box.run("big__echo", '{"mode": "huge"}').outcome.text))

    meter = GapMeter()
    meter.start()
    worker = threading.Thread(target=work)
    worker.start()
    qtbot.waitUntil(lambda: bool(done), timeout=60_000)
    longest = meter.stop()
    worker.join()
    print(f"longest GUI gap while a 100k-tool server started and a 32 MB result came: {longest * 1000:.1f} ms")
    assert meter.ticks >= 2
    assert longest < GUI_STALL_S
    problems, huge = done[0]
    assert len(box.openai_tools()) <= MAX_TOOLS and all("\n" not in p for p in problems)
    assert "larger than" in huge and "\n" not in huge


def test_a_list_under_the_size_cap_is_cut_to_max_tools(host: McpHost) -> None:
    tools = on_worker(lambda: host.start(spec("some", "many", "5000")))
    assert len(tools) == MAX_TOOLS


def test_a_server_that_exits_mid_call_is_one_line_and_restarted(host: McpHost) -> None:
    on_worker(lambda: host.start(spec("crashy", "exit")))
    first = on_worker(lambda: host.call("crashy", "echo", {"text": "hi"}))
    assert not first.ok and "\n" not in first.text and "exited" in first.text and "boom" in first.text
    second = on_worker(lambda: host.call("crashy", "echo", {"text": "hi"}))  # started again, then crashes again
    assert not second.ok and "exited" in second.text


@pytest.mark.parametrize("mode", ["garbage", "huge"])
def test_a_wedged_or_flooded_session_fails_its_call_and_the_next_call_works(host: McpHost, mode: str) -> None:
    on_worker(lambda: host.start(spec("wedge", "ok")))
    bad = on_worker(lambda: host.call("wedge", "echo", {"mode": mode}, timeout=30))
    assert not bad.ok and "\n" not in bad.text and len(bad.text) < 400
    good = on_worker(lambda: host.call("wedge", "echo", {"text": "still here"}, timeout=30))
    assert good.ok and good.text == "still here"


def test_a_server_that_stops_reading_costs_the_call_its_timeout(host: McpHost) -> None:
    on_worker(lambda: host.start(spec("deaf", "deaf")))
    stuck = on_worker(lambda: host.call("deaf", "echo", {"text": "z" * (4 << 20)}, timeout=2))
    assert not stuck.ok and "did not answer within 2 seconds" in stuck.text


def test_invalid_utf8_and_markup_in_a_result_are_escaped(host: McpHost) -> None:
    on_worker(lambda: host.start(spec("odd", "ok")))
    bad = on_worker(lambda: host.call("odd", "echo", {"mode": "badutf8"}))
    assert bad.ok and "\ufffd" in bad.text
    marked = on_worker(lambda: host.call("odd", "echo", {"mode": "markup"}))
    assert marked.ok and "</tool_response>" not in marked.text and "<tool_call>" not in marked.text
    content = json.dumps({"name": "odd__echo", "status": "ok", "content": marked.text})
    reply = '<tool_call>\n{"name": "odd__echo", "arguments": {}}\n</tool_call>' + response_block(content)
    cards = [s for s in segments(reply) if isinstance(s, Card)]
    assert len(cards) == 1 and cards[0].status is ToolStatus.OK  # the card is answered, not left waiting


def test_hostile_tool_names_are_left_out_or_escaped(host: McpHost) -> None:
    box = Toolbox(host, ConsentGate(lambda c: Decision.DENY))
    problems = on_worker(lambda: box.start_servers([spec("names", "names")]))
    # names with controls, bidi or 10k characters are not offered, and the user is told so in one line
    assert [t["function"]["name"] for t in box.openai_tools()] == ["names__echo"]
    assert len(problems) == 1 and "lists 4 tools that were left out" in problems[0] and "\n" not in problems[0]
    question = PendingCall(
        "srv\u202eexe", "read\n\n(really: delete_all_files)" + "x" * 10_000, {"k": "\x1b[2J\u202e"}
    ).summary()
    assert "\n" not in question and "\u202e" not in question and "\x1b" not in question and len(question) < 800
    arguments = json.dumps({"path": "evil\u202etxt.exe"}, indent=2, ensure_ascii=False)
    html = card_html(
        Card("bell\x1b[2J\x07" + "n" * 10_000, arguments, ToolStatus.OK, "r\u202e"),
        Palette("#1d1d1f", "#6e6e73", "#0a66d9", "#f5f5f7", "#d2d2d7", False),
    )
    assert "\x1b" not in html and "\x07" not in html and "\u202e" not in html and len(html) < 3000


def test_a_tool_cannot_shadow_another_servers(host: McpHost) -> None:
    box = Toolbox(host, ConsentGate(lambda c: Decision.DENY))
    problems = on_worker(lambda: box.start_servers([spec("my_files", "ok"), spec("my.files", "ok")]))
    assert len(problems) == 1 and "left out" in problems[0] and "my_files__echo" in problems[0]
    assert [t["function"]["name"] for t in box.openai_tools()] == ["my_files__echo"]
    assert box._tools["my_files__echo"].server == "my_files"  # the first in the list keeps its name


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the subreaper and /proc are Linux's")
def test_nothing_a_server_started_outlives_it(host: McpHost, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    on_worker(lambda: host.start(spec("forky", "fork", str(pidfile))))
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text().endswith("\n"):
            break
        time.sleep(0.05)
    child, daemon = (int(p) for p in pidfile.read_text().split())
    assert _running(child) and _running(daemon)
    assert os.getsid(daemon) != os.getsid(child)  # the daemon left the server's session and group
    on_worker(lambda: host.stop("forky"))
    assert not _running(child) and not _running(daemon)
    assert not Path(f"/proc/{daemon}").exists() or not _running(daemon)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's environment from /proc")
def test_a_server_inherits_only_the_safe_part_of_the_environment(
    host: McpHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret_marker")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    on_worker(lambda: host.start(McpServerSpec("envy", sys.executable, (HOSTILE, "ok"), {"MINE": "given"})))
    session = host._servers["envy"]
    environ = Path(f"/proc/{session.process.pid}/environ").read_bytes().split(b"\0")
    assert b"MINE=given" in environ and not any(b"secret" in e for e in environ)


RPC_LINES = st.lists(
    st.binary(max_size=80)
    | st.sampled_from(
        [
            b'{"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info"}}',
            b'{"jsonrpc": "2.0", "id": 99, "method": "ping"}',
            b'{"jsonrpc": "2.0", "id": 1, "result": 7}',
            b'{"jsonrpc": "2.0", "id": 1, "error": {"message": "no\\n\\u001b[2J"}}',
            b'{"jsonrpc": "1.0"}',
            b"[" * 5000,
            b'{"jsonrpc": "2.0", "id": "1"}',
        ]
    ),
    max_size=4,
)


@settings(
    max_examples=fuzz_examples(25),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(lines=RPC_LINES)
def test_fuzz_what_a_server_writes_at_start(host: McpHost, tmp_path: Path, lines: list[bytes]) -> None:
    """Whatever a server writes before its first answer, the start gives tools or one sentence, and no thread or
    process is left waiting on it."""
    script = tmp_path / "lines.bin"
    script.write_bytes(b"\n".join(lines) + b"\n")

    def start() -> list[McpTool] | McpError:
        try:
            return host.start(spec("fuzz", "lines", str(script)), timeout=10)
        except McpError as exc:
            return exc

    started = on_worker(start)
    if isinstance(started, McpError):
        assert "\n" not in str(started) and str(started).endswith(".")
    else:
        assert [t.name for t in started] == ["echo"]
    host.stop("fuzz")
