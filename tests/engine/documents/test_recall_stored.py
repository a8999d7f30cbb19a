"""Recalling an earlier conversation from the memory its full `.spark` stores (engine.documents.recall): nothing is
read, the blocks are the stored KV of its tokens after the sinks, the citations lead to its lines; a compact file,
another model's file or a memory with a hole read the transcript again, saying why where it is not the plain case."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.documents.attach import Attachments, Reattacher
from engine.documents.capsule import Capsule
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.memory.cascade import CascadeMemory, PersistentStore
from engine.session.engine import Engine, Session, memory_factory_for
from tests.helpers.tiny import make_tiny_model

GREEDY = GenerationSettings(max_tokens=4, sampling=SamplingSettings(greedy=True))
TALK = [f"Line {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(12)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    root = tmp_path_factory.mktemp("recall")
    model = make_tiny_model(root / "tiny")
    factory = memory_factory_for(model, cache_dir=root / "cache", window=64)
    return Engine.load(model, "cpu", memory_factory=factory)


def talked(engine: Engine) -> Session:
    """A conversation well past its 64-token window (episodic blocks, a partial block and a full window)."""
    session = engine.new_session()
    for _ in session.chat("\n".join(TALK), GREEDY):
        pass
    for _ in session.chat("And the lazy dog?", GREEDY):
        pass
    return session


def test_a_full_file_is_recalled_from_its_memory_reading_nothing(engine: Engine, tmp_path: Path) -> None:
    earlier = talked(engine)
    memory = earlier.memory
    assert isinstance(memory, CascadeMemory) and memory.working.evicted > 2 * memory.cfg.block_size
    path = tmp_path / "earlier.spark"
    earlier.save(path)
    session = engine.new_session()
    attachments = Attachments(session.memory, engine.tokenizer)
    item = attachments.recall_session(path)
    cap = item.capsule
    assert cap.read_tokens == 0 and attachments.read_tokens == 0 and not attachments.notes
    assert session.computed.count == 0  # nothing ran through the model
    sinks, b = memory.cfg.sink_tokens, memory.cfg.block_size
    tokens = list(memory.tokens)
    n = len(tokens) - sinks
    assert len(cap.keys) == -(-n // b)
    assert cap.ids[:b] == tokens[sinks : sinks + b] and cap.ids[-b:] == tokens[-b:]  # the last block ends at the end
    store = memory.store
    assert store is not None
    # The first block is the stored KV of the tokens after the sinks: the first episodic block, bit for bit.
    first = memory.episodic.fetch(0, protect=())
    got = store.get(cap.keys[0])
    assert first is not None and got is not None
    assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])
    # The last block ends with the window's newest token, as the slot table holds it.
    newest = memory.working.recent_slots(1)
    k, v = memory.backend.read_kv(0, newest)
    last = store.get(cap.keys[-1])
    assert last is not None and torch.equal(last[0][:, :, -1:], k) and torch.equal(last[1][:, :, -1:], v)
    lines = {(c.start, c.end) for c in (cap.cite(j, engine.tokenizer) for j in range(len(cap.keys)))}
    transcript_lines = sum(len(m.content.split("\n")) for m in earlier.messages)
    assert all(1 <= s <= e <= transcript_lines for s, e in lines) and len(lines) > 1, lines
    pinned = session.memory.episodic.pinned  # type: ignore[attr-defined]
    assert len(pinned) == len(cap.keys)


def test_a_compact_file_is_read_as_its_transcript(engine: Engine, tmp_path: Path) -> None:
    path = tmp_path / "compact.spark"
    talked(engine).save(path, compact=True)
    attachments = Attachments(engine.new_session().memory, engine.tokenizer)
    cap = attachments.recall_session(path).capsule
    assert isinstance(cap, Capsule) and not attachments.notes
    assert engine.tokenizer.decode(cap.ids).lstrip().startswith("The earlier conversation compact.spark")


def test_a_memory_no_longer_on_disk_is_read_again_with_a_note(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    earlier = talked(engine)
    path = tmp_path / "spilled.spark"
    memory = earlier.memory
    assert isinstance(memory, CascadeMemory)
    memory.spill()  # the blocks' KV only in the store: the file keeps stubs naming them
    earlier.save(path)
    monkeypatch.setattr(PersistentStore, "get", lambda self, key: None)  # another machine's disk
    attachments = Attachments(engine.new_session().memory, engine.tokenizer)
    cap = attachments.recall_session(path).capsule
    assert attachments.notes == [
        "Part of spilled.spark's memory is no longer on this disk. Reading its transcript instead."
    ]
    assert engine.tokenizer.decode(cap.ids).lstrip().startswith("The earlier conversation spilled.spark")


def test_another_models_file_is_read_again_with_a_note(engine: Engine, tmp_path: Path) -> None:
    path = tmp_path / "other.spark"
    talked(engine).save(path)
    session = engine.new_session()
    session.backend.fingerprint = "0" * 64  # type: ignore[misc]
    attachments = Attachments(session.memory, engine.tokenizer)
    attachments.recall_session(path)
    assert len(attachments.notes) == 1 and "different model" in attachments.notes[0]


@pytest.mark.parametrize("compact", [False, True], ids=["full", "compact"])
def test_a_conversation_that_recalled_another_saves_and_continues(
    engine: Engine, tmp_path: Path, compact: bool
) -> None:
    earlier = tmp_path / "earlier.spark"
    talked(engine).save(earlier)
    session = engine.new_session()
    Attachments(session.memory, engine.tokenizer, session.attachments).recall_session(earlier)
    for _ in session.complete("What about the lazy dog?", GREEDY):
        pass
    assert [(a.kind, a.name) for a in session.attachments] == [("conversation", "earlier.spark")]
    path = tmp_path / "now.spark"
    session.save(path, compact=compact)
    never_left = [e.token for e in session.complete(" And the fox?", GREEDY)]
    restored = engine.new_session()
    found = Reattacher()
    assert restored.load(path, reattach=found).applied
    assert (
        found.found[0].capsule.keys
        == Attachments(engine.new_session().memory, engine.tokenizer).recall_session(earlier).capsule.keys
    )  # found by its digest: the same blocks
    assert [e.token for e in restored.complete(" And the fox?", GREEDY)] == never_left


def test_a_file_of_another_block_size_is_cut_into_this_memorys_blocks(engine: Engine, tmp_path: Path) -> None:
    factory = memory_factory_for(engine.model_dir, cache_dir=tmp_path / "other", window=64, block_size=16)
    earlier = talked(Engine.load(engine.model_dir, "cpu", memory_factory=factory))
    path = tmp_path / "blocks16.spark"
    earlier.save(path)
    session = engine.new_session()
    attachments = Attachments(session.memory, engine.tokenizer)
    cap = attachments.recall_session(path).capsule
    b = session.memory.cfg.block_size  # type: ignore[attr-defined]
    assert b != 16 and cap.block_size == b and cap.read_tokens == 0 and not attachments.notes
    assert cap.ids[-b:] == list(earlier.memory.tokens)[-b:]
