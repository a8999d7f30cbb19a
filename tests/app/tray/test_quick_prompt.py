"""The quick prompt answers from its own session, even while the main chat is generating."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication

from app.window.main_window import MainWindow
from tests.helpers.app_window import WAIT_MS, set_reply_tokens


def test_quick_prompt_answers_while_the_main_chat_generates(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 400)
    with qtbot.waitSignal(window.coalescer.flushed, timeout=WAIT_MS):
        window.submit("A long main reply")
    window.menus.quick_action.trigger()
    panel = window.quick_panel
    assert panel.isVisible()
    set_reply_tokens(prefs, 10)
    qtbot.keyClicks(panel.question, "Quick one?")
    with qtbot.waitSignal(gui(window.quick_client.finished), timeout=WAIT_MS) as blocker:
        qtbot.keyClick(panel.question, Qt.Key.Key_Return)
    assert window.client.busy, "the main chat should still be generating"
    assert blocker.args[0].progress.generated_tokens > 0
    assert panel.answer_text() == blocker.args[0].text.replace("\r", "\n")
    assert "Quick one?" not in window.chat.toPlainText()
    panel.copy_button.click()
    assert QGuiApplication.clipboard().text() == panel.answer_text()
    qtbot.keyClick(panel, Qt.Key.Key_Escape)
    assert not panel.isVisible()
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as main_done:
        window.menus.stop_action.trigger()
    assert main_done.args[0].reason == "cancelled"
    assert "Quick one?" not in window.chat.toPlainText()
