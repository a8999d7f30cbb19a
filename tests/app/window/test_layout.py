"""The window's columns follow its width: narrow, the inspector folds away and the sidebar narrows; made wide
again, both get their room back."""

from __future__ import annotations

from app.window.main_window import SIDEBAR_NARROW, SIDEBAR_WIDE, MainWindow


def test_a_window_made_wide_again_gives_the_sidebar_its_room_back(qtbot, window: MainWindow) -> None:  # type: ignore[no-untyped-def]
    window.show()
    qtbot.waitExposed(window)
    window.resize(900, 700)
    qtbot.waitUntil(lambda: window.splitter.sizes()[0] == SIDEBAR_NARROW)
    assert not window.inspector.isVisible()
    window.resize(1440, 900)
    qtbot.waitUntil(lambda: window.splitter.sizes()[0] == SIDEBAR_WIDE)
    assert window.inspector.isVisible() == window.prefs.inspector_visible()
