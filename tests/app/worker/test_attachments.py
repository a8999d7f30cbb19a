"""Documents and earlier conversations joined to a conversation's memory through the worker: attached through the
engine (the memory report lists them with their size), read once, refused in one sentence, cancellable while read,
removable, and the passages a reply drew on reported with it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.worker.types import (
    AttachKind,
    AttachProgress,
    MemoryReport,
    MessageView,
    SessionFileEvent,
    TurnResult,
)
from engine import GenerationSettings, SamplingSettings, load_session
from tests.helpers.app_window import WAIT_MS, running_client
from tests.helpers.default_model import default_model_dir

NOTES = "".join(f"Line {i}: the meeting about the garden moved to room {i % 7}.\n" for i in range(1, 60))
SHORT = GenerationSettings(max_tokens=4, sampling=SamplingSettings(seed=0))


def _attached(qtbot, client, path: Path, kind: AttachKind = AttachKind.DOCUMENT, title: str = "") -> MemoryReport:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(
        client.memory, timeout=WAIT_MS, check_params_cb=lambda r: any(v.path == path for v in r.attachments)
    ) as blocker:
        client.attach_file(path, kind, title)
    report: MemoryReport = blocker.args[0]
    return report


def _refused(qtbot, client, path: Path) -> str:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(client.attach_failed, timeout=WAIT_MS) as blocker:
        client.attach_file(path)
    assert blocker.args[0] == str(path)
    why: str = blocker.args[1]
    return why


def test_a_document_attaches_once_and_a_second_conversation_reads_nothing(
    qtbot, tmp_path: Path, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    doc = tmp_path / "notes.md"
    doc.write_text(NOTES, encoding="utf-8")
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        seen: list[AttachProgress] = []
        client.attaching.connect(seen.append)
        report = _attached(qtbot, client, doc)
        (view,) = report.attachments
        assert view.name == "notes.md" and view.kind == AttachKind.DOCUMENT
        assert view.tokens > 0 and view.read_tokens == view.tokens and view.disk_bytes > 0
        qtbot.waitUntil(lambda: bool(seen), timeout=WAIT_MS)
        assert seen[-1].path == doc and seen[-1].done == seen[-1].total
        assert "already attached" in _refused(qtbot, client, doc)
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS) as blocker:
            client.send("Where is the meeting about the garden?", SHORT)
        result: TurnResult = blocker.args[0]
        assert result.reason in ("stop", "length")
        assert all(c.source == "notes.md" and 1 <= c.start <= c.end for c in result.recalled)
        client.new_chat(tmp_path / "second.spark")  # another conversation attaching the same file reads nothing
        again = _attached(qtbot, client, doc)
        assert [v.read_tokens for v in again.attachments] == [0]
        assert [v.tokens for v in again.attachments] == [view.tokens]


def test_removing_a_document_takes_it_out_of_the_memory(qtbot, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(NOTES, encoding="utf-8")
    second.write_text(NOTES.replace("garden", "kitchen"), encoding="utf-8")
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        _attached(qtbot, client, first)
        _attached(qtbot, client, second)
        with qtbot.waitSignal(client.memory, timeout=WAIT_MS) as blocker:
            client.detach(first)
        assert [v.path for v in blocker.args[0].attachments] == [second]
        session = client.worker.session
        assert session is not None
        # The detached blocks left the episodic tier; the other's stayed (pinned stubs, not one id shared).
        pinned = session.memory.episodic.pinned  # type: ignore[attr-defined]
        assert len(pinned) == len(session.memory.attachments[0][3])  # type: ignore[attr-defined]
        third = _attached(qtbot, client, first)  # attached again after a removal: fresh ids, both there
        assert [v.path for v in third.attachments] == [second, first]
        ids = [a[0] for a in session.memory.attachments]  # type: ignore[attr-defined]
        assert len(set(ids)) == 2
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS) as blocker:
            client.send("And the kitchen?", SHORT)
        assert blocker.args[0].reason in ("stop", "length")


def _talk_with_a_document(qtbot, client, doc: Path, stored: Path) -> MemoryReport:  # type: ignore[no-untyped-def]
    """A conversation stored at `stored` that attached `doc` and had one turn."""
    client.new_chat(stored)
    report = _attached(qtbot, client, doc)
    with qtbot.waitSignal(client.stored, timeout=WAIT_MS):
        client.send("Where is the meeting about the garden?", SHORT)
    return report


def _restored(qtbot, client, path: Path) -> tuple[SessionFileEvent, MemoryReport]:  # type: ignore[no-untyped-def]
    reports: list[MemoryReport] = []
    client.memory.connect(reports.append)
    with qtbot.waitSignal(client.restored, timeout=WAIT_MS) as blocker:
        client.restore(path, store_path=path)
    client.memory.disconnect(reports.append)
    return blocker.args[0], reports[-1]


def test_a_relaunch_reopens_a_conversation_with_its_documents_reading_nothing(
    qtbot, tmp_path: Path, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    doc, stored = tmp_path / "notes.md", tmp_path / "talk.spark"
    doc.write_text(NOTES, encoding="utf-8")
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        view = _talk_with_a_document(qtbot, client, doc, stored).attachments[0]
    doc.unlink()  # the session file records the capsule by digest: the file the user chose is not read again
    assert [a.name for a in load_session(stored).attachments] == ["notes.md"]
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:  # the next launch
        _event, report = _restored(qtbot, client, stored)
        (again,) = report.attachments
        assert (again.name, again.tokens, again.read_tokens) == ("notes.md", view.tokens, 0)
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS) as blocker:
            client.send("And where is it now?", SHORT)
        assert blocker.args[0].reason in ("stop", "length")
        assert all(c.source == "notes.md" for c in blocker.args[0].recalled)
        doc.write_text(NOTES, encoding="utf-8")  # the user attaches the same file again: the one held, now by its path
        (same,) = _attached(qtbot, client, doc).attachments
        assert same.path == doc and same.read_tokens == 0
        session = client.worker.session
        assert session is not None and len(session.memory.attachments) == 1  # type: ignore[attr-defined]
        with qtbot.waitSignal(client.memory, timeout=WAIT_MS) as removed:
            client.detach(doc)
        assert removed.args[0].attachments == ()
        with qtbot.waitSignal(client.stored, timeout=WAIT_MS):
            client.send("Thanks.", SHORT)
    assert load_session(stored).attachments == []


def test_the_passages_a_reply_drew_on_are_kept_with_the_conversation(qtbot, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    doc, stored = tmp_path / "notes.md", tmp_path / "talk.spark"
    doc.write_text(NOTES, encoding="utf-8")
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        client.new_chat(stored)
        _attached(qtbot, client, doc)
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS) as blocker:
            client.send("Where is the meeting about the garden?", SHORT)
        recalled = blocker.args[0].recalled
        assert recalled  # the document is all the model may draw on besides the prompt
    saved = load_session(stored).recalled
    assert [(r.message, r.source, r.start, r.end, r.text) for r in saved] == [
        (1, c.source, c.start, c.end, c.text) for c in recalled
    ]
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        shown: list[list[MessageView]] = []
        client.conversation_shown.connect(shown.append)
        _event, report = _restored(qtbot, client, stored)
        assert [m.recalled for m in shown[-1]] == [(), recalled]
        with qtbot.waitSignal(client.memory, timeout=WAIT_MS) as removed:
            client.detach(report.attachments[0].path)  # a restored chip is removed by the key its report gave it
        assert removed.args[0].attachments == ()


def test_a_spark_file_opened_from_elsewhere_joins_the_library_with_its_documents(
    qtbot, tmp_path: Path, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    doc, shared = tmp_path / "notes.md", tmp_path / "from-a-friend.spark"
    doc.write_text(NOTES, encoding="utf-8")
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        _talk_with_a_document(qtbot, client, doc, shared)
    library = tmp_path / "library" / "c1.spark"
    library.parent.mkdir()
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        reports: list[MemoryReport] = []
        client.memory.connect(reports.append)
        with qtbot.waitSignal(client.stored, timeout=WAIT_MS):  # the opened file is stored as a new conversation
            client.restore(shared, store_path=library)
        assert [v.name for v in reports[-1].attachments] == ["notes.md"]
    assert load_session(library).attachments == load_session(shared).attachments


def test_switching_keeps_each_conversations_documents(qtbot, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    garden, kitchen = tmp_path / "garden.md", tmp_path / "kitchen.md"
    garden.write_text(NOTES, encoding="utf-8")
    kitchen.write_text(NOTES.replace("garden", "kitchen"), encoding="utf-8")
    first, second = tmp_path / "first.spark", tmp_path / "second.spark"
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        _talk_with_a_document(qtbot, client, garden, first)
        _talk_with_a_document(qtbot, client, kitchen, second)
        _event, report = _restored(qtbot, client, first)
        assert [v.name for v in report.attachments] == ["garden.md"]
        _event, report = _restored(qtbot, client, second)
        assert [v.name for v in report.attachments] == ["kitchen.md"]
        _event, report = _restored(qtbot, client, first)  # back again: its memory handed back from RAM
        assert [v.name for v in report.attachments] == ["garden.md"]
    assert [a.name for a in load_session(first).attachments] == ["garden.md"]
    assert [a.name for a in load_session(second).attachments] == ["kitchen.md"]


def test_a_document_gone_from_the_cache_still_opens_the_conversation_and_names_it(
    qtbot, tmp_path: Path, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    doc, stored = tmp_path / "notes.md", tmp_path / "talk.spark"
    doc.write_text(NOTES, encoding="utf-8")
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        _talk_with_a_document(qtbot, client, doc, stored)
        messages = client.worker.conversation.messages  # type: ignore[union-attr]
    with running_client(qtbot, tmp_path / "other-cache", tiny_model) as client:  # the cache was cleared
        shown: list[list[object]] = []
        client.conversation_shown.connect(shown.append)
        event, report = _restored(qtbot, client, stored)
        assert "notes.md" in event.note and "attach it again" in event.note and event.note.count(". ") == 0
        assert report.attachments == ()
        assert [(m.role, m.content) for m in shown[-1]] == messages  # the transcript is not lost
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS) as blocker:
            client.send("Where was it?", SHORT)  # the memory is read again, without the document
        assert blocker.args[0].reason in ("stop", "length")
        report = _attached(qtbot, client, doc)  # attached again: the next store records it again
        with qtbot.waitSignal(client.stored, timeout=WAIT_MS):
            client.send("And now?", SHORT)
    assert [a.name for a in load_session(stored).attachments] == ["notes.md"]


def test_hostile_and_unsupported_files_are_refused_in_one_sentence(qtbot, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    broken = tmp_path / "report.pdf"
    broken.write_bytes(b"%PDF-1.7\n1 0 obj << /Type /Catalog /Pages 2 0 R >>\nendobj\ntrailer << /Root 9 0 R >>\n%%EOF")
    binary = tmp_path / "photo.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    missing = tmp_path / "gone.txt"
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        for path in (broken, binary, missing):
            why = _refused(qtbot, client, path)
            assert path.name in why and why.count(". ") == 0 and "\n" not in why  # one sentence, naming the file
        with qtbot.waitSignal(client.memory, timeout=WAIT_MS) as blocker:
            client.detach(missing)  # nothing attached: the report says so
        assert blocker.args[0].attachments == ()


def test_a_first_reading_stops_when_cancelled(qtbot, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    long_doc = tmp_path / "long.txt"
    long_doc.write_text(NOTES * 12, encoding="utf-8")
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        cancelled = threading.Event()

        def on_progress(p: AttachProgress) -> None:  # on the worker's thread: cancel after the first chunk
            if not cancelled.is_set():
                cancelled.set()
                client.cancel_attach(p.path)

        client.worker.attaching.connect(on_progress, Qt.ConnectionType.DirectConnection)
        with qtbot.waitSignal(client.attach_failed, timeout=WAIT_MS) as blocker:
            client.attach_file(long_doc)
        assert blocker.args == [str(long_doc), ""]  # cancelled: nothing to say
        assert cancelled.is_set()
        session = client.worker.session
        assert session is not None and not session.memory.attachments  # type: ignore[attr-defined]


def test_an_earlier_conversation_is_recalled_under_its_title(qtbot, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    earlier = tmp_path / "earlier.spark"
    with running_client(qtbot, tmp_path / "cache", tiny_model) as client:
        client.new_chat(earlier)
        with qtbot.waitSignal(client.stored, timeout=WAIT_MS):
            client.send("We decided to paint the fence blue.", SHORT)
        client.new_chat(tmp_path / "now.spark")
        report = _attached(qtbot, client, earlier, AttachKind.CONVERSATION, "Fence colours")
        (view,) = report.attachments
        assert view.kind == AttachKind.CONVERSATION and view.shown == "Fence colours" and view.tokens > 0
        with qtbot.waitSignal(client.attach_failed, timeout=WAIT_MS) as blocker:
            client.new_chat(earlier)  # the conversation itself cannot recall itself
            client.attach_file(earlier, AttachKind.CONVERSATION, "Fence colours")
        assert "the conversation you are in" in blocker.args[1]


def test_the_default_model_cites_the_passage_it_drew_on(qtbot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fill = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
    doc = tmp_path / "filler.txt"
    doc.write_text(fill * 40 + "The pass key is 48213. Remember it. 48213 is the pass key.\n" + fill * 40)
    with running_client(qtbot, tmp_path / "cache", default_model_dir(), "auto") as client:
        _attached(qtbot, client, doc)
        settings = GenerationSettings(max_tokens=12, sampling=SamplingSettings(greedy=True))
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS * 4) as blocker:
            client.send("What is the pass key in filler.txt?", settings)
        result: TurnResult = blocker.args[0]
        assert result.recalled, result.text
        assert any("48213" in c.text for c in result.recalled)
        assert all(c.label.startswith("filler.txt, l. ") for c in result.recalled)
        assert result.recalled_turns_ago == 0  # drawn from the document: no earlier turn of the chat was recalled


def test_a_remote_model_refuses_attachments_in_one_sentence(tmp_path: Path) -> None:
    from app.worker.conversation import RemoteConversation
    from engine import RemoteServer, SparkError

    remote = RemoteConversation(RemoteServer("http://127.0.0.1:9/v1", "far"))  # nothing is contacted
    try:
        with pytest.raises(SparkError, match=r"^notes\.md was not attached: a remote model reads only"):
            remote.attach(tmp_path / "notes.md", AttachKind.DOCUMENT, "", lambda _d, _t: None)
        assert remote.attachments() == () and remote.recalled() == ()
    finally:
        remote.close()
