"""Streaming into the view, Stop, GUI responsiveness, regenerate, new chat + undo, errors."""

from __future__ import annotations

import threading
from pathlib import Path

from PySide6.QtCore import Qt

from app.misc.gap_meter import GapMeter
from app.window.main_window import MainWindow
from app.worker.types import TurnResult
from tests.helpers.app_window import WAIT_MS, set_reply_tokens

GROSS_STALL_S = 0.25


def send_and_wait(qtbot, gui, window: MainWindow, text: str) -> TurnResult:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        assert window.submit(text)
    return blocker.args[0]


def test_prompt_streams_tokens_into_view(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 120)  # long enough to span several frames even on a fast machine
    shown_while_busy: list[str] = []
    window.coalescer.flushed.connect(
        lambda _t: shown_while_busy.append(window.chat.reply_text()) if window.client.busy else None
    )
    result = send_and_wait(qtbot, gui, window, "Hello there")
    assert result.reason in ("stop", "length")
    assert result.progress.generated_tokens > 0
    assert shown_while_busy, "no text reached the view while the reply was streaming"
    # Every streamed delta is shown, in order, once (the document shows a carriage return as a line break).
    assert window.chat.reply_text() == result.text
    assert "Hello there" in window.chat.toPlainText()
    assert window.library.get(window.state.current_id) is not None  # stored as it changed


def test_return_sends_and_shift_return_adds_a_line(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    qtbot.keyClicks(window.prompt, "first")
    qtbot.keyClick(window.prompt, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(window.prompt, "second")
    assert window.prompt.toPlainText() == "first\nsecond"
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        qtbot.keyClick(window.prompt, Qt.Key.Key_Return)
    assert window.prompt.toPlainText() == ""
    assert "first\nsecond" in window.chat.toPlainText().replace("\u2029", "\n")


def test_stop_takes_effect_within_one_token(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 400)
    after_stop: list[str] = []
    stopped = threading.Event()

    def on_delta(text: str) -> None:  # runs on the worker thread (direct connection): counts exactly
        if stopped.is_set():
            after_stop.append(text)
        elif not after_stop:
            stopped.set()
            window.client.stop()

    window.client.worker.delta.connect(on_delta, Qt.ConnectionType.DirectConnection)
    result = send_and_wait(qtbot, gui, window, "Tell me a long story")
    assert result.reason == "cancelled"
    assert len(after_stop) <= 1, f"{len(after_stop)} tokens were generated after Stop"
    assert result.progress.generated_tokens < 10
    assert window.menus.stop_action.isEnabled() is False
    assert window.send_button.text() == "Send"


def test_stop_from_the_gui_ends_a_long_reply(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 400)
    with qtbot.waitSignal(window.coalescer.flushed, timeout=WAIT_MS):
        window.submit("Go on and on")
    assert window.send_button.text() == "Stop"
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        window.send_button.click()
    assert blocker.args[0].reason == "cancelled"
    assert "Stopped." in window.chat.toPlainText()


def test_gui_thread_is_never_blocked_by_generation(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 200)  # long enough to span many 10 ms ticks even on a fast machine
    meter = GapMeter()
    meter.start()
    send_and_wait(qtbot, gui, window, "Stream for a while")
    longest = meter.stop()
    print(f"longest GUI gap while streaming: {longest * 1000:.1f} ms over {meter.ticks} ticks")
    assert meter.ticks >= 2  # the meter ran while the reply streamed (a frozen GUI thread would also fail below)
    assert longest < GROSS_STALL_S


def test_regenerate_replaces_the_last_reply(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    send_and_wait(qtbot, gui, window, "Once")
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        window.menus.regenerate_action.trigger()
    assert window.chat.toPlainText().count("Spark") == 1
    assert window.chat.reply_text() == blocker.args[0].text


def test_new_chat_can_be_undone_with_memory_and_title(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    send_and_wait(qtbot, gui, window, "Remember me")
    first_id, title = window.state.current_id, window.windowTitle()
    memory = list(window.client.worker.session.memory.tokens)
    window.menus.new_chat_action.trigger()
    assert "Remember me" not in window.chat.toPlainText()
    assert window.menus.undo_action.isEnabled() and window.menus.undo_action.text() == "Undo New Chat"
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.menus.undo_action.trigger()
    assert "Remember me" in window.chat.toPlainText()
    assert window.state.current_id == first_id and window.windowTitle() == title == "Remember me — MLoT Spark"
    assert window.client.worker.session.memory.tokens == memory  # the memory came back too: nothing is re-read
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        assert window.submit("And now?")
    assert blocker.args[0].progress.prompt_tokens < len(memory)  # only the new message (and its frame) was fed


def test_bad_model_folder_shows_a_message_and_keeps_the_chat(qtbot, window: MainWindow, gui, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    send_and_wait(qtbot, gui, window, "Keep this")
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with qtbot.waitSignal(gui(window.client.error), timeout=WAIT_MS):
        window.handle_drop([broken], 1)
    assert window.notice.text()
    assert "Keep this" in window.chat.toPlainText()
    send_and_wait(qtbot, gui, window, "Still works")  # the worker recovered and kept the loaded model


def test_a_message_sent_right_after_new_chat_stays_on_screen(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    send_and_wait(qtbot, gui, window, "Old talk")
    window.menus.new_chat_action.trigger()
    result = send_and_wait(qtbot, gui, window, "Fresh start")  # sent before the worker has even reset
    assert "Fresh start" in window.chat.toPlainText() and "Old talk" not in window.chat.toPlainText()
    assert window.chat.reply_text() == result.text


def test_stop_says_stopping_at_once_and_the_chat_keeps_the_reply_so_far(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 400)
    with qtbot.waitSignal(window.coalescer.flushed, timeout=WAIT_MS):
        window.submit("Tell me a long story")
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        window.stop_reply()
        assert window.send_button.text() == "Stopping…" and not window.send_button.isEnabled()
    assert blocker.args[0].reason == "cancelled"
    assert window.send_button.text() == "Send" and window.send_button.isEnabled()
    assert "Stopped." in window.chat.toPlainText()
