"""Kept memory (engine.session.kept): a compact conversation reopens by reading its memory back, exactly as if it had
never been left and exactly as a replay rebuilds it, its episodic blocks paged in from the entry when first needed;
a damaged or mismatched entry is ignored, a damaged block never used; the budget holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.session.container import decode_tensors, read_checked
from engine.session.engine import Engine, Session, memory_factory_for
from engine.session.file import save_session, session_fields
from engine.session.kept import EntryFile, KeptMemory, take_snapshot
from engine.session.replay import memory_digest
from tests.helpers.held_writes import HeldWrites
from tests.helpers.small_window import event_tokens as tokens
from tests.helpers.small_window import small_window_engine
from tests.helpers.tiny import make_tiny_model

GREEDY = GenerationSettings(max_tokens=16, sampling=SamplingSettings(greedy=True), ignore_eos=True, prefill_chunk=16)
LONG = "The memory cascade keeps sinks, a window and recalled blocks. " * 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kept") / "m")


@pytest.fixture
def engine(model: Path, tmp_path: Path) -> Engine:
    return small_window_engine(model, tmp_path / "l3")  # episodic blocks and routing state are kept too


def talk(engine: Engine) -> Session:
    s = engine.new_session()
    for text in (LONG, "And then?", LONG[:90]):
        tokens(s.chat(text, GREEDY))
    assert s.stats().episodic.entries > 0  # type: ignore[union-attr]
    return s


def test_kept_memory_reopens_without_computing_and_continues_as_replay_and_never_left(
    engine: Engine, tmp_path: Path
) -> None:
    kept = KeptMemory(tmp_path / "kept")
    a = talk(engine)
    record = tmp_path / "c.spark"
    a.save(record, compact=True)
    assert a.keep(kept, record) and kept.usage().entries == 1
    from_kept, replayed = engine.new_session(), engine.new_session()
    report = from_kept.load(record, kept=kept)
    assert from_kept.memory_source == "kept" and from_kept.computed.count == 0 and "kept" in report.message
    replayed.load(record)
    assert replayed.memory_source == "recomputed" and replayed.computed.count == len(a.memory.tokens)
    assert from_kept.memory.tokens == replayed.memory.tokens == a.memory.tokens
    never_left = tokens(a.chat("One more?", GREEDY))
    assert tokens(from_kept.chat("One more?", GREEDY)) == never_left
    assert tokens(replayed.chat("One more?", GREEDY)) == never_left


def flip(entry: Path, at: int) -> None:
    raw = bytearray(entry.read_bytes())
    raw[at] ^= 0xFF
    entry.write_bytes(bytes(raw))


def kept_talk(engine: Engine, tmp_path: Path) -> tuple[Session, Path, KeptMemory]:
    kept = KeptMemory(tmp_path / "kept")
    a = talk(engine)
    record = tmp_path / "c.spark"
    a.save(record, compact=True)
    assert a.keep(kept, record)
    return a, record, kept


def paged(s: Session) -> int:
    """How many of the session's episodic blocks are still in the kept file, not yet read."""
    return sum(b.paged is not None for b in s.memory.episodic.blocks.values())  # type: ignore[attr-defined]


def test_a_damaged_entry_is_ignored_and_the_memory_recomputed(engine: Engine, tmp_path: Path) -> None:
    a, record, kept = kept_talk(engine, tmp_path)
    entry = kept.entry_path(record)
    for name in ("wk.k", "ep.kmin", "route.recent"):  # what is read when the entry is opened
        opened = EntryFile.open(entry)
        at = opened.where(name)[len(opened.where(name)) // 2]
        del opened
        flip(entry, at)
        b = engine.new_session()
        b.load(record, kept=kept)
        assert b.memory_source == "recomputed" and b.restore_digest_ok is True, name
        assert not entry.exists()  # a damaged entry is deleted, never trusted
        assert a.keep(kept, record)
    flip(entry, 200)  # the metadata
    b = engine.new_session()
    b.load(record, kept=kept)
    assert b.memory_source == "recomputed" and not entry.exists()
    assert tokens(b.chat("One more?", GREEDY)) == tokens(a.chat("One more?", GREEDY))


def test_a_damaged_block_is_never_used_and_the_entry_set_aside(engine: Engine, tmp_path: Path) -> None:
    _, record, kept = kept_talk(engine, tmp_path)
    entry = kept.entry_path(record)
    opened = EntryFile.open(entry)
    name = next(n for n in opened.names if n.startswith("ep.") and n.endswith(".v") and "partial" not in n)
    bid = int(name.split(".")[1])
    flip(entry, opened.where(name)[5])
    del opened
    b = engine.new_session()
    b.load(record, kept=kept)  # blocks are checked when first read, not on opening
    assert b.memory_source == "kept" and paged(b) > 0
    episodic = b.memory.episodic  # type: ignore[attr-defined]
    assert episodic.fetch(bid, protect=()) is None  # failed its digest: forgotten, its bytes never used
    assert bid not in episodic.blocks and not entry.exists()
    other = next(i for i, blk in episodic.blocks.items() if blk.paged is not None)
    assert episodic.fetch(other, protect=()) is not None  # the sound blocks still read: the file is still open
    c = engine.new_session()
    c.load(record, kept=kept)
    assert c.memory_source == "recomputed"  # the next reopen recomputes


def test_a_reopened_memory_pages_its_blocks_in_as_retrieval_asks_and_goes_on_as_never_left(
    engine: Engine, tmp_path: Path
) -> None:
    a, record, kept = kept_talk(engine, tmp_path)
    b = engine.new_session()
    b.load(record, kept=kept)
    held = paged(b)
    assert b.memory_source == "kept" and held == len(b.memory.episodic.blocks) > 0  # type: ignore[attr-defined]
    never_left = [tokens(a.chat(t, GREEDY)) for t in ("One more?", LONG[:60])]
    assert [tokens(b.chat(t, GREEDY)) for t in ("One more?", LONG[:60])] == never_left
    assert paged(b) < held  # retrieval read some back, and only those
    assert memory_digest(b.memory) == memory_digest(a.memory)  # reads the rest: the same memory, bit for bit


@pytest.mark.parametrize("how", ["evicted", "cleared", "rewritten"])
def test_an_entry_evicted_or_rewritten_while_its_blocks_are_paged_reads_the_same(
    engine: Engine, tmp_path: Path, how: str
) -> None:
    a, record, kept = kept_talk(engine, tmp_path)
    b = engine.new_session()
    b.load(record, kept=kept)
    assert paged(b) > 0
    if how == "evicted":
        kept.set_budget(0)
    elif how == "cleared":
        kept.clear()
    else:  # the conversation kept again, from another memory, replaces the file under b's open one
        c = engine.new_session()
        c.load(record, kept=kept)
        tokens(c.chat("Elsewhere.", GREEDY))
        old = kept.entry_path(record).stat().st_ino
        assert c.keep(kept, record) and kept.entry_path(record).stat().st_ino != old
    assert tokens(b.chat("One more?", GREEDY)) == tokens(a.chat("One more?", GREEDY))
    assert memory_digest(b.memory) == memory_digest(a.memory)


def test_keeping_a_reopened_memory_again_reads_its_unchanged_blocks_on_the_writer_not_the_worker(
    engine: Engine, tmp_path: Path
) -> None:
    a, record, kept = kept_talk(engine, tmp_path)
    b = engine.new_session()
    b.load(record, kept=kept)
    tokens(b.chat("One more?", GREEDY))
    tokens(a.chat("One more?", GREEDY))
    snap = take_snapshot(b.memory)
    assert snap.paged and not any(f"ep.{i}.k" in snap.tensors for i in snap.paged)  # not copied on the worker
    b.save(record, compact=True)
    assert b.keep(kept, record, later=True) and kept.flush(60)
    c = engine.new_session()
    c.load(record, kept=kept)
    assert c.memory_source == "kept" and c.computed.count == 0
    assert memory_digest(c.memory) == memory_digest(a.memory)
    assert tokens(c.chat("And then?", GREEDY)) == tokens(a.chat("And then?", GREEDY))


def rewrite(entry: Path, digests: object, more: dict[str, torch.Tensor] | None = None) -> None:
    """The entry written again with `digests` as its extra["kept"] (None: without) and `more` tensors."""
    pre, raw, section, _ = read_checked(entry)
    fields = session_fields(entry, pre, raw)
    tensors = {**decode_tensors(entry, section), **(more or {})}
    extra = {k: v for k, v in fields["extra"].items() if k != "kept"}
    if digests is not None:
        extra["kept"] = digests
    save_session(
        entry,
        fingerprint=fields["fingerprint"],
        tokenizer_hash=fields["tokenizer_hash"],
        messages=[],
        system_prompt=None,
        settings={},
        memory_state=(fields["memory_meta"], tensors),
        pending_token=fields["pending_token"],
        sampler_state=None,
        extra=extra,
        token_ids=fields["token_ids"],
        compression="none",
        kv_type=fields["kv_type"],
    )


@pytest.mark.parametrize(
    "digests",
    [
        None,  # an entry of an earlier build
        {"format": 1, "state": "0" * 64, "blocks": {}},  # does not cover its blocks
        {"format": 1, "state": "xyz", "blocks": {}},
        {"format": 1, "state": "0" * 64, "blocks": {"-1": "0" * 64}},
        {"format": 1, "state": "0" * 64, "blocks": [1, 2]},
        {"format": 2, "state": "0" * 64, "blocks": {}},
    ],
)
def test_an_entry_without_sound_digests_is_ignored(engine: Engine, tmp_path: Path, digests: object) -> None:
    _, record, kept = kept_talk(engine, tmp_path)
    entry = kept.entry_path(record)
    rewrite(entry, digests)
    b = engine.new_session()
    b.load(record, kept=kept)
    assert b.memory_source == "recomputed" and not entry.exists()


def test_an_entry_holding_a_tensor_the_model_would_not_is_refused_before_it_is_read(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, record, kept = kept_talk(engine, tmp_path)
    entry = kept.entry_path(record)
    digests = EntryFile.open(entry).data.extra["kept"]
    rewrite(entry, digests, {"junk": torch.zeros(1 << 20, dtype=torch.float16)})
    reads: list[int] = []
    real = EntryFile._read
    monkeypatch.setattr(EntryFile, "_read", lambda self, span: reads.append(span.nbytes) or real(self, span))
    b = engine.new_session()
    b.load(record, kept=kept)
    assert b.memory_source == "recomputed" and not entry.exists() and reads == []


def test_an_entry_that_no_longer_matches_its_conversation_is_ignored(engine: Engine, tmp_path: Path) -> None:
    kept = KeptMemory(tmp_path / "kept")
    a = talk(engine)
    record = tmp_path / "c.spark"
    a.keep(kept, record)  # kept, then the conversation went on without keeping again
    tokens(a.chat("Later words.", GREEDY))
    a.save(record, compact=True)
    b = engine.new_session()
    b.load(record, kept=kept)
    assert b.memory_source == "recomputed" and b.memory.tokens == a.memory.tokens
    other = tmp_path / "other.spark"  # another conversation's entry is another file: nothing to read
    a.save(other, compact=True)
    c = engine.new_session()
    c.load(other, kept=kept)
    assert c.memory_source == "recomputed"


def test_an_entry_of_other_numerics_is_ignored(engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = KeptMemory(tmp_path / "kept")
    a = talk(engine)
    record = tmp_path / "c.spark"
    a.save(record, compact=True)
    a.keep(kept, record)
    b = engine.new_session()
    monkeypatch.setattr(type(b.backend), "numerics", property(lambda self: "other-numerics"), raising=False)
    b.load(record, kept=kept)
    assert b.memory_source == "recomputed"


def test_the_budget_evicts_whole_least_recently_used_conversations_and_clearing_loses_none(
    engine: Engine, tmp_path: Path
) -> None:
    a = talk(engine)
    probe = KeptMemory(tmp_path / "probe")
    a.keep(probe, tmp_path / "probe.spark")
    one = probe.usage().bytes
    kept = KeptMemory(tmp_path / "kept", one * 5 // 2)  # room for two entries, not three
    records = [tmp_path / f"{i}.spark" for i in range(3)]
    for r in records[:2]:
        a.save(r, compact=True)
        assert a.keep(kept, r)
        assert kept.usage().bytes <= kept.budget_bytes
    b = engine.new_session()
    b.load(records[0], kept=kept)  # used: the first is now the most recent
    assert b.memory_source == "kept"
    a.save(records[2], compact=True)
    assert a.keep(kept, records[2])
    assert kept.usage().entries == 2 and kept.usage().bytes <= kept.budget_bytes
    assert kept.entry_path(records[0]).exists() and not kept.entry_path(records[1]).exists()
    kept.set_budget(one // 2)  # smaller than one entry: nothing fits, nothing is written
    assert kept.usage().entries == 0 and not a.keep(kept, records[0])
    assert kept.usage().bytes == 0
    kept.set_budget(10 * one)
    a.keep(kept, records[0])
    assert kept.clear() > 0 and kept.usage().entries == 0
    c = engine.new_session()
    c.load(records[0], kept=kept)  # the conversation is whole: it recomputes
    assert c.memory_source == "recomputed" and c.memory.tokens == a.memory.tokens


def test_a_saved_state_with_a_non_finite_value_is_refused_whatever_its_dtype() -> None:
    import torch

    from engine.memory.values import all_finite

    for dtype in (torch.float16, torch.float32, torch.bfloat16):
        t = torch.full((4096,), 60000.0 if dtype == torch.float16 else 1e30, dtype=dtype)
        assert all_finite(t)
        for bad in (float("inf"), float("-inf"), float("nan")):
            u = t.clone()
            u[1234] = bad
            assert not all_finite(u)


def test_the_default_model_continues_from_kept_memory_as_from_a_replay_and_as_never_left(tmp_path: Path) -> None:
    from tests.helpers.default_model import default_model_dir

    model = default_model_dir()
    engine = Engine.load(model, "cpu", memory_factory=memory_factory_for(model, prefix_cache=False))
    settings = GenerationSettings(max_tokens=8, sampling=SamplingSettings(greedy=True), ignore_eos=True)
    a = engine.new_session()
    tokens(a.chat("Name three things a lighthouse keeper writes in the log.", settings))
    record = tmp_path / "c.spark"
    a.save(record, compact=True)
    kept = KeptMemory(tmp_path / "kept")
    assert a.keep(kept, record)
    from_kept, replayed = engine.new_session(), engine.new_session()
    from_kept.load(record, kept=kept)
    replayed.load(record)
    assert from_kept.memory_source == "kept" and replayed.memory_source == "recomputed"
    never_left = tokens(a.chat("And the weather?", settings))
    assert tokens(from_kept.chat("And the weather?", settings)) == never_left
    assert tokens(replayed.chat("And the weather?", settings)) == never_left


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_background_write_keeps_the_snapshot_taken_while_the_conversation_goes_on(
    engine: Engine, tmp_path: Path
) -> None:
    held = HeldWrites()
    kept = KeptMemory(tmp_path / "kept", fs=held)
    a = talk(engine)
    record = tmp_path / "c.spark"
    a.save(record, compact=True)
    snapshot = list(a.memory.tokens)
    assert a.keep(kept, record, later=True)
    assert held.started.wait(60)  # the write is in flight, held; the conversation goes on meanwhile
    tokens(a.chat("Meanwhile, more.", GREEDY))
    assert list(a.memory.tokens) != snapshot
    held.release.set()
    assert kept.flush(60)
    from_kept, replayed = engine.new_session(), engine.new_session()
    from_kept.load(record, kept=kept)
    replayed.load(record)
    assert from_kept.memory_source == "kept" and from_kept.computed.count == 0
    assert list(from_kept.memory.tokens) == list(replayed.memory.tokens) == snapshot
    assert tokens(from_kept.chat("One more?", GREEDY)) == tokens(replayed.chat("One more?", GREEDY))


def test_close_abandons_a_write_in_flight_and_leaves_no_temp_file(engine: Engine, tmp_path: Path) -> None:
    held = HeldWrites()
    kept = KeptMemory(tmp_path / "kept", fs=held)
    a = talk(engine)
    record = tmp_path / "c.spark"
    assert a.keep(kept, record, later=True)
    assert held.started.wait(60)
    assert any(name.endswith(".tmp") for name in files(kept.folder))  # the temp file being written
    assert not kept.close(0.05)
    assert files(kept.folder) == []  # abandoned at once: its temp file is gone while the writer is still held
    held.release.set()
    assert kept.flush(60)  # the writer stops at its next call
    assert files(kept.folder) == [] and not a.keep(kept, record, later=True)  # closed: nothing more is queued


def test_a_write_in_flight_counts_against_the_budget_and_a_discarded_one_leaves_nothing(
    engine: Engine, tmp_path: Path
) -> None:
    a = talk(engine)
    probe = KeptMemory(tmp_path / "probe")
    a.keep(probe, tmp_path / "probe.spark")
    one = probe.usage().bytes
    held = HeldWrites()
    kept = KeptMemory(tmp_path / "kept", one * 5 // 2, fs=held)
    first, second = tmp_path / "1.spark", tmp_path / "2.spark"
    held.release.set()
    assert a.keep(kept, first)
    held.release.clear()
    held.started.clear()
    assert a.keep(kept, second, later=True)
    assert held.started.wait(60)
    kept.set_budget(one * 3 // 2)  # the entry on disk and the one being written no longer fit together
    assert not kept.entry_path(first).exists()
    kept.discard(second)  # deleted while being written
    held.release.set()
    assert kept.flush(60)
    assert kept.usage().entries == 0 and not any(name.endswith(".tmp") for name in files(kept.folder))


def test_a_newer_snapshot_of_a_conversation_replaces_its_queued_one(engine: Engine, tmp_path: Path) -> None:
    held = HeldWrites()
    kept = KeptMemory(tmp_path / "kept", fs=held)
    a = talk(engine)
    other, record = tmp_path / "other.spark", tmp_path / "c.spark"
    assert a.keep(kept, other, later=True)
    assert held.started.wait(60)  # the writer is busy with another conversation
    assert a.keep(kept, record, later=True)
    queued = kept.pending(record)
    tokens(a.chat("Later.", GREEDY))
    a.save(record, compact=True)
    assert a.keep(kept, record, later=True)
    assert kept.pending(record) is not queued
    held.release.set()
    assert kept.flush(60)
    b = engine.new_session()
    b.load(record, kept=kept)  # the entry holds the newer memory, which matches the record
    assert b.memory_source == "kept" and list(b.memory.tokens) == list(a.memory.tokens)
