"""CascadeMemory as a whole: restore-and-continue, prefix reuse across restarts, stats, invalidation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.errors import SessionFileError
from engine.memory.cascade import CascadeConfig, CascadeMemory, PersistentStore
from tests.engine.memory.cascade.helpers import feed, greedy, prefill, random_ids

SMALL = CascadeConfig(sink_tokens=4, window=48, block_size=8, retrieval_blocks=2, reroute_every=4)


@pytest.mark.parametrize(
    ("prompt_len", "n", "routing"),
    [(20, 10, "hybrid"), (100, 30, "hybrid"), (100, 30, "token"), (60, 70, "sequence"), (90, 40, "rolling")],
)
def test_restore_and_continue_is_exact(tiny_model: Path, tmp_path: Path, prompt_len: int, n: int, routing: str) -> None:
    cfg = CascadeConfig(**{**SMALL.to_dict(), "routing": routing, "episodic_budget_bytes": 6 * 4096})
    m_tokens = 25
    ids = random_ids(prompt_len, seed=prompt_len)

    def fresh() -> tuple[TorchBackend, CascadeMemory]:
        b = TorchBackend(tiny_model)
        return b, CascadeMemory(b, cfg, store=PersistentStore(tmp_path / routing, b.fingerprint, b.numerics))

    b1, m1 = fresh()
    want, _ = greedy(b1, m1, prefill(b1, m1, ids, 16), n + m_tokens)

    b2, m2 = fresh()
    first, logits = greedy(b2, m2, prefill(b2, m2, ids, 16), n)
    meta, tensors = m2.state()
    meta = json.loads(json.dumps(meta))  # what a session file stores
    assert all(t.dtype in (torch.float16, torch.float32, torch.float64) for t in tensors.values())
    b3, m3 = fresh()
    m3.load_state(meta, {k: t.clone() for k, t in tensors.items()})
    rest, _ = greedy(b3, m3, logits, m_tokens)
    assert first + rest == want
    assert m3.tokens == m1.tokens[: len(m3.tokens)]
    if prompt_len + n > cfg.sink_tokens + cfg.window:
        assert m3.working.evicted > 0


def test_load_state_adopts_the_saved_geometry_within_the_trained_context(tiny_model: Path) -> None:
    """A state saved under another geometry (an older default, another cascade.json) restores in its own."""
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, SMALL)
    prefill(b, m, random_ids(80), 16)
    meta, tensors = m.state()
    want, _ = greedy(b, m, feed(b, m, [5])[-1], 6)
    ob = TorchBackend(tiny_model)
    other = CascadeMemory(ob, CascadeConfig(sink_tokens=4, window=64, block_size=8, retrieval_blocks=2))
    other.load_state(meta, tensors)
    assert other.cfg == SMALL and ob.num_slots == SMALL.num_slots
    got, _ = greedy(ob, other, feed(ob, other, [5])[-1], 6)
    assert got == want
    too_big = {**meta, "config": {**meta["config"], "window": 100_000}}
    with pytest.raises(SessionFileError):
        CascadeMemory(TorchBackend(tiny_model), SMALL).load_state(too_big, tensors)


def test_prefix_reuse_across_a_restart(tiny_model: Path, tmp_path: Path) -> None:
    ids = random_ids(45, seed=7)
    b1 = TorchBackend(tiny_model)
    m1 = CascadeMemory(b1, SMALL, store=PersistentStore(tmp_path, b1.fingerprint, b1.numerics))
    cold = prefill(b1, m1, ids, 16)
    cold_next, _ = greedy(b1, m1, cold, 20)
    # blocks complete before the window first slid: 5 from the prompt, 1 while generating
    assert m1.stats().persistent.entries == (SMALL.sink_tokens + SMALL.window) // SMALL.block_size

    b2 = TorchBackend(tiny_model)  # a new process: new backend, new store object, same directory
    m2 = CascadeMemory(b2, SMALL, store=PersistentStore(tmp_path, b2.fingerprint, b2.numerics))
    assert m2.reuse_prefix(ids[:-1]) == 40
    logits = feed(b2, m2, ids[40:])[-1]
    torch.testing.assert_close(logits, cold, atol=2e-3, rtol=0)  # L3 holds canonical fp16 KV; the cold run had fp32
    warm_next, _ = greedy(b2, m2, logits, 20)
    assert warm_next == cold_next
    s = m2.stats().persistent
    assert s.hits == 5 and s.misses == 0


def test_prefix_reuse_rejects_another_model(tiny_model: Path, other_model: Path, tmp_path: Path) -> None:
    ids = random_ids(45, seed=7)
    b1 = TorchBackend(tiny_model)
    prefill(b1, CascadeMemory(b1, SMALL, store=PersistentStore(tmp_path, b1.fingerprint, b1.numerics)), ids, 16)
    b2 = TorchBackend(other_model)
    m2 = CascadeMemory(b2, SMALL, store=PersistentStore(tmp_path, b2.fingerprint, b2.numerics))
    assert b2.fingerprint != b1.fingerprint
    assert m2.reuse_prefix(ids[:-1]) == 0


def test_nothing_is_persisted_once_the_window_has_slid(tiny_model: Path, tmp_path: Path) -> None:
    b = TorchBackend(tiny_model)
    store = PersistentStore(tmp_path, b.fingerprint, b.numerics)
    m = CascadeMemory(b, SMALL, store=store)
    for at in range(0, 200, 20):
        feed(b, m, random_ids(20, seed=at))
    # Tokens 0..39 came in forwards that evicted nothing; the chunk 40..59 slid the window, so block 40..47 is
    # not full-attention KV and is not persisted.
    assert store.stats().entries == 40 // SMALL.block_size
    assert m.reuse_prefix(random_ids(200)) == 0  # not empty: no reuse


def test_stats_snapshot(tiny_model: Path, tmp_path: Path) -> None:
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, SMALL, store=PersistentStore(tmp_path, b.fingerprint, b.numerics))
    s = m.stats()
    assert (s.working.entries, s.working.bytes, s.episodic.entries, s.persistent.entries) == (0, 0, 0, 0)
    assert s.working.capacity_bytes == SMALL.num_slots * b.kv_bytes_per_token()
    for at in range(0, 160, 16):
        feed(b, m, random_ids(16, seed=at))
    s = m.stats()
    json.dumps(s.to_dict())
    assert s.working.evictions == 160 - SMALL.sink_tokens - SMALL.window
    assert s.episodic.entries == s.working.evictions // SMALL.block_size
    assert s.working.entries == SMALL.sink_tokens + SMALL.window + m.working.resident_blocks * SMALL.block_size
    assert s.working.bytes == s.working.entries * b.kv_bytes_per_token()
    assert s.persistent.entries == (SMALL.sink_tokens + SMALL.window) // SMALL.block_size
    for tier in (s.working, s.episodic, s.persistent):
        assert tier.hit_rate == (tier.hits / (tier.hits + tier.misses) if tier.hits + tier.misses else 0.0)


def test_invalidate(tiny_model: Path, tmp_path: Path) -> None:
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, SMALL, store=PersistentStore(tmp_path, b.fingerprint, b.numerics))
    for at in range(0, 160, 16):
        feed(b, m, random_ids(16, seed=at))
    m.invalidate("episodic")
    assert m.stats().episodic.entries == 0 and m.working.resident_blocks == 0 and m.tokens
    feed(b, m, [1])
    m.invalidate("persistent")
    assert m.stats().persistent.entries == 0
    m.invalidate()
    assert m.tokens == [] and m.stats().working.entries == 0
    with pytest.raises(ValueError):
        m.invalidate("l4")


def test_invalidating_episodic_keeps_the_conversation_going(tiny_model: Path, tmp_path: Path) -> None:
    cfg = CascadeConfig(**{**SMALL.to_dict(), "episodic_budget_bytes": 3 * 4096})  # forces spills to L3
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, cfg, store=PersistentStore(tmp_path, b.fingerprint, b.numerics))
    for at in range(0, 160, 16):
        feed(b, m, random_ids(16, seed=at))
    m.invalidate("episodic")
    for at in range(160, 400, 16):
        feed(b, m, random_ids(16, seed=at))
    assert m.episodic.blocks and all(blk.l3_key for blk in m.episodic.blocks.values())
    assert min(m.episodic.blocks) > (160 - cfg.sink_tokens - cfg.window) // cfg.block_size - 1


def test_a_detached_attachment_leaves_and_its_ids_are_never_given_again(tiny_model: Path, tmp_path: Path) -> None:
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, SMALL, store=PersistentStore(tmp_path, b.fingerprint, b.numerics))
    shape = tuple(m.episodic.kmin.shape[1:])

    def attach(keys: list[str]) -> int:
        return m.attach(torch.zeros(len(keys), *shape), torch.ones(len(keys), *shape), keys)

    first = attach(["a0", "a1", "a2"])
    second = attach(["b0", "b1"])
    m.detach(first)
    assert m.episodic.pinned == {second, second + 1} and set(m.episodic.blocks) == {second, second + 1}
    third = attach(["c0"])
    assert third == second + 2  # after the last one's ids: never one the remaining attachment holds
    m.reset()  # a new chat adopts what is still attached, and nothing detached
    assert m.episodic.pinned == {second, second + 1, third}
    with pytest.raises(KeyError):
        m.detach(first)
