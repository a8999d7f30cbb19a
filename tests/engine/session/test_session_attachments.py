"""Session files of conversations with attachments (engine.session.types.AttachmentRecord, engine.documents.attach's
Reattacher): full and compact files record what the memory holds by name and digest, never by path; restoring and
continuing gives the greedy tokens of the conversation that never left memory; a capsule no longer in the cache,
and a file naming hostile attachments, are refused in one sentence with nothing changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.documents.attach import Attachments, Reattacher
from engine.documents.extract import DocumentError, extract
from engine.errors import SessionFileError, SparkError
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.memory.cascade import CascadeMemory
from engine.session import engine as session_engine
from engine.session.engine import Engine, Session
from engine.session.file import AttachmentRecord, inspect_session, load_session
from engine.session.kept import KeptMemory
from engine.session.types import RecalledRecord
from tests.helpers.small_window import event_tokens, small_window_engine
from tests.helpers.tiny import make_tiny_model

GREEDY = GenerationSettings(max_tokens=6, sampling=SamplingSettings(greedy=True))
DOC = "\n".join(f"line {i}: The quick brown fox jumps over the lazy dog {i} times." for i in range(1, 41))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    root = tmp_path_factory.mktemp("attached")
    return small_window_engine(make_tiny_model(root / "tiny"), root / "cache")


def attached_conversation(engine: Engine, attach_after_first_turn: bool) -> tuple[Session, Attachments]:
    session = engine.new_session()
    attachments = Attachments(session.memory, engine.tokenizer, session.attachments)
    if not attach_after_first_turn:
        attachments.attach_document(extract("fox.md", DOC.encode()))
    # Raw completion appends each prompt to the memory (a chat template may re-render, resetting the memory).
    event_tokens(session.complete("Tell me about the quick brown fox and the lazy dog.", GREEDY))
    if attach_after_first_turn:
        attachments.attach_document(extract("fox.md", DOC.encode()))
    event_tokens(session.complete(" How many times does the fox jump?", GREEDY))
    return session, attachments


@pytest.mark.parametrize("compact", [False, True], ids=["full", "compact"])
@pytest.mark.parametrize("late", [False, True], ids=["attached-first", "attached-after-a-turn"])
def test_restored_attachments_continue_as_never_left(engine: Engine, tmp_path: Path, compact: bool, late: bool) -> None:
    session, _ = attached_conversation(engine, late)
    path = tmp_path / "fox.spark"
    session.save(path, compact=compact)
    never_left = event_tokens(session.complete(" And the dog?", GREEDY))

    data = load_session(path)
    assert [(a.kind, a.name, a.tokens) for a in data.attachments] == [
        ("document", "fox.md", session.attachments[0].tokens)
    ]
    assert (data.attachments[0].at > 0) is late
    assert str(tmp_path) not in json.dumps(inspect_session(path)["attachments"])  # a name and a digest, no path

    restored = engine.new_session()
    found = Reattacher()
    report = restored.load(path, reattach=found)
    assert report.applied and restored.attachments == session.attachments
    if compact:
        assert restored.restore_digest_ok is True  # the replay attached it where it was attached: bit for bit
    memory = restored.memory
    assert isinstance(memory, CascadeMemory) and len(memory.attachments) == 1
    assert len(memory.episodic.pinned) == len(found.found[0].capsule.keys)
    assert found.found[0].capsule.read_tokens == 0  # found in the store by its digest
    assert event_tokens(restored.complete(" And the dog?", GREEDY)) == never_left


def test_a_capsule_gone_from_the_cache_is_named_in_one_sentence(engine: Engine, tmp_path: Path) -> None:
    session, _ = attached_conversation(engine, False)
    path = tmp_path / "fox.spark"
    session.save(path, compact=True)
    other = make_tiny_model(tmp_path / "same")  # the same weights, another cache: the capsule is not there
    fresh = small_window_engine(other, tmp_path / "empty-cache").new_session()
    before = list(fresh.messages)
    with pytest.raises(DocumentError) as err:
        fresh.load(path, reattach=Reattacher())
    message = str(err.value)
    assert "fox.md" in message and "attach it again" in message and message.count(".") <= 2
    assert fresh.messages == before and not fresh.attachments
    # Attaching the same file again (the user's own action) stores the same capsule: the file then opens.
    Attachments(fresh.memory, fresh.tokenizer).attach_document(extract("fox.md", DOC.encode()))
    assert fresh.load(path, reattach=Reattacher()).applied


def test_opening_without_attachments_support_is_one_sentence(engine: Engine, tmp_path: Path) -> None:
    session, _ = attached_conversation(engine, False)
    for compact in (False, True):
        path = tmp_path / f"fox{compact}.spark"
        session.save(path, compact=compact)
        with pytest.raises(SessionFileError):
            engine.new_session().load(path)


@pytest.mark.parametrize(
    ("record", "words"),
    [
        (AttachmentRecord("document", "../../.ssh/id_rsa", "a" * 64, 10, 0), "plain file name"),
        (AttachmentRecord("document", "/home/someone/.ssh/id_rsa", "a" * 64, 10, 0), "plain file name"),
        (AttachmentRecord("document", "notes\u202e.md", "a" * 64, 10, 0), "plain file name"),
        (AttachmentRecord("document", "huge.md", "a" * 64, 1 << 40, 0), "beyond what one may be"),
        (AttachmentRecord("document", "notes.md", "../../etc/passwd", 10, 0), "malformed digest"),
        (AttachmentRecord("script", "notes.md", "a" * 64, 10, 0), "unknown kind"),
        (AttachmentRecord("document", "notes.md", "a" * 64, 10, 10**9), "outside its memory"),
    ],
)
def test_hostile_attachment_records_are_refused_in_one_sentence(
    engine: Engine, tmp_path: Path, record: AttachmentRecord, words: str
) -> None:
    session = engine.new_session()
    event_tokens(session.chat("Hello there.", GREEDY))
    session.attachments = [record]
    path = tmp_path / "hostile.spark"
    session.save(path)
    with pytest.raises(SessionFileError) as err:
        engine.new_session().load(path, reattach=Reattacher())
    assert words in str(err.value) and "\n" not in str(err.value)


def test_too_many_attachment_records_are_refused(engine: Engine, tmp_path: Path) -> None:
    session = engine.new_session()
    event_tokens(session.chat("Hello there.", GREEDY))
    session.attachments = [AttachmentRecord("document", f"n{i}.md", "a" * 64, 10, 0) for i in range(1000)]
    path = tmp_path / "many.spark"
    session.save(path)
    with pytest.raises(SparkError, match="more than the 32"):
        load_session(path)


def test_a_document_removed_before_anything_was_computed_leaves_no_record(engine: Engine, tmp_path: Path) -> None:
    session = engine.new_session()
    attachments = Attachments(session.memory, engine.tokenizer, session.attachments)
    cat = attachments.attach_document(extract("cat.md", DOC.replace("fox", "cat").encode()))
    attachments.attach_document(extract("fox.md", DOC.encode()))
    assert attachments.detach(cat) is False  # nothing computed yet: nothing for a recipe to replay
    assert [a.name for a in session.attachments] == ["fox.md"]
    event_tokens(session.complete("Tell me about the quick brown fox and the lazy dog.", GREEDY))
    path = tmp_path / "fox.spark"
    session.save(path, compact=True)
    assert load_session(path).memory_meta.get("kind") == "recompute"  # still compact
    never_left = event_tokens(session.complete(" And the dog?", GREEDY))
    restored = engine.new_session()
    restored.load(path, reattach=Reattacher())
    assert restored.restore_digest_ok is True
    assert event_tokens(restored.complete(" And the dog?", GREEDY)) == never_left


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_document_removed_later_reopens_as_the_conversation_that_never_left(
    engine: Engine, tmp_path: Path, which: str
) -> None:
    session = engine.new_session()
    attachments = Attachments(session.memory, engine.tokenizer, session.attachments)
    cat = attachments.attach_document(extract("cat.md", DOC.replace("fox", "cat").encode()))
    fox = attachments.attach_document(extract("fox.md", DOC.encode()))
    event_tokens(session.complete("Tell me about the quick brown fox and the lazy dog.", GREEDY))
    gone, stays = (cat, "fox.md") if which == "first" else (fox, "cat.md")
    if attachments.detach(gone):
        session.drop_recipe()
    assert [a.name for a in session.attachments] == [stays] and len(attachments.items) == 1
    memory = session.memory
    assert isinstance(memory, CascadeMemory) and [a[0] for a in memory.attachments] == [attachments.items[0].first_id]
    event_tokens(session.complete(" How many times does the fox jump?", GREEDY))
    path = tmp_path / "fox.spark"
    session.save(path, compact=True)  # a removal cannot be replayed: the file keeps the full memory
    assert load_session(path).memory_meta.get("kind") != "recompute"
    never_left = event_tokens(session.complete(" And the dog?", GREEDY))
    restored, found = engine.new_session(), Reattacher()
    assert restored.load(path, reattach=found).applied
    assert [f.capsule.name for f in found.found] == [stays] and found.found[0].first_id == attachments.items[0].first_id
    assert event_tokens(restored.complete(" And the dog?", GREEDY)) == never_left


def test_the_kept_copy_of_a_conversation_with_attachments_reads_back_with_them(engine: Engine, tmp_path: Path) -> None:
    session, _ = attached_conversation(engine, True)
    record = tmp_path / "fox.spark"
    session.save(record, compact=True)
    kept = KeptMemory(tmp_path / "kept")
    assert session.keep(kept, record)
    never_left = event_tokens(session.complete(" And the dog?", GREEDY))
    restored, found = engine.new_session(), Reattacher()
    restored.load(record, kept=kept, reattach=found)
    assert restored.memory_source == "kept" and restored.computed.count == 0
    assert restored.attachments == session.attachments and [f.capsule.name for f in found.found] == ["fox.md"]
    memory = restored.memory
    assert isinstance(memory, CascadeMemory) and len(memory.episodic.pinned) == len(found.found[0].capsule.keys)
    assert event_tokens(restored.complete(" And the dog?", GREEDY)) == never_left


def test_the_passages_replies_drew_on_are_kept_and_hostile_ones_refused(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = engine.new_session()
    event_tokens(session.chat("Hello there.", GREEDY))
    passage = RecalledRecord(1, "fox.md", None, 3, 5, "line 3: The quick brown fox")
    long = RecalledRecord(1, "x" * 300 + ".md", 2, 1, 1, "y" * 30_000)
    session.recalled = [passage, long, RecalledRecord(7, "gone.md", 2, 1, 1, "a reply no longer there")]
    path = tmp_path / "cited.spark"
    session.save(path)
    kept = load_session(path).recalled  # under messages the file holds, within what a load accepts
    assert kept[0] == passage and len(kept) == 2
    assert (len(kept[1].source), len(kept[1].text)) == (255, 20_000)
    restored = engine.new_session()
    restored.load(path)
    assert restored.recalled == kept
    restored.reset()
    assert restored.recalled == []
    session.recalled = [RecalledRecord(1, "fox.md", None, i, i, "") for i in range(5000)]
    session.save(path)
    assert [r.start for r in load_session(path).recalled] == list(range(5000 - 4096, 5000))  # the newest

    # A file written by something else: every passage is checked on load.
    monkeypatch.setattr(session_engine, "recalled_to_keep", lambda rs, _n: [r.to_json() for r in rs])
    for hostile, words in (
        (RecalledRecord(9, "fox.md", None, 1, 1, ""), "does not hold"),
        (RecalledRecord(1, "fox.md", None, 5, 3, ""), "out of range"),
        (RecalledRecord(1, "fox.md", -2, 1, 1, ""), "out of range"),
        (RecalledRecord(1, "", None, 1, 1, ""), "short name"),
        (RecalledRecord(1, "fox.md", None, 1, 1, "x" * 20_001), "longer than"),
    ):
        session.recalled = [hostile]
        session.save(path)
        with pytest.raises(SessionFileError) as err:
            load_session(path)
        assert words in str(err.value) and "\n" not in str(err.value)
