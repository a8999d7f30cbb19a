"""One episodic budget shared by several memories (a server's rows, an app's conversations): together they never
hold more than it, each evicting its own coldest blocks, and a memory that resets or goes away frees its share."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine.memory.cascade import CascadeConfig, PersistentStore, SharedBudget
from engine.memory.cascade.episodic import EpisodicMemory

L, HKV, D, B = 2, 2, 16, 8
BLOCK = 2 * L * HKV * B * D * 2 + 2 * L * HKV * D * 4  # fp16 k, v + fp32 key bounds


def _memory(shared: SharedBudget, store: PersistentStore | None = None) -> EpisodicMemory:
    cfg = CascadeConfig(block_size=B, retrieval_blocks=2, episodic_budget_bytes=100 * BLOCK)  # its own: roomy
    return EpisodicMemory(cfg, (L, HKV, D), store, shared)


def _add_blocks(ep: EpisodicMemory, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ep.append(torch.randn(L, HKV, B, D, generator=g).half(), torch.randn(L, HKV, B, D, generator=g).half())


@pytest.mark.parametrize("with_store", [False, True])
def test_two_memories_sharing_a_budget_never_exceed_it_together(tmp_path: Path, with_store: bool) -> None:
    shared = SharedBudget(5 * BLOCK)
    store = PersistentStore(tmp_path / "l3", "fp", "num", 1 << 30) if with_store else None
    a, b = _memory(shared, store), _memory(shared, store)
    for step in range(12):  # interleaved, as two rows of a server fill their memories
        _add_blocks(a, 1, seed=2 * step)
        assert a.charged_bytes + b.charged_bytes <= shared.limit_bytes
        _add_blocks(b, 2, seed=2 * step + 1)
        assert a.charged_bytes + b.charged_bytes <= shared.limit_bytes
        assert shared.used_bytes() == a.charged_bytes + b.charged_bytes
    assert a.counters.evictions > 0 and b.counters.evictions > 0  # each evicted its own
    alone = _memory(SharedBudget(1 << 30))
    _add_blocks(alone, 36, seed=0)
    assert alone.resident == 36  # its own budget alone would have kept them all


def test_each_memory_evicts_its_own_coldest_blocks() -> None:
    shared = SharedBudget(4 * BLOCK)
    a, b = _memory(shared), _memory(shared)
    _add_blocks(a, 3, seed=0)
    a_blocks = dict(a.blocks)
    _add_blocks(b, 3, seed=1)  # b goes over: its own blocks go, a's stay
    assert a.blocks == a_blocks
    assert b.resident == 1 and sorted(b.blocks) == [2]  # its newest: the two older were colder
    assert a.charged_bytes + b.charged_bytes <= shared.limit_bytes


def test_a_reset_or_dropped_memory_frees_its_share() -> None:
    shared = SharedBudget(4 * BLOCK)
    a, b = _memory(shared), _memory(shared)
    _add_blocks(a, 4, seed=0)
    assert shared.used_bytes() == 4 * BLOCK
    a.reset()
    assert shared.used_bytes() == 0
    _add_blocks(a, 4, seed=0)
    del a
    gc.collect()
    assert shared.members == 1 and shared.used_bytes() == 0
    _add_blocks(b, 4, seed=1)
    assert b.resident == 4  # the whole budget is b's now


def test_memories_of_one_factory_share_its_budget(tiny_model: Path) -> None:
    from engine.backends.torch_backend import TorchBackend
    from engine.session.setup import memory_factory_for

    budget = SharedBudget(3 * BLOCK)
    make = memory_factory_for(tiny_model, prefix_cache=False, shared_budget=budget)
    first, second = make(TorchBackend(tiny_model)), make(TorchBackend(tiny_model))
    assert first.episodic.shared is budget and second.episodic.shared is budget  # type: ignore[attr-defined]
    own = memory_factory_for(tiny_model, prefix_cache=False)
    one, two = own(TorchBackend(tiny_model)), own(TorchBackend(tiny_model))
    assert one.episodic.shared is two.episodic.shared is not None  # type: ignore[attr-defined]
    assert one.episodic.shared.limit_bytes == one.cfg.episodic_budget_bytes  # type: ignore[attr-defined]


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="byte count"):
        SharedBudget(-1)
