"""What a cascade state depends on (CascadeConfig.state_settings: never the budgets), restoring under another
machine's budgets, files of the current format written before the cascade split, and every tier's stats."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.memory.cascade import CascadeConfig, CascadeMemory, PersistentStore, TierStats
from engine.memory.cascade.config import BUDGETS
from engine.session.engine import Engine, memory_factory_for
from tests.engine.memory.cascade.helpers import feed, greedy, prefill, random_ids
from tests.helpers.tiny import make_tiny_model

DATA = Path(__file__).parent / "data"
CFG = CascadeConfig(
    sink_tokens=4, window=32, block_size=8, retrieval_blocks=2, routing="token", episodic_budget_bytes=2**30
)


def _changed(cfg: CascadeConfig, name: str) -> CascadeConfig:
    value = getattr(cfg, name)
    return replace(cfg, **{name: "rolling" if name == "routing" else value + 1})


@pytest.mark.parametrize("name", [f.name for f in fields(CascadeConfig)])
def test_budgets_are_the_only_settings_a_state_does_not_depend_on(tiny_model: Path, name: str) -> None:
    """One definition for the snapshot key, the schema and load_state: a memory differing only in a budget
    restores in its own settings; any other difference is the saved state's geometry, which the memory adopts."""
    other = _changed(CFG, name)
    budget = name in BUDGETS
    assert CFG.same_state(other) == budget and (CFG.state_tag() == other.state_tag()) == budget
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, CFG)
    prefill(b, m, random_ids(60), 16)
    meta, tensors = m.state()
    restored = CascadeMemory(TorchBackend(tiny_model), other)
    restored.load_state(json.loads(json.dumps(meta)), tensors)
    assert restored.cfg == (other if budget else CFG.with_budgets_of(other))
    assert restored.tokens == m.tokens


def _run(
    tiny_model: Path, cfg: CascadeConfig, store: PersistentStore | None = None
) -> tuple[TorchBackend, CascadeMemory, torch.Tensor]:
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, cfg, store=store)
    logits = prefill(b, m, random_ids(200, seed=4), 16)
    _, logits = greedy(b, m, logits, 10)
    return b, m, logits


def test_a_state_restores_under_other_budgets(tiny_model: Path, tmp_path: Path) -> None:
    """Saved where the episodic budget held every block; restored where it holds fewer: the blocks over the new
    budget spill to L3 (lowest priority first) and page back in when routed, so the conversation continues exactly;
    without a store they are forgotten instead. Never refused, never over budget."""
    b1, m1, logits = _run(tiny_model, replace(CFG, persistent_budget_bytes=2**32))
    meta, tensors = m1.state()
    meta = json.loads(json.dumps(meta))
    want, _ = greedy(b1, m1, logits, 40)
    ep = m1.episodic
    blocks = {blk[0]: blk[3] + 8 * blk[4] for blk in meta["episodic"]["blocks"]}  # id -> priority (LRU + frequency)
    assert len(blocks) >= 8 and all(blk[5] for blk in meta["episodic"]["blocks"])
    # Stubs may take a quarter of the budget: the least that keeps every block (as a stub if not resident).
    small = 4 * len(blocks) * ep.rep_bytes
    assert small < ep.bytes

    cfg = replace(CFG, episodic_budget_bytes=small, persistent_budget_bytes=2**24)
    b2 = TorchBackend(tiny_model)
    store = PersistentStore(tmp_path / "l3", b2.fingerprint, b2.numerics, cfg.persistent_budget_bytes)
    m2 = CascadeMemory(b2, cfg, store=store)
    m2.load_state(meta, {k: t.clone() for k, t in tensors.items()})
    assert m2.cfg == cfg and m2.episodic.bytes <= small
    assert set(m2.episodic.blocks) == set(blocks)  # every block kept ...
    stubs = [blk for blk in m2.episodic.blocks.values() if blk.k is None]
    assert len(stubs) == len(blocks) - m2.episodic.resident > 0 and all(
        blk.l3_key in store for blk in stubs
    )  # ... on disk
    kept = [blocks[i] for i, blk in m2.episodic.blocks.items() if blk.k is not None]
    assert min(kept) >= max(blocks[blk.id] for blk in stubs)
    got, _ = greedy(b2, m2, logits, 40)
    assert got == want
    assert (
        m2.episodic.bytes <= small and m2.episodic.counters.misses > 0 and store.stats().hits > 0
    )  # paged back from L3

    b3 = TorchBackend(tiny_model)
    m3 = CascadeMemory(b3, cfg)  # no store: the blocks over budget are forgotten, lowest priority first
    m3.load_state(meta, {k: t.clone() for k, t in tensors.items()})
    assert m3.episodic.bytes <= small and 0 < len(m3.episodic.blocks) < len(blocks)
    forgotten = set(blocks) - set(m3.episodic.blocks)
    assert min(blocks[i] for i in m3.episodic.blocks) >= max(blocks[i] for i in forgotten)
    out, _ = greedy(b3, m3, logits, 12)
    assert len(out) == 12 and m3.episodic.bytes <= small

    b4 = TorchBackend(tiny_model)
    m4 = CascadeMemory(b4, replace(CFG, episodic_budget_bytes=2**31, persistent_budget_bytes=2**20))
    m4.load_state(meta, {k: t.clone() for k, t in tensors.items()})
    assert m4.episodic.resident == len(blocks)
    assert greedy(b4, m4, logits, 40)[0] == want


def test_a_format_2_state_written_before_the_split_restores_and_continues(tiny_model: Path) -> None:
    """tests/engine/memory/cascade/data/cascade_state_v2.* was written by the code before the cascade split (commit
    82e0720: token routing, 150 tokens fed in chunks of 10, then 5 greedy tokens, on this tiny model), with the
    fields the state no longer writes ("stats", routing.last_*). It restores and continues as that code did."""
    meta = json.loads((DATA / "cascade_state_v2.json").read_text())
    tensors = load_file(str(DATA / "cascade_state_v2.safetensors"))
    assert meta["version"] == 2 and "stats" in meta and "last_slots" in meta["routing"]
    cfg = CascadeConfig(
        sink_tokens=4, window=32, block_size=8, retrieval_blocks=2, routing="token", episodic_budget_bytes=6 * 4096
    )
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, cfg)
    m.load_state(meta, tensors)
    assert m.tokens == meta["tokens"] and len(m.episodic.blocks) == len(meta["episodic"]["blocks"])
    out, _ = greedy(b, m, feed(b, m, [38])[-1], 7)  # 38: the old code's next greedy token
    assert out == [253, 177, 177, 177, 177, 177, 177]  # what the old code generated after it
    again, _ = m.state()
    assert "stats" not in again and set(again["routing"]) == {"since_route", "recent_tokens"}


def test_every_tier_reports_the_same_stats(tiny_model: Path, tmp_path: Path) -> None:
    """Each tier object reports its own TierStats; under budget pressure every one has hits and evictions."""
    b = TorchBackend(tiny_model)
    probe = CascadeMemory(b, CFG)
    block_bytes = probe.episodic.block_bytes
    cfg = replace(CFG, episodic_budget_bytes=6 * block_bytes)
    store = PersistentStore(tmp_path, b.fingerprint, b.numerics, 12 * block_bytes)
    m = CascadeMemory(b, cfg, store=store)
    for at in range(0, 400, 20):
        feed(b, m, random_ids(20, seed=at))
    for t in range(40):
        feed(b, m, [3 + t])
        assert m.episodic.bytes <= cfg.episodic_budget_bytes  # even when every resident block is in a group
    s = m.stats()
    assert s.working == m.working.stats(b.kv_bytes_per_token())
    assert s.episodic == m.episodic.stats() and s.persistent == store.stats()
    for name, tier in (("working", s.working), ("episodic", s.episodic), ("persistent", s.persistent)):
        assert isinstance(tier, TierStats) and tier.name == name
        assert 0 < tier.bytes <= tier.capacity_bytes and tier.entries > 0
        assert tier.hits > 0 and tier.evictions > 0
        assert tier.hit_rate == tier.hits / (tier.hits + tier.misses)
    assert s.working.capacity_bytes == cfg.num_slots * b.kv_bytes_per_token()
    assert (s.episodic.capacity_bytes, s.persistent.capacity_bytes) == (cfg.episodic_budget_bytes, store.budget_bytes)


def test_a_session_file_restores_under_another_machines_budgets(tmp_path: Path) -> None:
    """A .spark saved where the episodic budget is large opens where it is small (another machine's RAM), with
    blocks over it spilled to L3: every step after it gives the logits the original memory gives."""
    model = make_tiny_model(tmp_path / "m", max_positions=512)
    geometry = {"window": 32, "block_size": 8, "retrieval_blocks": 2, "routing": "token"}
    long = GenerationSettings(max_tokens=480, sampling=SamplingSettings(greedy=True), ignore_eos=True)

    def engine(cache: str, episodic: int, persistent: int) -> Engine:
        factory = memory_factory_for(
            model,
            cache_dir=tmp_path / cache,
            episodic_budget_bytes=episodic,
            persistent_budget_bytes=persistent,
            **geometry,
        )
        return Engine.load(model, "cpu", memory_factory=factory)

    s = engine("l3-a", 2**30, 2**30).new_session()
    list(s.chat("the first turn, long enough to leave the window", long))
    original = s.memory
    assert isinstance(original, CascadeMemory)
    ep = original.episodic
    assert len(ep.blocks) >= 40 and ep.resident == len(ep.blocks)
    # Stubs may use a quarter of the budget: room for every block, those formed below included (a block forgotten
    # for the budget changes what later steps recall, as it would have on that machine from the start).
    small = 4 * (len(ep.blocks) + 8) * ep.rep_bytes
    assert small < ep.bytes
    path = tmp_path / "talk.spark"
    s.save(path)

    t = engine("l3-b", small, 2**24).new_session()
    report = t.load(path)
    restored = t.memory
    assert report.applied and not report.foreign_model and isinstance(restored, CascadeMemory)
    assert restored.cfg == original.cfg.with_budgets_of(
        replace(original.cfg, episodic_budget_bytes=small, persistent_budget_bytes=2**24)
    )
    assert restored.episodic.bytes <= small and restored.episodic.stubs > 0
    for step in range(40):
        ids = [3 + (7 * step) % 200]
        assert torch.equal(feed(t.backend, restored, ids), feed(s.backend, original, ids))
    assert restored.episodic.bytes <= small  # (paging stubs back exactly: test_a_state_restores_under_other_budgets)
