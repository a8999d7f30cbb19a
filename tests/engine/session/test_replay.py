"""Compact session files (the feed recipe replayed on open) and Stop while a prompt is read."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from engine.errors import SessionFileError
from engine.generation.loop import GenerationSettings, PrefillProgress, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.session.engine import Engine
from engine.session.file import inspect_session, load_session, restore
from engine.session.replay import FeedLog, check_schedule, memory_digest
from tests.helpers.small_window import event_tokens as tokens
from tests.helpers.small_window import small_window_engine
from tests.helpers.tiny import make_tiny_model

GREEDY = GenerationSettings(max_tokens=24, sampling=SamplingSettings(greedy=True), ignore_eos=True, prefill_chunk=16)
SEEDED = GenerationSettings(
    max_tokens=24, sampling=SamplingSettings(seed=5, temperature=1.2), ignore_eos=True, prefill_chunk=16
)
LONG = "The memory cascade keeps sinks, a window and recalled blocks. " * 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("replay") / "m")


@pytest.fixture
def engine(model: Path, tmp_path: Path) -> Engine:
    return small_window_engine(
        model, tmp_path / "l3"
    )  # episodic blocks and routing state: a compact file rebuilds them


@pytest.mark.parametrize("settings", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_compact_file_restores_exactly(engine: Engine, tmp_path: Path, settings: GenerationSettings) -> None:
    a = engine.new_session()
    for text in (LONG, "And then?", LONG[:90]):
        tokens(a.chat(text, settings))
    assert a.stats().episodic.entries > 0  # the window overflowed: recalled memory exists
    compact, full = tmp_path / "c.spark", tmp_path / "f.spark"
    a.save(compact, compact=True)
    a.save(full)
    assert compact.stat().st_size * 5 < full.stat().st_size
    assert inspect_session(compact)["tensor_bytes"] == 0 and inspect_session(compact)["memory_kind"] == "recompute"
    seen: list[tuple[int, int]] = []
    b = engine.new_session()
    report = b.load(compact, on_progress=lambda done, total: seen.append((done, total)))
    assert b.restore_digest_ok is True and "identical" in report.message
    assert b.memory.tokens == a.memory.tokens and b.pending_token == a.pending_token
    assert seen and seen[-1][0] == seen[-1][1] == len(a.memory.tokens)
    # Continuing the restored conversation gives the same tokens as never having stopped.
    assert tokens(b.chat("One more?", settings)) == tokens(a.chat("One more?", settings))
    # A restored compact conversation keeps its recipe: it saves compact again.
    b.save(tmp_path / "again.spark", compact=True)
    assert inspect_session(tmp_path / "again.spark")["tensor_bytes"] == 0


def test_a_compact_file_restored_elsewhere_keeps_its_recipe_after_a_full_save(engine: Engine, tmp_path: Path) -> None:
    a = engine.new_session()
    tokens(a.chat("hello there", GREEDY))
    a.save(tmp_path / "full.spark")  # a full file carries the recipe too
    b = engine.new_session()
    b.load(tmp_path / "full.spark")
    b.save(tmp_path / "compact.spark", compact=True)
    c = engine.new_session()
    c.load(tmp_path / "compact.spark")
    assert c.restore_digest_ok is True and c.memory.tokens == a.memory.tokens


def test_a_tampered_recipe_is_refused_in_one_sentence(engine: Engine, tmp_path: Path) -> None:
    a = engine.new_session()
    tokens(a.chat("hello", GREEDY))
    path = tmp_path / "c.spark"
    a.save(path, compact=True)
    data = load_session(path)
    from engine.session.file import save_session

    bad = dict(data.extra, feed_schedule=[["f", 10_000, 1]])
    save_session(
        tmp_path / "bad.spark",
        fingerprint=data.fingerprint,
        tokenizer_hash=data.tokenizer_hash,
        messages=data.messages,
        system_prompt=data.system_prompt,
        settings=data.settings,
        memory_state=data.memory_state,
        pending_token=data.pending_token,
        sampler_state=data.sampler_state,
        extra=bad,
        token_ids=data.token_ids,
    )
    b = engine.new_session()
    with pytest.raises(SessionFileError, match="malformed memory recipe"):
        b.load(tmp_path / "bad.spark")
    assert b.memory.tokens == []  # nothing applied
    with pytest.raises(SessionFileError, match="compact"):
        restore(path, engine.backend.fork(), engine.memory_factory)  # a reader without a recompute step says so


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "x",
        [["f", 1]],
        [["g", 1, 1]],
        [["f", 0, 1]],
        [["f", 1, -1]],
        [["r", 2, 2]],
        [["f", True, 1]],
        [["f", 3, 1]],
        [["f", 1, 1]],
    ],
)
def test_malformed_schedules_are_refused(raw: object) -> None:
    with pytest.raises(SessionFileError):
        check_schedule(raw, 2)


def test_the_memory_digest_is_sha256_over_names_shapes_and_raw_bytes(engine: Engine) -> None:
    """The digest a compact file stores: saved files keep verifying however it is computed."""
    session = engine.new_session()
    tokens(session.chat(LONG, GREEDY))  # past the window: episodic blocks and routing state in the memory too
    _, tensors = session.memory.state()
    assert {t.dtype for t in tensors.values()} == {torch.float16, torch.float32}  # KV, and the routing summaries
    want = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        want.update(name.encode())
        want.update(str(tuple(t.shape)).encode())
        want.update(bytes(t.reshape(-1).view(torch.uint8).tolist()))
    assert memory_digest(session.memory) == want.hexdigest()


def test_the_feed_log_counts_reuse_and_runs() -> None:
    log = FeedLog()
    log.record_feed(40, 8)  # 32 tokens came from the prefix cache before this feed
    log.record_feed(48, 8)
    log.record_feed(49, 1)
    log.record_feed(50, 1)
    assert log.schedule_for(50) == [["r", 32, 1], ["f", 8, 2], ["f", 1, 2]]
    assert log.schedule_for(51) is None  # does not add up: a compact save would keep the full memory
    assert check_schedule(log.schedule_for(50), 50)


def test_stop_while_reading_acts_within_one_chunk_and_emits_no_token(engine: Engine) -> None:
    s = engine.new_session()
    ids = engine.tokenizer.encode(LONG * 2)
    assert len(ids) > 3 * GREEDY.prefill_chunk
    read: list[PrefillProgress] = []

    def stop() -> bool:
        return len(read) >= 2

    events = list(
        stream_generate(s.backend, s.memory, engine.tokenizer, ids, GREEDY, should_stop=stop, on_prefill=read.append)
    )
    assert [(e.token, e.text, e.finish_reason) for e in events] == [(None, "", "cancelled")]
    assert len(s.memory.tokens) == GREEDY.prefill_chunk  # exactly one chunk was read after Stop was asked for
    assert [p.done for p in read] == [0, GREEDY.prefill_chunk] and read[-1].total == len(ids)


def test_a_session_stopped_while_reading_goes_on_cleanly(engine: Engine) -> None:
    s = engine.new_session()
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    assert tokens(s.chat(LONG * 2, GREEDY, stop)) == []
    assert [m.role for m in s.messages] == ["user"]  # no empty reply was left behind
    reply = tokens(s.chat("Shorter, please.", GREEDY))
    assert len(reply) == GREEDY.max_tokens
    # The memory now holds the whole conversation, as if the stopped reading had finished.
    asked = [m.as_template_dict() for m in s.messages[:-1]]
    rendered = engine.tokenizer.apply_chat_template(asked, add_generation_prompt=True)
    assert engine.tokenizer.decode(list(s.memory.tokens), skip_special=False).startswith(rendered)


def test_read_transcript_brings_memory_in_step_without_replying(engine: Engine) -> None:
    a = engine.new_session()
    tokens(a.chat("first question", GREEDY))
    b = engine.new_session()
    b.messages = list(a.messages)
    b.read_transcript()
    assert b.pending_token is None and len(b.messages) == 2
    rendered = engine.tokenizer.apply_chat_template(b._template_messages(), add_generation_prompt=False)
    assert engine.tokenizer.decode(list(b.memory.tokens), skip_special=False) == rendered
    held = list(b.memory.tokens)
    tokens(b.chat("second", GREEDY))
    assert b.memory.tokens[: len(held)] == held and len(b.memory.tokens) > len(held)  # extended, not re-read


def test_a_compact_save_without_digest_restores_and_claims_nothing(engine: Engine, tmp_path: Path) -> None:
    """`digest=False` (the app's save on Quit): the file restores exactly as with one, and the restore says
    nothing about bit-identity (it has nothing to compare)."""
    session = engine.new_session()
    list(session.chat(LONG, GREEDY))
    path = tmp_path / "quick.spark"
    session.save(path, compact=True, digest=False)
    again = engine.new_session()
    report = again.load(path)
    assert report.applied and list(again.memory.tokens) == list(session.memory.tokens)
    assert again.restore_digest_ok is None
    assert list(again.chat("Go on", GREEDY)) and list(session.chat("Go on", GREEDY))
    assert again.messages[-1].content == session.messages[-1].content  # and it goes on the same way
