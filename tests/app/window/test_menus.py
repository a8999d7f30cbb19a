"""Keyboard shortcuts reach their actions (Ctrl is ⌘ on macOS); the Model menu lists a model once; View ▸
Appearance chooses light, dark or the system's."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QKeySequence, QPalette
from PySide6.QtWidgets import QApplication

from app.application import SparkApplication
from app.misc import theme
from app.window.main_window import MainWindow
from tests.helpers.app_window import WAIT_MS, ScriptedDialogs

CTRL = Qt.KeyboardModifier.ControlModifier
SHIFT = Qt.KeyboardModifier.ShiftModifier


@pytest.fixture
def shown(qtbot, window: MainWindow) -> MainWindow:  # type: ignore[no-untyped-def]
    window.show()
    qtbot.waitExposed(window)
    window.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is window)
    return window


@pytest.mark.parametrize(
    ("key", "mods", "action"),
    [
        (Qt.Key.Key_N, CTRL, "new_chat_action"),
        (Qt.Key.Key_O, CTRL, "open_action"),
        (Qt.Key.Key_S, CTRL, "save_action"),
        (Qt.Key.Key_S, CTRL | SHIFT, "save_full_action"),
        (Qt.Key.Key_F, CTRL, "find_action"),
        (Qt.Key.Key_I, CTRL, "inspector_action"),
        (Qt.Key.Key_Backspace, CTRL, "delete_action"),
        (Qt.Key.Key_Period, CTRL, "stop_action"),
        (Qt.Key.Key_Comma, CTRL, "settings_action"),
        (Qt.Key.Key_R, CTRL, "regenerate_action"),
        (Qt.Key.Key_K, CTRL | SHIFT, "quick_action"),
        (Qt.Key.Key_W, CTRL, "close_action"),
        (Qt.Key.Key_Q, CTRL, "quit_action"),
    ],
)
def test_shortcut_triggers_its_action(
    qtbot, shown: MainWindow, key: Qt.Key, mods: Qt.KeyboardModifier, action: str
) -> None:  # type: ignore[no-untyped-def]
    target = getattr(shown.menus, action)
    target.setEnabled(True)
    target.triggered.disconnect()  # count the trigger only: quitting or closing would end the test's window
    hits: list[bool] = []
    target.triggered.connect(lambda *_: hits.append(True))
    assert QKeySequence(key.value | mods.value) in target.shortcuts()
    qtbot.keyClick(shown.chat, key, mods)
    assert hits == [True]


def test_settings_shortcut_opens_the_settings(qtbot, shown: MainWindow, dialogs: ScriptedDialogs) -> None:  # type: ignore[no-untyped-def]
    qtbot.keyClick(shown.chat, Qt.Key.Key_Comma, CTRL)
    assert dialogs.asked == ["settings"]


def test_tooltips_name_this_platforms_keys(window: MainWindow) -> None:
    import sys

    expected = "⌘N" if sys.platform == "darwin" else "Ctrl+N"
    assert window.menus.new_chat_action.toolTip() == f"Start a new conversation ({expected})"
    assert "⌘" not in window.menus.stop_action.toolTip() or sys.platform == "darwin"


def test_number_shortcuts_switch_conversations(qtbot, shown: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    from tests.helpers.app_window import WAIT_MS

    for text in ("First talk", "Second talk"):
        with qtbot.waitSignal(gui(shown.client.finished), timeout=WAIT_MS):
            shown.submit(text)
        shown.menus.new_chat_action.trigger()
    assert [shown.library.get(i).title for i in shown.sidebar.ids()] == ["Second talk", "First talk"]  # newest first
    assert QKeySequence("Ctrl+2") in shown.menus.switch_actions[1].shortcuts()
    with qtbot.waitSignal(gui(shown.client.restored), timeout=WAIT_MS):
        qtbot.keyClick(shown.chat, Qt.Key.Key_2, CTRL)
    assert "First talk" in shown.chat.toPlainText() and "Second talk" not in shown.chat.toPlainText()


def test_window_menu_lists_conversations_by_title_and_esc_clears_search(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    for text in ("Plan a trip to Lisbon", "Bake sourdough bread"):
        window.menus.new_chat_action.trigger()
        with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
            window.submit(text)
    window.menus.window_menu.aboutToShow.emit()
    texts = [a.text() for a in window.menus.window_menu.actions()]
    assert texts[:2] == ["Minimize", "Zoom"]
    assert "Bake sourdough bread" in texts and "Plan a trip to Lisbon" in texts
    assert not any(t.startswith("Conversation ") for t in texts)  # titled, not numbered
    window.sidebar.search.setText("lisbon")
    qtbot.keyClick(window.sidebar.search, Qt.Key.Key_Escape)
    assert window.sidebar.search.text() == ""
    # Edit has the text commands, and the conversation's own Undo apart from them.
    edit = [a.text() for a in window.menus.edit_menu.actions() if a.text()]
    assert edit[:6] == ["Undo", "Redo", "Cut", "Copy", "Paste", "Select All"]


def test_a_downloaded_model_used_recently_is_listed_once(window: MainWindow, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "SmolLM2-135M-Instruct-Q8_0.gguf"
    window.menus._downloaded = lambda: [("SmolLM2 135M Instruct Q8_0", path)]
    window.prefs.set_last_model(path)  # recent too
    window.state.model_path = path
    window.menus._fill_model_menu()
    listed = [a for a in window.menus.model_menu.actions() if a.toolTip() == str(path)]
    assert len(listed) == 1 and listed[0].isChecked()


def test_appearance_light_dark_or_the_systems(qtbot, window: MainWindow, prefs) -> None:  # type: ignore[no-untyped-def]
    app = QApplication.instance()
    assert isinstance(app, SparkApplication) and prefs.appearance() == "system"
    try:
        window.menus.appearance_actions["dark"].trigger()
        assert prefs.appearance() == "dark" and app.scheme is theme.Scheme.DARK
        assert app.palette().color(QPalette.ColorRole.Base).name() == theme.DARK.base
        window.menus.appearance_actions["light"].trigger()
        assert (
            app.scheme is theme.Scheme.LIGHT and app.palette().color(QPalette.ColorRole.Base).name() == theme.LIGHT.base
        )
    finally:
        window.menus.appearance_actions["system"].trigger()
    assert prefs.appearance() == "system" and app.scheme is theme.system_scheme()
    assert "Appearance" in [a.text() for a in window.menus.view_menu.actions()]
