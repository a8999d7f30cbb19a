"""L1: exactness while the conversation fits, bounded positions and memory once it does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.errors import InputTooLarge
from engine.memory.base import FullAttentionMemory
from engine.memory.cascade import CascadeConfig, CascadeMemory
from engine.memory.cascade.config import CascadeConfigError
from engine.model.config import ModelConfig
from tests.engine.memory.cascade.helpers import feed, random_ids

SMALL = CascadeConfig(sink_tokens=4, window=64, block_size=8, retrieval_blocks=2, reroute_every=4)


def test_slot_table_is_padded_to_32_and_fits_the_context(tiny_model: Path) -> None:
    c = CascadeConfig.for_model(tiny_model, ModelConfig.from_file(tiny_model / "config.json"))
    assert c.used_slots <= 512 and c.num_slots % 32 == 0 and c.num_slots >= c.used_slots
    assert c.window < 512  # shrunk: 4 + 4*64 + 512 would exceed the tiny model's 512 positions


def test_cascade_json_is_read_and_validated(tmp_path: Path, tiny_model: Path) -> None:
    cfg = ModelConfig.from_file(tiny_model / "config.json")
    (tmp_path / "cascade.json").write_text(json.dumps({"window": 128, "routing": "token"}))
    c = CascadeConfig.for_model(tmp_path, cfg)
    assert (c.window, c.routing) == (128, "token")
    (tmp_path / "cascade.json").write_text(json.dumps({"windw": 128}))
    with pytest.raises(CascadeConfigError):
        CascadeConfig.for_model(tmp_path, cfg)


def test_exact_against_full_attention_prefill_and_decode(tiny_model: Path) -> None:
    # fp32 KV: the PyTorch path's read copies are in the table's dtype, and an fp16 copy of a key rotated in the
    # cascade's frame rounds differently from one rotated at its plain position (the math is what is compared).
    cb, fb = TorchBackend(tiny_model, kv_dtype=torch.float32), TorchBackend(tiny_model, kv_dtype=torch.float32)
    fb.allocate(1, 128)
    cm, fm = CascadeMemory(cb, SMALL), FullAttentionMemory(fb)
    ids = random_ids(SMALL.sink_tokens + SMALL.window)  # exactly fills sinks + window
    for at in range(0, 48, 16):
        torch.testing.assert_close(
            feed(cb, cm, ids[at : at + 16]), feed(fb, fm, ids[at : at + 16]), atol=1e-5, rtol=1e-5
        )
    for tok in ids[48:]:
        torch.testing.assert_close(feed(cb, cm, [tok]), feed(fb, fm, [tok]), atol=1e-5, rtol=1e-5)
    assert cm.working.evicted == 0


def test_exact_against_transformers(tiny_model: Path) -> None:
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    ids = random_ids(60, seed=3)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]  # (T, V)
    b = TorchBackend(tiny_model, kv_dtype=torch.float32)  # fp32 KV: compare the math at fp32 tolerance
    m = CascadeMemory(b, SMALL)
    got = torch.cat([feed(b, m, ids[:40]), *(feed(b, m, [t]) for t in ids[40:])])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_step_reads_only_the_slots_up_to_the_last_one_held(tiny_model: Path) -> None:
    """A prefill's attention costs what the memory holds, not the whole table (SlotBatch's S')."""
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, SMALL)
    w = m.working
    plan = m.plan(random_ids(20))  # the 4 sinks, then 16 window slots after the retrieval groups'
    assert plan.mask.shape == (20, w.window_start + 16) and plan.slot_positions.shape == (w.window_start + 16,)
    assert w.window_start + 16 < b.num_slots
    assert not bool(plan.mask[-1].all())  # the empty retrieval slots inside the extent stay masked
    assert int(plan.mask.any(0).nonzero()[-1]) == w.window_start + 15  # the extent ends at the last slot written


def test_positions_and_memory_stay_bounded(tiny_model: Path) -> None:
    cfg = CascadeConfig(
        sink_tokens=4, window=32, block_size=8, retrieval_blocks=2, reroute_every=4, episodic_budget_bytes=64 * 1024
    )
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, cfg)
    ids = random_ids(3000, seed=1)
    for at in range(0, 1000, 25):
        feed(b, m, ids[at : at + 25])
        assert int(m.working.slot_positions[m.working.valid].max()) < cfg.used_slots
    for tok in ids[1000:]:
        plan = m.plan([tok])
        assert int(plan.positions.max()) < cfg.used_slots
        b.forward(torch.tensor([[tok]]), plan.as_batch())
        m.after_forward()
    assert b.num_slots == cfg.num_slots
    assert m.episodic.bytes <= cfg.episodic_budget_bytes
    assert m.episodic.kmin.shape[0] <= m.episodic.max_rows
    assert not m.prefix.prefix_digests  # nothing keyed past the pure prefix: no state grows with the conversation
    s = m.stats()
    assert s.working.evictions == 3000 - cfg.sink_tokens - cfg.window
    assert s.episodic.evictions > 0 and s.working.hits + s.working.misses > 0


def test_window_positions_are_dense_after_retrieval(tiny_model: Path) -> None:
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, SMALL)
    for at in range(0, 400, 20):
        feed(b, m, random_ids(20, seed=at))
    w = m.working
    assert w.resident_blocks == SMALL.retrieval_blocks
    held = w.slot_positions[w.valid].sort().values
    assert held.tolist() == list(range(w.held_tokens))  # sinks, blocks, window: one dense run from 0


def test_a_step_larger_than_the_window_is_refused(tiny_model: Path) -> None:
    m = CascadeMemory(TorchBackend(tiny_model), SMALL)
    with pytest.raises(InputTooLarge):
        m.plan(random_ids(SMALL.window + 1))
