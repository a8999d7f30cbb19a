"""The engine façade: incremental turns, files that restore or refuse without harm, shared weights across threads."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.backends.blocks import resident_weight_bytes
from engine.backends.torch_backend import TorchBackend
from engine.errors import InputTooLarge, InsufficientMemory, SessionFileError
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.hw import HardwarePolicy
from engine.hw.memory import MemoryPressure, MemorySnapshot, format_bytes
from engine.hw.policy import PolicyConfig
from engine.memory.cascade import CascadeConfig
from engine.model.slots import GROWTH_SLOTS, KVCache
from engine.session.engine import Engine, memory_factory_for
from engine.session.setup import MIN_SLOT_TABLE
from tests.engine.hw.fakes import GB, FakeMemory, FakeThermal
from tests.helpers.small_window import event_tokens as reply
from tests.helpers.small_window import small_window_engine
from tests.helpers.tiny import make_tiny_model

GREEDY = GenerationSettings(max_tokens=12, sampling=SamplingSettings(greedy=True), ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sess") / "m")


@pytest.fixture
def engine(model: Path, tmp_path: Path) -> Engine:
    return small_window_engine(model, tmp_path / "l3")


def test_turns_are_fed_incrementally_and_equal_a_full_recompute(engine: Engine) -> None:
    a = engine.new_session()
    reply(a.chat("hello", GREEDY))
    held = [*a.memory.tokens, a.pending_token]  # what the memory holds after turn 1, the unfed last token too
    second = reply(a.chat("and then?", GREEDY))
    # Turn 2 extended the memory instead of re-reading the conversation...
    assert a.memory.tokens[: len(held)] == held
    # ...and equals feeding exactly those ids to a fresh conversation in one go.
    fed = a.memory.tokens[: len(a.memory.tokens) - (len(second) - 1)]
    assert reply(engine.new_session().complete_ids(fed, GREEDY)) == second


def test_new_chat_restarts_a_seeded_stream(engine: Engine) -> None:
    s = engine.new_session()
    seeded = GenerationSettings(max_tokens=10, sampling=SamplingSettings(seed=3, temperature=1.0), ignore_eos=True)
    first = reply(s.chat("hi", seeded))
    s.reset()
    assert reply(s.chat("hi", seeded)) == first


def test_regenerate_replaces_the_last_reply(engine: Engine) -> None:
    s = engine.new_session()
    reply(s.chat("hi", GREEDY))
    assert [m.role for m in s.messages] == ["user", "assistant"]
    reply(s.regenerate(GREEDY))
    assert [m.role for m in s.messages] == ["user", "assistant"]


def test_a_bad_file_leaves_the_conversation_intact(engine: Engine, tmp_path: Path) -> None:
    s = engine.new_session()
    reply(s.chat("hello", GREEDY))
    before = (list(s.memory.tokens), [m.content for m in s.messages], s.pending_token)
    bad = tmp_path / "bad.spark"
    bad.write_bytes(b"SPARK\x00" + b"\x07" * 100)
    for path in (bad, tmp_path, tmp_path / "missing.spark"):
        with pytest.raises(SessionFileError):
            s.load(path)
    assert (list(s.memory.tokens), [m.content for m in s.messages], s.pending_token) == before
    # ...and it still continues exactly as an untouched twin does.
    twin = engine.new_session()
    reply(twin.chat("hello", GREEDY))
    assert reply(s.chat("more", GREEDY)) == reply(twin.chat("more", GREEDY))


def test_a_file_from_another_model_restores_the_transcript_only_when_accepted(engine: Engine, tmp_path: Path) -> None:
    other_dir = make_tiny_model(tmp_path / "other", seed=9)
    other = Engine.load(other_dir, "cpu", memory_factory=memory_factory_for(other_dir, cache_dir=tmp_path / "l3o"))
    o = other.new_session()
    reply(o.chat("from the other model", GREEDY))
    o.save(tmp_path / "o.spark")
    s = engine.new_session()
    report = s.load(tmp_path / "o.spark")
    assert not report.applied and report.foreign_model and "different model" in report.message and s.messages == []
    report = s.load(tmp_path / "o.spark", accept_transcript_only=True)
    assert report.applied and report.transcript_only and s.messages[0].content == "from the other model"
    assert s.memory.tokens == []  # no foreign KV applied; the next turn re-reads the transcript
    assert reply(s.chat("go on", GREEDY))


def test_two_conversations_on_shared_weights_interleave_without_interference(engine: Engine) -> None:
    alone = [reply(engine.new_session().chat(p, GREEDY)) for p in ("first prompt", "second one")]
    sessions = [engine.new_session(), engine.new_session()]
    results: list[list[int]] = [[], []]

    def work(i: int, prompt: str) -> None:
        results[i] = reply(sessions[i].chat(prompt, GREEDY))

    threads = [threading.Thread(target=work, args=(i, p)) for i, p in enumerate(("first prompt", "second one"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == alone


def need_of(model: Path) -> tuple[int, int, int]:
    """The fit check's figures for `model` on the cpu backend, computed here from the backend's own reports and the
    slot table the cascade builds (a budget too small for more gets the least table, MIN_SLOT_TABLE slots), grown
    to every slot and read through PyTorch: the most a conversation's table may hold."""
    b = TorchBackend(model, "cpu")
    slots = CascadeConfig.for_model(model, b.config, max_slots=MIN_SLOT_TABLE).num_slots
    table = KVCache(b.config, 1, slots, "cpu", torch.float16, torch.float32)
    table.reserve(slots, read_copies=True)
    kv = sum(t.numel() * t.element_size() for t in table.slot_tensors())
    return resident_weight_bytes(b.model), kv, slots


def test_a_model_that_cannot_fit_is_refused_with_the_backends_own_figures(model: Path) -> None:
    weights, kv, slots = need_of(model)
    # The tiny model (PyTorch steps: no native kernels for its fp32 weights): k and v of 2 layers x 2 KV heads x
    # 16 dims per slot, fp16, and read copies: rotated keys in fp32, values in fp16 (no fp32 copy of the values).
    assert kv == slots * 2 * 2 * 16 * (2 + 2 + 4 + 2) and slots == MIN_SLOT_TABLE
    tiny_ram = FakeMemory(
        MemorySnapshot(rss_bytes=GB, total_bytes=64 * 1024, available_bytes=32 * 1024, pressure=MemoryPressure.NORMAL)
    )
    policy = HardwarePolicy(FakeThermal(), tiny_ram)
    with pytest.raises(InsufficientMemory) as err:
        Engine.load(model, "cpu", memory_factory=memory_factory_for(model), policy=policy)
    assert (
        f"needs {format_bytes(weights + kv)} ({format_bytes(weights)} of weights and {format_bytes(kv)} of KV cache)"
        in str(err.value)
    )


@pytest.mark.parametrize("spare", [0, -1])
def test_the_fit_check_admits_exactly_what_fits(model: Path, spare: int) -> None:
    weights, kv, _ = need_of(model)
    room = weights + kv + spare
    ram = FakeMemory(
        MemorySnapshot(rss_bytes=GB, total_bytes=16 * GB, available_bytes=room, pressure=MemoryPressure.NORMAL)
    )
    policy = HardwarePolicy(FakeThermal(), ram, config=PolicyConfig(budget_bytes=room))
    if spare < 0:
        with pytest.raises(InsufficientMemory):
            Engine.load(model, "cpu", memory_factory=memory_factory_for(model), policy=policy)
    else:
        assert (
            Engine.load(model, "cpu", memory_factory=memory_factory_for(model), policy=policy).backend.weight_bytes
            == weights
        )


def test_policy_sizes_the_episodic_tier(model: Path, tmp_path: Path) -> None:
    policy = HardwarePolicy(FakeThermal(), FakeMemory())
    engine = Engine.load(
        model, "cpu", memory_factory=memory_factory_for(model, cache_dir=tmp_path, policy=policy), policy=policy
    )
    s = engine.new_session()
    working = s.memory.cfg.num_slots * s.backend.slot_bytes_per_token()  # the most one row's table may grow to
    assert s.memory.cfg.episodic_budget_bytes == policy.episodic_budget_bytes(s.backend.weight_bytes, working)


def test_a_fresh_chat_holds_the_slots_it_uses_not_the_trained_context(model: Path, tmp_path: Path) -> None:
    engine = Engine.load(model, "cpu", memory_factory=memory_factory_for(model, cache_dir=tmp_path))
    s = engine.new_session()
    cache = s.backend.cache
    assert cache.num_slots >= 1024 and cache.capacity == 0  # the trained context is addressable, nothing held yet
    reply(s.chat("hello there", GREEDY))
    used = len(s.memory.tokens)
    # Sinks, the (empty) retrieval groups and the window's first tokens, in one growth block: not num_slots.
    last = s.memory.working.window_start + used
    assert last <= cache.capacity < last + GROWTH_SLOTS and cache.capacity < cache.num_slots // 2
    assert s.backend.kv_resident_bytes() == cache.allocated_bytes() < cache.num_slots * s.backend.slot_bytes_per_token()
    # Saving reads the memory's whole state (every addressable slot, for its digest): the table does not grow.
    held = cache.capacity
    s.save(tmp_path / "fresh.spark", compact=True, digest=True)
    assert cache.capacity == held
    # A long turn grows it in blocks, and what it held before is kept (the conversation goes on exactly).
    before = cache.k[:, :, :, :used].clone()
    reply(s.chat("word " * 300, GREEDY))
    assert cache.capacity >= s.memory.working.window_start + len(s.memory.tokens) > last + GROWTH_SLOTS
    assert torch.equal(cache.k[:, :, :, :used], before)


def test_huge_prompt_is_refused_and_nothing_changes(engine: Engine) -> None:
    s = engine.new_session()
    with pytest.raises(InputTooLarge):
        s.chat("x" * 10_000_000, GREEDY)
    assert s.messages == [] and s.memory.tokens == []


def test_memory_pressure_spills_the_episodic_tier_between_turns(model: Path, tmp_path: Path) -> None:
    memory = FakeMemory()
    policy = HardwarePolicy(FakeThermal(), memory)
    factory = memory_factory_for(
        model,
        cache_dir=tmp_path,
        policy=policy,
        window=32,
        block_size=8,
        retrieval_blocks=2,
        episodic_budget_bytes=2**24,
    )
    s = Engine.load(model, "cpu", memory_factory=factory, policy=policy).new_session()
    long = GenerationSettings(max_tokens=120, sampling=SamplingSettings(greedy=True), ignore_eos=True)
    reply(s.chat("fill the episodic tier", long))
    assert any(b.k is not None for b in s.memory.episodic.blocks.values())
    memory.snap = MemorySnapshot(GB, 16 * GB, GB // 4, MemoryPressure.CRITICAL)
    reply(s.chat("next turn", GenerationSettings(max_tokens=2, sampling=SamplingSettings(greedy=True))))
    assert policy.under_pressure()
    # The episodic KV resident before this turn went to disk; only blocks formed during the turn may be resident.
    assert s.memory.episodic.stubs > 0
