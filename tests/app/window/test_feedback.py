"""Feedback while a prompt is read (and Stop then), Return while generating, the recalled-memory marker, the
model picker and its precision setting, a cleared system prompt, Help and About, overlay notices."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from PySide6.QtCore import Qt

from app.misc.signal_wait import GuiRelay
from app.window.main_window import MainWindow
from app.wiring import build_main_window
from app.worker.types import ReadProgress
from tests.helpers.app_window import WAIT_MS, ScriptedDialogs, dispose, set_reply_tokens
from tests.helpers.tiny import make_tiny_model

LONG = "Reading a long prompt takes a while, so the reply bubble says how far it got. " * 40


def test_reading_shows_progress_in_the_reply_bubble(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    shown: list[str] = []
    reports: list[ReadProgress] = []
    offered: list[bool] = []
    gui(window.client.reading).connect(
        lambda p: (
            reports.append(p),
            shown.append(window.chat.reply_text()),
            offered.append(window.chat.message_actions_for(window.chat.last_index())),
        )
    )
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.submit(LONG)
    assert reports and reports[0].kind == "prompt" and reports[0].done < reports[0].total
    assert reports[-1].done == reports[-1].total
    assert any(s.startswith("Reading ") and f"of {reports[-1].total:,} tokens" in s for s in shown)
    assert "Reading" not in window.chat.reply_text()  # the reply replaced the progress line
    assert offered and not any(offered)  # no Copy/Branch on a reply that is not written yet
    assert window.chat.message_actions_for(window.chat.last_index())  # ...and they come when it is


def test_stop_during_reading_emits_no_token(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    deltas: list[str] = []
    asked = threading.Event()

    def on_reading(p: ReadProgress) -> None:  # on the worker thread (direct): Stop while the prompt is being read
        if not asked.is_set():
            asked.set()
            window.client.stop()

    window.client.worker.reading.connect(on_reading, Qt.ConnectionType.DirectConnection)
    window.client.worker.delta.connect(deltas.append, Qt.ConnectionType.DirectConnection)
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        window.submit(LONG)
    result = blocker.args[0]
    assert asked.is_set()
    assert result.reason == "cancelled" and result.progress.generated_tokens == 0 and result.text == ""
    assert deltas == []
    assert "Stopped while reading; nothing was written." in window.chat.toPlainText()
    assert window.chat.toPlainText().count("Spark") == 0  # no empty reply bubble is left
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        window.submit("Short one")  # the conversation goes on
    assert blocker.args[0].reason in ("stop", "length")


def test_return_while_generating_says_why_and_keeps_the_text(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 400)
    with qtbot.waitSignal(window.coalescer.flushed, timeout=WAIT_MS):
        window.submit("A long reply please")
    qtbot.keyClicks(window.prompt, "next question")
    qtbot.keyClick(window.prompt, Qt.Key.Key_Return)
    assert window.prompt.toPlainText() == "next question"
    assert "still writing" in window.notice.text() and window.notice.action_button.text() == "Stop"
    over = window.notice.parentWidget().layout()
    assert over is None or over.indexOf(window.notice) == -1  # laid over the chat, not pushing it
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        window.notice.action_button.click()
    assert blocker.args[0].reason == "cancelled"


def test_sending_while_a_conversation_opens_waits_and_says_why(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.submit("First")
    first = window.state.current_id
    window.menus.new_chat_action.trigger()
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.submit("Second")
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_conversation(first)
        assert window.submit("Too early") is False  # its memory is being recomputed: the message is kept
        assert "still opening" in window.notice.text()
    assert window.submit("Now") is True


def test_a_reply_that_used_recalled_memory_says_so(
    qtbot, tmp_path: Path, prefs, dirs, dialogs: ScriptedDialogs
) -> None:  # type: ignore[no-untyped-def]
    small = make_tiny_model(tmp_path / "small-window")
    (small / "cascade.json").write_text(
        json.dumps({"window": 64, "block_size": 16, "retrieval_blocks": 2, "sink_tokens": 4})
    )
    w = build_main_window(prefs, dirs, dialogs)
    try:
        with qtbot.waitSignal(GuiRelay(w.client.loaded, parent=w).fired, timeout=WAIT_MS):
            w.load_model(small, "cpu")
        finished = GuiRelay(w.client.finished, parent=w).fired
        results = []
        for text in (
            "The secret word is marmalade. " * 6,
            "Tell me about the weather.",
            "Then about the sea.",
            "What was the secret word?",
        ):
            with qtbot.waitSignal(finished, timeout=WAIT_MS) as blocker:
                w.submit(text)
            results.append(blocker.args[0])
        recalled = [r for r in results if r.recalled_turns_ago]
        assert recalled, "no reply used recalled memory although the conversation overflowed the 64-token window"
        n = recalled[-1].recalled_turns_ago
        assert f"Recalled from {n} turn" in w.chat.toPlainText()
        assert w.client.worker.session.stats().episodic.hits > 0
    finally:
        dispose(w)


def test_model_picker_lists_recent_models_and_precision_reloads(
    qtbot, window: MainWindow, gui, prefs, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.submit("Keep me across the reload")
    assert prefs.recent_models()[0] == tiny_model
    window.menus.model_menu.aboutToShow.emit()
    texts = [a.text() for a in window.menus.model_menu.actions()]
    assert texts[0].startswith("Default Model") and tiny_model.name in texts
    assert any(a.isChecked() for a in window.menus.model_menu.actions() if a.text() == tiny_model.name)
    none = next(a for a in window.menus.precision_group.actions() if a.data() == "none")
    # Loaded, then carried over to the reloaded model.
    with (
        qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS),
        qtbot.waitSignal(gui(window.client.loaded), timeout=WAIT_MS) as blocker,
    ):
        none.trigger()
        assert window.submit("Too soon") is False  # it is being carried over: the message waits
    assert prefs.precision() == "none"
    assert "q8_0" not in blocker.args[0].info.backend_detail  # the model was reloaded at full precision
    assert "fp32" in window.inspector.performance_panel.backend.text()  # the precision, in the Details
    # The open conversation carried over to the reloaded model: shown, stored, and it goes on.
    assert "Keep me across the reload" in window.chat.toPlainText()
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        assert window.submit("Still here?")
    assert [m.content for m in window.client.worker.session.messages][::2] == [
        "Keep me across the reload",
        "Still here?",
    ]


def test_a_cleared_system_prompt_stays_cleared(qtbot, window: MainWindow, prefs) -> None:  # type: ignore[no-untyped-def]
    window.system_prompt.setText("Be terse.")
    window.system_prompt.editingFinished.emit()
    assert prefs.system_prompt() == "Be terse."
    window.system_prompt.clear()  # the field's clear button: no editingFinished
    assert prefs.system_prompt() == ""
    window.shutdown()
    assert prefs.system_prompt() == ""


def test_help_and_about_and_edit_menu(window: MainWindow, dialogs: ScriptedDialogs) -> None:
    window.menus.help_action.trigger()
    window.menus.about_action.trigger()
    assert dialogs.asked[-2:] == ["help", "about"]
    keys = dict(dialogs.help_keys)
    assert keys["New Chat"] == window.menus.new_chat_action.shortcut().toString(
        window.menus.new_chat_action.shortcut().SequenceFormat.NativeText
    )
    menus = {
        m.title().replace("&", ""): [a.text() for a in m.actions()]
        for m in (a.menu() for a in window.menuBar().actions())
        if m
    }
    assert {"Copy", "Select All"} <= set(menus["Edit"])
    assert "MLoT Spark Help" in menus["Help"] and "About MLoT Spark" in menus["Help"]
