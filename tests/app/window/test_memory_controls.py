"""Documents and earlier conversations as memory in the window, as a user meets them: a file attached by the
paperclip's dialog, a drop or a pasted path shows a chip with its size in tokens; a refused file says why in one
sentence; "Recall in Current Conversation" on a past conversation joins it; a reply's citations open their passage;
the inspector says it all in words; a relaunch attaches the conversation's documents again, reading nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent

from app.inspector.inspector import NOTHING_ATTACHED, attached_words
from app.window import memory_controls
from app.window.chat_view import ChatView
from app.window.composer import Composer
from app.window.main_window import MainWindow
from app.window.passage import PassageDialog
from app.worker.types import AttachKind, AttachmentView, CitationView, MemoryReport
from engine import load_session
from tests.helpers.app_window import WAIT_MS, ScriptedDialogs, dispose, relaunch, say, set_reply_tokens

NOTES = "".join(f"Line {i}: the meeting about the garden moved to room {i % 7}.\n" for i in range(1, 40))
CITED = CitationView("notes.md", None, 3, 5, "the meeting about the garden moved to room 3", "notes.md, l. 3-5")


def _attached_report(qtbot, window: MainWindow, act, path: Path) -> MemoryReport:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(
        window.client.memory, timeout=WAIT_MS, check_params_cb=lambda r: any(v.path == path for v in r.attachments)
    ) as blocker:
        act()
    report: MemoryReport = blocker.args[0]
    return report


def _chips(window: MainWindow) -> list[str]:
    return window.composer.attachments.chip_texts()


def test_the_paperclip_attaches_a_document_and_its_chip_and_the_inspector_show_its_tokens(
    qtbot, window: MainWindow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    doc = tmp_path / "notes.md"
    doc.write_text(NOTES, encoding="utf-8")
    monkeypatch.setattr(memory_controls, "choose_documents", lambda _parent, _start: [doc])
    report = _attached_report(qtbot, window, window.composer.attach_button.click, doc)
    (view,) = report.attachments
    assert _chips(window) == [f"notes.md · {view.tokens:,} tokens"]
    assert window.composer.attachments.isVisibleTo(window)
    words = window.inspector.attached.body.text()
    assert words.startswith(f"notes.md: {view.tokens:,} tokens, ") and "on disk (read just now)." in words
    with qtbot.waitSignal(window.client.memory, timeout=WAIT_MS) as blocker:
        window.composer.attachments.chips[doc].remove.click()  # ✕: out of the memory
    assert blocker.args[0].attachments == () and _chips(window) == []
    assert window.inspector.attached.body.text() == NOTHING_ATTACHED
    assert not window.composer.attachments.isVisibleTo(window)


def test_a_dropped_file_and_a_pasted_path_attach_and_ordinary_text_still_pastes(
    qtbot, window: MainWindow, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    dropped, pasted = tmp_path / "dropped.txt", tmp_path / "pasted.py"
    dropped.write_text(NOTES, encoding="utf-8")
    pasted.write_text("def garden():\n    return 'room 3'\n", encoding="utf-8")
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(dropped))])
    drop = QDropEvent(
        QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    )
    filter_ = window.memory_controls.drops  # the window's event filter: it sees a drop before the window does
    _attached_report(qtbot, window, lambda: filter_.eventFilter(window, drop), dropped)
    conversation = QMimeData()
    conversation.setUrls([QUrl.fromLocalFile(str(tmp_path / "talk.spark"))])
    (tmp_path / "talk.spark").write_bytes(b"")
    other = QDropEvent(
        QPointF(10, 10),
        Qt.DropAction.CopyAction,
        conversation,
        Qt.MouseButton.LeftButton,
        Qt.KeyboardModifier.NoModifier,
    )
    assert not filter_.eventFilter(window, other)  # a conversation (or a model) is the window's to open
    text = QMimeData()
    text.setText(f"  '{pasted}'\n")
    report = _attached_report(qtbot, window, lambda: window.prompt.insertFromMimeData(text), pasted)
    assert [v.name for v in report.attachments] == ["dropped.txt", "pasted.py"]
    assert window.prompt.toPlainText() == ""  # attached, not typed
    plain = QMimeData()
    plain.setText(f"{pasted} is where the code lives")
    window.prompt.insertFromMimeData(plain)
    assert window.prompt.toPlainText() == f"{pasted} is where the code lives"


def test_a_hostile_file_is_refused_in_one_sentence_and_its_chip_goes(qtbot, window: MainWindow, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bomb = tmp_path / "locked.pdf"
    bomb.write_bytes(b"%PDF-1.4\n" + b"\x00\xff" * 2000)
    with qtbot.waitSignal(window.client.attach_failed, timeout=WAIT_MS) as blocker:
        window.composer.attachments.request([bomb])
        assert _chips(window) == ["locked.pdf · reading…"]  # at once, while the worker reads
    why = blocker.args[1]
    assert "locked.pdf" in why and window.notice.text() == why and "\n" not in why
    assert _chips(window) == []


def test_recall_from_the_sidebar_joins_a_past_conversation_under_its_title(
    qtbot, window: MainWindow, gui, prefs
) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 6)
    say(qtbot, gui, window, "We decided to paint the fence blue.")
    earlier = window.state.current_id
    title = window.library.get(earlier).title
    assert not next(
        a for a in window.sidebar.context_menu(earlier).actions() if a.text() == "Recall in Current Conversation"
    ).isEnabled()  # a conversation is already its own memory
    window.menus.new_chat_action.trigger()
    say(qtbot, gui, window, "What colour was the fence?")
    recall = next(
        a for a in window.sidebar.context_menu(earlier).actions() if a.text() == "Recall in Current Conversation"
    )
    report = _attached_report(qtbot, window, recall.trigger, window.library.path_for(earlier))
    (view,) = report.attachments
    assert view.kind == AttachKind.CONVERSATION and view.shown == title
    assert _chips(window) == [f"{title} · {view.tokens:,} tokens"]
    assert window.inspector.attached.body.text().startswith(f"Earlier conversation “{title}”: {view.tokens:,} tokens")
    assert window.memory_controls.recall_action.text() == "Recall from…"


def test_citations_under_a_reply_open_their_passage(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = ChatView()
    qtbot.addWidget(view)
    opened: list[CitationView] = []
    view.citation_opened.connect(opened.append)
    view.begin_reply()
    view.append_reply("It moved to room 3.")
    view.end_reply("", 1)
    view.add_citations([CITED, CitationView("paper.pdf", 2, 4, 4, "Room 3 is booked.", "paper.pdf, p. 2, l. 4")])
    assert "Drew on: notes.md, l. 3-5  ·  paper.pdf, p. 2, l. 4" in view.toPlainText()
    assert view.citation_labels() == ["notes.md, l. 3-5", "paper.pdf, p. 2, l. 4"]
    view._on_anchor(QUrl("cite:1"))
    assert opened == [view._citations[1]]
    view._on_anchor(QUrl("cite:7"))  # no such passage: nothing opens
    assert len(opened) == 1
    dialog = PassageDialog(CITED)
    qtbot.addWidget(dialog)
    assert dialog.where.text() == "notes.md, l. 3-5" and dialog.text.toPlainText() == CITED.text


def test_the_window_shows_a_replys_citations_and_opens_the_passage(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 4)
    say(qtbot, gui, window, "Where is the meeting?")
    finished = window.client.finished
    last = window.chat.toPlainText()
    from app.worker.types import TurnProgress, TurnResult

    finished.emit(TurnResult("stop", TurnProgress(1, 1, 0.0, 0.0), "", recalled=(CITED,)))
    assert (
        window.chat.toPlainText().startswith(last.rstrip()[:20])
        and "Drew on: notes.md, l. 3-5" in window.chat.toPlainText()
    )
    window.chat._on_anchor(QUrl("cite:0"))
    dialog = window.memory_controls.passage
    assert isinstance(dialog, PassageDialog) and dialog.isVisible() and dialog.text.toPlainText() == CITED.text
    dialog.close()


def test_a_relaunch_attaches_the_conversations_documents_again_reading_nothing(
    qtbot, window: MainWindow, gui, prefs, dirs, dialogs: ScriptedDialogs, tiny_model: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 6)
    doc = tmp_path / "notes.md"
    doc.write_text(NOTES, encoding="utf-8")
    report = _attached_report(qtbot, window, lambda: window.composer.attachments.request([doc]), doc)
    tokens = report.attachments[0].tokens
    labels = [c.label for c in say(qtbot, gui, window, "Where is the garden meeting?").recalled]
    assert labels and window.chat.citation_labels() == labels
    stored = window.library.path_for(window.state.current_id)
    window.shutdown()
    assert not (dirs.data / "attachments.json").exists()  # one record: the conversation's session file
    assert [(a.kind, a.name, a.tokens) for a in load_session(stored).attachments] == [("document", "notes.md", tokens)]
    doc.unlink()  # found again in the cache by its digest: the file itself is not read
    again = relaunch(qtbot, prefs, dirs, dialogs, tiny_model, [])
    try:
        qtbot.waitUntil(lambda: _chips(again) == [f"notes.md · {tokens:,} tokens"], timeout=WAIT_MS)
        (view,) = again.client.worker.conversation.attachments()
        assert view.read_tokens == 0  # its capsule was on disk: nothing read again
        session = again.client.worker.session
        assert session.memory_source == "kept" and session.computed.count == 0  # the kept memory, with its document
        assert "read before, nothing read again" in again.inspector.attached.body.text()
        assert again.chat.citation_labels() == labels  # the reply still says what it drew on
        assert "Drew on: " in again.chat.toPlainText()
    finally:
        dispose(again)


def test_a_document_gone_from_the_cache_still_opens_the_conversation_and_says_which(
    qtbot, window: MainWindow, gui, prefs, dirs, dialogs: ScriptedDialogs, tiny_model: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 4)
    doc = tmp_path / "notes.md"
    doc.write_text(NOTES, encoding="utf-8")
    _attached_report(qtbot, window, lambda: window.composer.attachments.request([doc]), doc)
    say(qtbot, gui, window, "Where is the garden meeting?")
    window.shutdown()
    shutil.rmtree(dirs.cache)  # the user cleared the memory cache: the capsule, and the kept memory, are gone
    dirs.ensure()
    again = relaunch(qtbot, prefs, dirs, dialogs, tiny_model, [])
    try:
        qtbot.waitUntil(lambda: "notes.md" in again.notice.text(), timeout=WAIT_MS)
        assert "attach it again" in again.notice.text()
        assert "Where is the garden meeting?" in again.chat.toPlainText()  # the conversation is not lost
        assert _chips(again) == []
    finally:
        dispose(again)


def test_the_inspector_says_what_is_attached_and_what_the_last_reply_drew_on() -> None:
    doc = AttachmentView(Path("/d/notes.md"), "notes.md", AttachKind.DOCUMENT, 1234, 2 * 1024**2, 0)
    talk = AttachmentView(Path("/c/x.spark"), "x.spark", AttachKind.CONVERSATION, 80, 4096, 80, "Fence colours")
    report = MemoryReport((), 10, attachments=(doc, talk), recalled=(CITED,))
    assert attached_words(report).split("\n") == [
        "notes.md: 1,234 tokens, 2.0 MB on disk (read before, nothing read again).",
        "Earlier conversation “Fence colours”: 80 tokens, 4.0 kB on disk (read just now).",
        "The last reply drew on notes.md, l. 3-5.",
    ]
    assert attached_words(MemoryReport((), 10, attachments=(doc,))).endswith(
        "Nothing was drawn from them for the last reply."
    )
    assert attached_words(MemoryReport((), 0)) == NOTHING_ATTACHED
    assert "remote" in attached_words(MemoryReport((), 0, "http://server"))


def test_the_composer_offers_the_paperclip_with_a_name(qtbot) -> None:  # type: ignore[no-untyped-def]
    composer = Composer()
    qtbot.addWidget(composer)
    assert composer.attach_button.accessibleName() == "Attach Documents"
    assert not composer.attach_button.icon().isNull()


def test_each_conversation_keeps_its_own_documents_when_the_user_switches(
    qtbot, window: MainWindow, gui, prefs, dirs, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 4)
    garden, kitchen = tmp_path / "garden.md", tmp_path / "kitchen.md"
    garden.write_text(NOTES, encoding="utf-8")
    kitchen.write_text(NOTES.replace("garden", "kitchen"), encoding="utf-8")
    _attached_report(qtbot, window, lambda: window.composer.attachments.request([garden]), garden)
    say(qtbot, gui, window, "Where is the garden meeting?")
    first = window.state.current_id
    window.menus.new_chat_action.trigger()
    qtbot.waitUntil(lambda: _chips(window) == [], timeout=WAIT_MS)  # a new chat starts with nothing attached
    _attached_report(qtbot, window, lambda: window.composer.attachments.request([kitchen]), kitchen)
    say(qtbot, gui, window, "And the kitchen one?")
    second = window.state.current_id
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_conversation(first)
    qtbot.waitUntil(lambda: [c.split(" · ")[0] for c in _chips(window)] == ["garden.md"], timeout=WAIT_MS)
    assert window.inspector.attached.body.text().startswith("garden.md: ")
    for cid, name in ((first, "garden.md"), (second, "kitchen.md")):
        assert [a.name for a in load_session(window.library.path_for(cid)).attachments] == [name]


def test_chat_recall_from_picks_an_earlier_conversation(
    qtbot, window: MainWindow, gui, prefs, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 4)
    monkeypatch.setattr(memory_controls.QInputDialog, "getItem", lambda *_a: ("", False))
    window.memory_controls.recall_action.trigger()
    assert window.notice.text() == "There is no earlier conversation to recall yet."
    say(qtbot, gui, window, "The fence is blue.")
    earlier = window.state.current_id
    title = window.library.get(earlier).title
    window.menus.new_chat_action.trigger()
    offered: list[list[str]] = []

    def pick(_parent, _title, _label, titles, *_rest):  # type: ignore[no-untyped-def]
        offered.append(list(titles))
        return title, True

    monkeypatch.setattr(memory_controls.QInputDialog, "getItem", pick)
    report = _attached_report(
        qtbot, window, window.memory_controls.recall_action.trigger, window.library.path_for(earlier)
    )
    assert offered == [[title]] and [v.shown for v in report.attachments] == [title]
