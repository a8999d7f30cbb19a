"""MCP servers in Settings: one a line, read back exactly, a bad line refused in one sentence; kept in the
preferences and handed to the main chat's worker; a consent question from the worker is answered by the window's
dialog ("Allow once / Always for this server / Deny")."""

from __future__ import annotations

import sys

from app.settings.preferences import Preferences
from app.settings.settings_dialog import SettingsDialog
from app.settings.tool_servers import ToolServerError, parse_servers, servers_text
from app.tools.consent import ConsentRequest, Decision, PendingCall
from app.tools.mcp_host import McpServerSpec
from app.window.main_window import MainWindow
from engine import GenerationSettings
from tests.helpers.app_window import ScriptedDialogs

SPECS = [
    McpServerSpec("files", "npx", ("-y", "@modelcontextprotocol/server-filesystem", "/tmp/my notes")),
    McpServerSpec("demo", sys.executable, ("server.py",)),
]


def test_server_lines_read_back_exactly_and_bad_ones_are_one_sentence() -> None:
    assert parse_servers(servers_text(SPECS)) == SPECS
    assert parse_servers("\n  \n") == []
    for bad in ("no colon here", "two words: cmd", "a: 'unclosed", "a:", "a: x\na: y"):
        try:
            parse_servers(bad)
        except ToolServerError as exc:
            assert str(exc).startswith("Line ") and "\n" not in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_settings_dialog_shows_and_checks_the_servers(qtbot) -> None:  # type: ignore[no-untyped-def]
    d = SettingsDialog(GenerationSettings(), tool_servers=SPECS)
    qtbot.addWidget(d)
    assert d.tool_servers() == SPECS
    d.tools.setPlainText("broken line")
    d.accept()
    assert d.result() != SettingsDialog.DialogCode.Accepted and d.error.text().startswith("Line 1")


def test_servers_reach_the_worker_and_the_dialog_answers_consent(  # type: ignore[no-untyped-def]
    qtbot, window: MainWindow, prefs: Preferences, dialogs: ScriptedDialogs
) -> None:
    dialogs.new_settings = prefs.generation()
    dialogs.new_tool_servers = SPECS
    window.menus.settings_action.trigger()
    assert prefs.tool_servers() == SPECS
    qtbot.waitUntil(lambda: window.client.worker._tool_servers == SPECS, timeout=5000)
    dialogs.tool_decisions = [Decision.ALWAYS_FOR_SERVER]
    request = ConsentRequest(PendingCall("demo", "add", {"a": 1, "b": 2}))
    window.client.consent_needed.emit(request)
    assert request.answered.is_set() and request.decision is Decision.ALWAYS_FOR_SERVER
    assert dialogs.asked[-1] == "tool demo add"
