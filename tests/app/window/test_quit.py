"""Quit while a reply streams: the reply so far is stored with the conversation's title, its model and a note that
it was cut off, and the next launch shows all three."""

from __future__ import annotations

from pathlib import Path

from app.history.library import CUT_OFF_NOTE, ConversationLibrary
from app.window.main_window import MainWindow
from app.wiring import build_main_window
from engine import load_session
from tests.helpers.app_window import WAIT_MS, dispose, set_reply_tokens


def test_quit_while_streaming_stores_the_partial_reply_with_its_title(
    qtbot, window: MainWindow, prefs, dirs, dialogs, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 4000)
    with qtbot.waitSignal(window.coalescer.flushed, timeout=WAIT_MS):
        assert window.submit("Write a long poem about the sea")
    cid = window.state.current_id
    assert window.shutdown()  # what Quit does (the app's quit path calls it with a short wait)

    library = ConversationLibrary(dirs.conversations)
    library.load()
    entry = library.get(cid)
    assert entry is not None and entry.title == "Write a long poem about the sea"
    assert entry.model == tiny_model.name
    messages = load_session(library.path_for(cid)).messages
    assert [m.role for m in messages] == ["user", "assistant"] and messages[1].content  # the reply so far
    assert dict(entry.notes) == {1: CUT_OFF_NOTE}

    again = build_main_window(prefs, dirs, dialogs)
    try:
        with qtbot.waitSignal(again.client.restored, timeout=WAIT_MS):
            again.load_model(tiny_model, "cpu")
        assert again.state.current_id == cid and again.title() == "Write a long poem about the sea"
        assert CUT_OFF_NOTE in again.chat.toPlainText()
    finally:
        dispose(again)
