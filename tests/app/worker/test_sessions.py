"""Session files: save, drop and Finder/Dock FileOpen restore, bad drops, unsaved-changes question, quit."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent, QFileOpenEvent
from PySide6.QtWidgets import QApplication

from app.misc.standarddirs import StandardDirs
from app.window.main_window import MainWindow
from tests.helpers.app_window import WAIT_MS, ScriptedDialogs, dispose, set_reply_tokens


def chat_and_save(qtbot, gui, window: MainWindow, dialogs: ScriptedDialogs, path: Path, text: str) -> str:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.submit(text)
    dialogs.save_to = path
    with qtbot.waitSignal(gui(window.client.saved), timeout=WAIT_MS):
        window.menus.save_action.trigger()  # untitled: asks where (Save As)
    assert path.is_file()
    assert window.state.file == path
    assert window.inspector.session_panel.file.text() == path.name
    return window.chat.reply_text()


def drop(window: MainWindow, *paths: Path) -> None:
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    event = QDropEvent(
        QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    )
    window.dropEvent(event)


def test_dropping_a_session_restores_it(
    qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "talk.spark"
    reply = chat_and_save(qtbot, gui, window, dialogs, path, "Save me")
    window.menus.new_chat_action.trigger()
    assert "Save me" not in window.chat.toPlainText()
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        drop(window, path)
    assert dialogs.asked == ["save"]  # everything is stored: no question
    assert "Save me" in window.chat.toPlainText()
    assert window.chat.reply_text() == reply
    assert window.state.file == path
    assert "restored" in window.inspector.session_panel.when.text()
    # The restored conversation continues.
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        window.submit("Continue")
    assert blocker.args[0].reason in ("stop", "length")


def test_file_open_event_opens_without_asking_and_keeps_the_current_chat(
    qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "finder.spark"
    chat_and_save(qtbot, gui, window, dialogs, path, "From Finder")
    QApplication.instance().connect_file_opens(window.open_file)
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.submit("A later change")
    before_id = window.state.current_id
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        QApplication.sendEvent(QApplication.instance(), QFileOpenEvent(str(path)))
    assert dialogs.asked == ["save"]  # nothing was asked: the current chat is stored
    assert "A later change" not in window.chat.toPlainText()
    assert "From Finder" in window.chat.toPlainText()
    assert window.state.current_id != before_id
    qtbot.waitUntil(
        lambda: window.library.get(window.state.current_id) is not None, timeout=WAIT_MS
    )  # joined the history
    assert "A later change" in window.library.get(before_id).text  # the earlier chat is kept, with the change


def test_bad_drops_leave_the_chat_intact(qtbot, window: MainWindow, gui, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.submit("Precious")
    before = window.chat.toPlainText()
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    folder = tmp_path / "photos"
    folder.mkdir()
    fake = tmp_path / "fake.spark"
    fake.write_bytes(b"not a session file at all")
    for paths in ([notes], [folder], [notes, folder]):
        window.notice.hide()
        drop(window, *paths)
        assert "nothing changed" in window.notice.text()
    with qtbot.waitSignal(gui(window.client.error), timeout=WAIT_MS):
        drop(window, fake)  # a corrupt .spark: the engine says why, the chat stays
    assert window.notice.text()
    assert window.chat.toPlainText() == before
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.submit("Still here")


def test_quitting_while_generating_stops_and_stores(qtbot, window: MainWindow, gui, prefs, dirs: StandardDirs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 400)
    with qtbot.waitSignal(window.coalescer.flushed, timeout=WAIT_MS):
        window.submit("Long reply, then quit")
    assert window.client.busy
    window.shutdown()
    assert window.library.path_for(window.state.current_id).is_file()
    assert not window.client._thread.isRunning()


def test_settings_and_layout_persist(
    qtbot, window: MainWindow, gui, prefs, dialogs: ScriptedDialogs, tiny_model: Path, dirs: StandardDirs
) -> None:  # type: ignore[no-untyped-def]
    from app.wiring import build_main_window
    from engine.generation.loop import GenerationSettings
    from engine.generation.sampling import SamplingSettings

    window.show()
    dialogs.new_settings = GenerationSettings(
        max_tokens=7, sampling=SamplingSettings(temperature=0.3, top_k=5, seed=11)
    )
    window.menus.settings_action.trigger()
    window.menus.inspector_action.trigger()
    inspector_open = window.menus.inspector_action.isChecked()
    window.shutdown()
    again = build_main_window(prefs, dirs, dialogs)
    again.show()
    try:
        assert prefs.generation() == dialogs.new_settings
        assert prefs.last_model() == tiny_model
        assert (
            again.menus.inspector_action.isChecked() is inspector_open and again.inspector.isVisible() is inspector_open
        )
    finally:
        dispose(again)
