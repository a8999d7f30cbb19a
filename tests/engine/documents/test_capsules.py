"""Capsules (engine.documents.capsule) and attachments (engine.documents.attach) on the tiny model: a document is
read once and every conversation attaching it after reads nothing; its blocks are exactly the KV the model computes
for the text; citations lead back to the lines; a damaged index is ignored and the text read again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.documents.attach import Attachments
from engine.documents.capsule import READ_LEAD, load_or_read
from engine.documents.extract import extract
from engine.generation.loop import GenerationSettings, prefill
from engine.memory.base import FullAttentionMemory
from engine.memory.cascade import CascadeMemory
from engine.session.engine import Engine, memory_factory_for
from tests.engine.documents.pdfs import text_pdf
from tests.helpers.tiny import make_tiny_model

DOC = "\n".join(f"line {i}: The quick brown fox jumps over the lazy dog." for i in range(1, 61))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    root = tmp_path_factory.mktemp("docs")
    model = make_tiny_model(root / "tiny")
    factory = memory_factory_for(model, cache_dir=root / "cache", window=64)
    return Engine.load(model, "cpu", memory_factory=factory)


def test_a_document_attached_to_two_conversations_is_read_once(engine: Engine) -> None:
    doc = extract("fox.md", DOC.encode())
    first = Attachments(engine.new_session().memory, engine.tokenizer).attach_document(doc)
    assert first.capsule.read_tokens == first.capsule.tokens > 64  # far beyond the conversation's window
    second_session = engine.new_session()
    second = Attachments(second_session.memory, engine.tokenizer).attach_document(doc)
    assert second.capsule.read_tokens == 0 and second.capsule.keys == first.capsule.keys
    memory = second_session.memory
    assert isinstance(memory, CascadeMemory)
    assert len(memory.episodic.pinned) == len(first.capsule.keys)
    second_session.reset()  # a new chat keeps what is attached
    assert len(memory.episodic.pinned) == len(first.capsule.keys)


def test_capsule_blocks_are_the_kv_the_model_computes(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a reading window that holds the whole text, each block is full attention's KV of its tokens."""
    monkeypatch.setattr("engine.documents.capsule.READ_WINDOW", 4096)
    memory = engine.new_session().memory
    assert isinstance(memory, CascadeMemory) and memory.store is not None
    tok = engine.tokenizer
    ids = tok.encode("A short text about the lazy dog and the quick fox. " * 6, add_bos=False)
    pad = tok.encode("\n", add_bos=False)[-1]
    from engine.documents.provenance import TokenMap

    cap = load_or_read(memory.backend, memory.store, ids, TokenMap("t", (0,), ((0, 1),)), 32, pad)
    backend = engine.backend.fork()
    backend.allocate(1, 1024)
    prefill(backend, FullAttentionMemory(backend), [pad] * READ_LEAD + cap.ids, 64)
    k, v = backend.read_kv(0, torch.arange(READ_LEAD, READ_LEAD + cap.tokens))
    for j, key in enumerate(cap.keys):
        got = memory.store.get(key)
        assert got is not None
        # fp16 as stored; only the chunking of the two reads differs (summation order)
        torch.testing.assert_close(got[0], k[:, :, j * 32 : (j + 1) * 32], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(got[1], v[:, :, j * 32 : (j + 1) * 32], atol=2e-3, rtol=2e-3)


def test_citations_lead_back_to_lines_and_replies_record_them(engine: Engine) -> None:
    session = engine.new_session()
    attachments = Attachments(session.memory, engine.tokenizer)
    item = attachments.attach_document(extract("fox.md", DOC.encode()))
    for j in range(len(item.capsule.keys)):
        c = item.capsule.cite(j, engine.tokenizer)
        first_line = c.text.split("\n")[0]
        assert c.source == "fox.md" and 1 <= c.start <= c.end <= 60
        if first_line.startswith("line "):  # a block that starts at a line's start cites that line first
            assert first_line.startswith(f"line {c.start}:")
    settings = GenerationSettings(max_tokens=3)
    events = session.complete("line 30: The quick", settings)
    next(iter(events))
    recalled = attachments.observe()
    assert recalled and all(c.source == "fox.md" for c in recalled)
    memory = session.memory
    assert isinstance(memory, CascadeMemory)
    held = {b - item.first_id for layer in memory.working.groups for b in layer}
    assert held and all(0 <= j < len(item.capsule.keys) for j in held)


def test_a_damaged_capsule_index_is_ignored_and_read_again(engine: Engine) -> None:
    doc = extract("other.txt", (DOC + "\nthe end").encode())
    memory = engine.new_session().memory
    assert isinstance(memory, CascadeMemory) and memory.store is not None
    item = Attachments(memory, engine.tokenizer).attach_document(doc)
    store = memory.store
    store.discard(item.capsule.keys[3])  # one of its blocks is gone (evicted, deleted by hand)
    again = Attachments(engine.new_session().memory, engine.tokenizer).attach_document(doc)
    assert again.capsule.read_tokens == again.capsule.tokens and all(k in store for k in again.capsule.keys)


def test_attaching_needs_the_persistent_cache(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    engine = Engine.load(model, "cpu", memory_factory=memory_factory_for(model, prefix_cache=False))
    with pytest.raises(Exception, match="persistent cache"):
        Attachments(engine.new_session().memory, engine.tokenizer).attach_document(extract("a.txt", b"hello"))


def test_a_recalled_passage_keeps_to_one_page_and_reads_as_the_text(engine: Engine) -> None:
    pages = [[f"Page one, line {i}: the meeting moved to room {i}." for i in range(1, 7)],
             [f"Page two, line {i}: the seed swap is on day {i}." for i in range(1, 7)]]  # fmt: skip
    session = engine.new_session()
    attachments = Attachments(session.memory, engine.tokenizer)
    item = attachments.attach_document(extract("minutes.pdf", text_pdf(pages)))
    memory = session.memory
    assert isinstance(memory, CascadeMemory)
    every = list(range(item.first_id, item.first_id + len(item.capsule.keys)))
    memory.working.groups = [list(every) for _ in memory.working.groups]  # every layer agrees on every block
    recalled = attachments.observe()
    assert [(c.page, c.start) for c in recalled] == [(1, 1), (2, recalled[1].start)]  # split where the page turns
    assert recalled[0].end == 6 and recalled[1].end == 6
    assert "Page one, line 3: the meeting moved to room 3." in recalled[0].text  # one decode: no seam in a word
    assert "Page two, line 6: the seed swap is on day 6." in recalled[1].text
    assert recalled[0].text.startswith("Page one, line 1:")  # not the header the model was told the text with
    assert "Page two" not in recalled[0].text  # a passage ends where its page ends


def test_the_block_a_question_names_is_paged_into_every_layer(engine: Engine) -> None:
    """Among look-alike facts, the one whose rare words the question shares is in every layer's retrieval groups
    and among the passages the reply recalls (engine.memory.cascade.lexical)."""
    facts = {"QX": 40, "ZJ": 25, "KV": 10, "WY": 50}  # name -> line; these letters appear nowhere else
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(1, 61)]
    for name, at in facts.items():
        lines[at - 1] = f"the code of gate {name} is 4821, remember the code of gate {name}."
    session = engine.new_session()
    attachments = Attachments(session.memory, engine.tokenizer)
    item = attachments.attach_document(extract("gates.txt", "\n".join(lines).encode()))
    memory = session.memory
    assert isinstance(memory, CascadeMemory)
    for name, line in facts.items():
        session.reset()
        events = session.complete(f"the quick brown fox. the code of gate {name} is", GenerationSettings(max_tokens=2))
        next(iter(events))
        named = [
            item.first_id + j
            for j in range(len(item.capsule.keys))
            if name[0] in item.capsule.cite(j, engine.tokenizer).text
        ]
        assert named and all(any(b in layer for b in named) for layer in memory.working.groups), name
        assert any(c.start <= line <= c.end for c in attachments.observe()), name
