"""The window's columns follow its width: narrow, the inspector folds away and the sidebar narrows; made wide
again, both get their room back (the inspector its own width, not its minimum)."""

from __future__ import annotations

from PySide6.QtCore import QPoint, QRect, Qt
from PySide6.QtWidgets import QApplication, QToolButton

from app.window.main_window import INSPECTOR_WIDTH, SIDEBAR_NARROW, SIDEBAR_WIDE, MainWindow


def test_a_window_made_wide_again_gives_the_sidebar_its_room_back(qtbot, window: MainWindow) -> None:  # type: ignore[no-untyped-def]
    window.show()
    qtbot.waitExposed(window)
    window.resize(900, 700)
    qtbot.waitUntil(lambda: window.splitter.sizes()[0] == SIDEBAR_NARROW)
    assert not window.inspector.isVisible()
    window.resize(1440, 900)
    qtbot.waitUntil(lambda: window.splitter.sizes()[0] == SIDEBAR_WIDE)
    assert window.inspector.isVisible() == window.prefs.inspector_visible()
    if window.inspector.isVisible():  # back at its own width, not squeezed to its minimum (its text cut off)
        assert window.splitter.sizes()[2] >= max(INSPECTOR_WIDTH, window.inspector.minimumSizeHint().width())


def test_a_notice_never_covers_the_system_field(qtbot, window: MainWindow) -> None:  # type: ignore[no-untyped-def]
    window.show()
    qtbot.waitExposed(window)
    window.notice.show_message("Want stronger answers? " * 8, error=False, stay=True)
    assert window.system_prompt.isVisible() and window.notice.isVisible()
    field, notice = (QRect(w.mapTo(window, QPoint(0, 0)), w.size()) for w in (window.system_prompt, window.notice))
    assert not field.intersects(notice)


def test_keyboard_order_and_names_survive_the_icons(qtbot, window: MainWindow) -> None:  # type: ignore[no-untyped-def]
    window.show()
    qtbot.waitExposed(window)
    window.activateWindow()
    window.prompt.setFocus()
    qtbot.waitUntil(window.prompt.hasFocus)
    qtbot.keyClick(window.prompt, Qt.Key.Key_Tab)  # the prompt, then its Send button
    assert QApplication.focusWidget() is window.send_button
    assert window.send_button.accessibleName() == "Send" and window.prompt.accessibleName() == "Message"
    bar = window.menus.toolbar
    for action in bar.actions():
        widget = bar.widgetForAction(action)
        if isinstance(widget, QToolButton) and action.isVisible():
            assert widget.text() or widget.accessibleName(), action  # icon-only, still named for screen readers
    assert window.menus.model_button.accessibleName() == "Model"
