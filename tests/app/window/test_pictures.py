"""Pictures in the window, as a user meets them, with the tiny random SmolVLM / Idefics3 model: a pasted screenshot,
a dropped file or one picked with the paperclip shows a thumbnail chip; Send takes it to the worker's session with
the message and the reply streams; the user's bubble shows the thumbnail (a click enlarges it), again after a switch
away and back and after a relaunch, where the model still answers about it. A text-only model and a hostile
picture are refused in one sentence on the notice bar.

With SPARK_SHOTS set to a folder, the window is grabbed there at the moments a reader would want to see."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent, QImage

from app.misc.signal_wait import GuiRelay
from app.window import memory_controls
from app.window.chat_view import ChatView
from app.window.main_window import MainWindow
from engine import IMAGE_TOKEN, GenerationSettings, RemoteServer, load_session
from tests.helpers.app_window import (
    WAIT_MS,
    dispose,
    relaunch,
    say,
    set_reply_tokens,
    shot,
    show_window,
    shown_chat_view,
)
from tests.helpers.pictures import picture, png
from tests.helpers.tiny import make_tiny_model

pytest.importorskip("transformers")
SEES_NOT = "cannot see images; load a model that does, such as SmolVLM."


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The window fixture's model, here one that sees images."""
    from tests.helpers.tiny_idefics3 import make_tiny_idefics3

    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("text-model"))


@pytest.fixture
def shown(qtbot, window: MainWindow) -> MainWindow:  # type: ignore[no-untyped-def]
    return show_window(qtbot, window)


def paste_image(window: MainWindow, data: bytes) -> None:
    mime = QMimeData()
    mime.setImageData(QImage.fromData(data))
    window.composer.prompt.insertFromMimeData(mime)


def drop(window: MainWindow, path: Path) -> None:
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    event = QDropEvent(
        QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    )
    assert window.memory_controls.drops.eventFilter(window, event)


def waiting(window: MainWindow) -> list[str]:
    return [c.picture.sha256 for c in window.composer.attachments.pictures]


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` pixels, with no pixels after it."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def test_a_pasted_picture_goes_with_the_message_and_its_thumbnail_stays_in_the_transcript(
    qtbot, shown: MainWindow, gui, prefs
) -> None:  # type: ignore[no-untyped-def]
    window = shown
    set_reply_tokens(prefs, 8)
    data = png(40, 28, seed=1)
    paste_image(window, data)
    (sha,) = waiting(window)
    assert window.composer.attachments.isVisibleTo(window) and window.composer.prompt.toPlainText() == ""
    window.composer.prompt.setPlainText("What is in this picture?")
    shot(window, "picture-pasted-in-composer.png")
    deltas: list[str] = []
    window.client.delta.connect(deltas.append)
    result = say(qtbot, gui, window, "What is in this picture?")
    assert result.reason != "error" and result.progress.generated_tokens == 8 and deltas  # the reply streamed
    session = window.client.worker.session
    assert session is not None and [p.sha256 for p in session.images] == [sha]
    assert session.messages[0].content.count(IMAGE_TOKEN) == 1
    assert waiting(window) == [] and not window.composer.attachments.isVisibleTo(window)  # it went with the message
    assert window.chat.picture_keys() == ["0.0"] and IMAGE_TOKEN not in window.chat.message_text(0)
    entry = window.library.get(window.state.current_id)
    assert entry is not None and entry.title == "What is in this picture?"  # the marker is no word of its title
    shot(window, "picture-answered.png")
    window.chat.open_picture("0.0")
    enlarged = window.chat.picture_window
    assert enlarged is not None and enlarged.isVisible()
    enlarged.close()
    stored = window.library.path_for(window.state.current_id)
    assert [p.sha256 for p in load_session(stored).images] == [sha]  # the conversation's file holds it


def test_a_dropped_picture_and_one_from_the_paperclip_wait_as_chips_and_x_removes_one(
    qtbot, window: MainWindow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    dropped, picked = tmp_path / "dropped.png", tmp_path / "picked.gif"
    dropped.write_bytes(png(30, 20, seed=2))
    Image.open(io.BytesIO(png(24, 24, seed=3))).save(picked, "GIF")  # Qt writes no GIF
    drop(window, dropped)
    monkeypatch.setattr(memory_controls, "choose_documents", lambda _parent, _start: [picked])
    window.composer.attach_button.click()
    chips = window.composer.attachments.pictures
    assert [c.name for c in chips] == ["dropped.png", "picked.gif"]
    assert window.composer.attachments.chip_texts() == []  # pictures are not documents: nothing joins the memory
    chips[0].remove.click()
    assert [c.name for c in window.composer.attachments.pictures] == ["picked.gif"]
    assert "image" not in window.notice.text() and "picture" not in window.notice.text()  # nothing refused


@pytest.mark.parametrize(
    ("name", "data", "words"),
    [
        ("cut.png", png(64, 64, seed=4)[:200], "truncated or damaged"),
        ("huge.png", png_claiming(100_000, 100_000), "huge.png"),
        ("bomb.png", png_claiming(8_000, 8_000), "bomb.png"),  # 64 million pixels behind a 33-byte header
        ("note.png", b"plain text, not a picture", "not a PNG, JPEG, WebP or GIF"),
    ],
)
def test_a_hostile_picture_is_refused_in_the_engines_one_sentence(
    window: MainWindow, tmp_path: Path, name: str, data: bytes, words: str
) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    drop(window, path)
    why = window.notice.text()
    assert words in why and "\n" not in why and why.endswith(".")
    assert waiting(window) == []


def test_a_text_only_model_refuses_a_picture_in_one_sentence(qtbot, shown: MainWindow, text_model: Path) -> None:  # type: ignore[no-untyped-def]
    window = shown
    with qtbot.waitSignal(GuiRelay(window.client.loaded, parent=window).fired, timeout=WAIT_MS):
        window.load_model(text_model, "cpu")
    paste_image(window, png(32, 32, seed=5))
    why = window.notice.text()
    assert why.endswith(SEES_NOT) and "\n" not in why
    assert waiting(window) == [] and not window.composer.attachments.isVisibleTo(window)
    shot(window, "picture-refused-by-text-model.png")


def test_the_thumbnail_comes_back_after_a_switch_and_a_relaunch_and_the_model_still_sees_the_picture(
    qtbot, window: MainWindow, gui, prefs, dirs, dialogs, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 4)
    paste_image(window, png(36, 36, seed=6))
    (sha,) = waiting(window)  # the clipboard's picture as Qt encodes it
    say(qtbot, gui, window, "Describe it.")
    first = window.state.current_id
    window.menus.new_chat_action.trigger()
    qtbot.waitUntil(lambda: window.chat.picture_keys() == [], timeout=WAIT_MS)
    say(qtbot, gui, window, "Something else.")
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_conversation(first)
    qtbot.waitUntil(lambda: window.chat.picture_keys() == ["0.0"], timeout=WAIT_MS)
    window.shutdown()
    again = relaunch(qtbot, prefs, dirs, dialogs, tiny_model, [])
    try:
        qtbot.waitUntil(lambda: again.chat.picture_keys() == ["0.0"], timeout=WAIT_MS)
        session = again.client.worker.session
        assert session is not None and [p.sha256 for p in session.images] == [sha]
        with qtbot.waitSignal(GuiRelay(again.client.finished, parent=again).fired, timeout=WAIT_MS) as blocker:
            assert again.submit("And its colours?")
        assert blocker.args[0].reason != "error" and blocker.args[0].progress.generated_tokens == 4
        assert [p.sha256 for p in session.images] == [sha]  # the same picture, not given again
    finally:
        dispose(again)


def test_a_bubble_shows_its_pictures_without_the_marker_and_a_click_enlarges_one(qtbot) -> None:  # type: ignore[no-untyped-def]
    view: ChatView = shown_chat_view(qtbot)
    view.add_user_message(f"{IMAGE_TOKEN}{IMAGE_TOKEN}Which is brighter?", [png(20, 10, 7), png(10, 20, 8)])
    assert view.picture_keys() == ["0.0", "0.1"]
    assert view.message_text(0) == "Which is brighter?"
    view.open_picture("0.1")
    assert view.picture_window is not None and view.picture_window.isVisible()
    view.picture_window.close()
    view.open_picture("0.7")  # no such picture: nothing opens
    view.open_picture("x.y")


def test_a_branch_keeps_the_pictures_of_the_messages_it_keeps_and_answers_about_them(
    qtbot, window: MainWindow, gui, prefs
) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 4)
    paste_image(window, png(30, 30, seed=9))
    (sha,) = waiting(window)
    say(qtbot, gui, window, "What is this?")
    with qtbot.waitSignal(window.client.finished, timeout=WAIT_MS) as blocker:
        window.chat.branch_requested.emit(1)  # from the reply: the question and its picture are kept
    assert blocker.args[0].reason != "error" and "could not be read" not in window.notice.text()
    assert window.chat.picture_keys() == ["0.0"]
    session = window.client.worker.session
    assert session is not None and [p.sha256 for p in session.images] == [sha]
    result = say(qtbot, gui, window, "And now?")
    assert result.reason != "error" and result.progress.generated_tokens == 4


def test_a_remote_server_refuses_a_picture_in_the_window_and_in_the_worker(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    server = RemoteServer("http://127.0.0.1:9/v1", "tiny")  # never contacted: both refusals come first
    with qtbot.waitSignal(gui(window.client.remote_ready), timeout=WAIT_MS):
        window.client.use_remote(server)
    paste_image(window, png(16, 16, seed=10))
    assert window.notice.text().endswith(
        "cannot see images here; if it can, add the server again with “Sees images” ticked, or load a model that "
        "does, such as SmolVLM."
    )
    assert waiting(window) == []
    with qtbot.waitSignal(gui(window.client.error), timeout=WAIT_MS) as blocker:
        window.client.send("What is this?", GenerationSettings(max_tokens=4), [picture(16, 16, seed=10)])
    assert blocker.args[0].startswith("This server's model cannot see images")


def test_return_sends_a_picture_without_text(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 4)
    paste_image(window, png(20, 20, seed=11))
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        qtbot.keyClick(window.composer.prompt, Qt.Key.Key_Return)
    assert blocker.args[0].reason != "error"
    session = window.client.worker.session
    assert session is not None and session.messages[0].content == IMAGE_TOKEN and len(session.images) == 1
    entry = window.library.get(window.state.current_id)
    assert entry is not None and entry.title == "Picture"
