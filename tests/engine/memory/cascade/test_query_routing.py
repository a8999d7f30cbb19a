"""Query-aware per-layer retrieval: every forward's query summary (PyTorch and native step alike), per-layer
selection and paging, re-routing on drift, the prompt's routed tail, geometry from the model's context, and the
migration of format-1 states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import decode_step, prefill
from engine.memory.base import FullAttentionMemory
from engine.memory.cascade import CascadeConfig, CascadeMemory
from engine.memory.cascade.core import TAIL_STEP, TAIL_STEPS
from engine.model.config import ModelConfig
from tests.engine.memory.cascade.helpers import feed, greedy, random_ids
from tests.helpers.steered import SteeredBackend
from tests.helpers.timers import NativeStepCounter
from tests.helpers.tiny import make_tiny_model

DATA = Path(__file__).parent / "data"


def test_summary_is_the_mean_pre_rope_query_of_each_kv_group(tiny_model: Path) -> None:
    b = TorchBackend(tiny_model)
    c = b.config
    m = CascadeMemory(b, CascadeConfig(sink_tokens=4, window=32, block_size=8, retrieval_blocks=1))
    ids = random_ids(12, seed=3)
    feed(b, m, ids)
    got = b.query_summary()
    assert got.shape == (1, c.num_hidden_layers, c.num_key_value_heads, c.head_dim) and got.dtype == torch.float32
    layer = b.model.model.layers[0]  # layer 0's input is the embedding: its queries can be recomputed here
    with torch.inference_mode():
        x = layer.input_layernorm(b.model.model.embed_tokens(torch.tensor([ids])))
        q = layer.self_attn.project(x)[0]  # (1, T, H*D), pre-RoPE, bias included
    g = c.num_attention_heads // c.num_key_value_heads
    want = q.view(1, len(ids), c.num_key_value_heads, g, c.head_dim).mean(dim=(1, 3))  # (1, Hkv, D)
    torch.testing.assert_close(got[:, 0], want, atol=1e-5, rtol=1e-5)


def test_each_layer_pages_in_its_own_best_blocks(tiny_model: Path) -> None:
    """Two layers whose queries point at different blocks hold different blocks in the same retrieval group."""
    b = SteeredBackend(tiny_model)
    cfg = CascadeConfig(sink_tokens=4, window=32, block_size=8, retrieval_blocks=1, routing="token", proxy_tokens=1)
    m = CascadeMemory(b, cfg)
    for at in range(0, 160, 16):
        feed(b, m, random_ids(16, seed=at))
    ep = m.episodic
    ids = sorted(ep.blocks)
    assert len(ids) >= 4
    # Each layer asks with one block's mean key; find blocks a, b whose queries make the layers disagree.
    means = {i: ep.blocks[i].k.float().mean(dim=2) for i in ids}  # (L, Hkv, D) each
    steer = None
    for a in ids:
        for other in ids:
            q = torch.stack([means[a][0], means[other][1]])  # (L=2, Hkv, D)
            best = ep.select(q, 1)
            if best[0] != best[1]:
                steer = q
                break
        if steer is not None:
            break
    assert steer is not None, "no pair of blocks made the layers disagree"
    b.steer = steer[None]
    feed(b, m, [7])  # after this forward the steered summary is the routing query...
    feed(b, m, [8])  # ...and this plan routes with it
    w = m.working
    assert w.groups == ep.select(steer, 1) and w.groups[0] != w.groups[1]
    k, v = b.read_kv(0, w.group_slots(0))  # (L, Hkv, B, D)
    for layer, (bid,) in enumerate(w.groups):
        assert torch.equal(k[layer], ep.blocks[bid].k[layer]) and torch.equal(v[layer], ep.blocks[bid].v[layer])


def test_rerouting_follows_drift_not_only_the_clock(tiny_model: Path) -> None:
    b = SteeredBackend(tiny_model)
    cfg = CascadeConfig(
        sink_tokens=4,
        window=32,
        block_size=8,
        retrieval_blocks=2,
        routing="rolling",
        reroute_every=10_000,
        reroute_drift=10,
        proxy_tokens=4,
    )
    m = CascadeMemory(b, cfg)
    c = b.config
    steady = torch.randn(
        1, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, generator=torch.Generator().manual_seed(0)
    )
    b.steer = steady
    for at in range(0, 120, 12):
        feed(b, m, random_ids(12, seed=at))
    routed = m.working.counters.hits + m.working.counters.misses
    for t in range(10):  # the same query: no drift, and the clock is far away
        feed(b, m, [t + 3])
    assert m.working.counters.hits + m.working.counters.misses == routed
    b.steer = -steady  # the conversation turned: the query points the other way
    for t in range(5):
        feed(b, m, [t + 4])
    assert m.working.counters.hits + m.working.counters.misses > routed


def test_a_long_prompt_ends_in_small_routed_chunks(tiny_model: Path) -> None:
    b = TorchBackend(tiny_model)
    cfg = CascadeConfig(sink_tokens=4, window=32, block_size=8, retrieval_blocks=2)
    m = CascadeMemory(b, cfg)
    assert m.prefill_cut(random_ids(30), 0) == []  # fits the window: nothing to route
    n = 100
    assert m.prefill_cut(random_ids(n), 0) == [n - TAIL_STEP * i for i in range(TAIL_STEPS, 0, -1)]


def test_native_step_gives_the_same_summary_and_stays_native_after_page_ins(tmp_path: Path) -> None:
    """Token routing pages blocks in before most steps; those steps still run natively (their stale copies are
    re-derived first), with the logits and the query summary of the PyTorch path."""
    model = make_tiny_model(tmp_path / "llama", "llama")
    ids = [3 + (i * 7) % 200 for i in range(60)]
    cfg = CascadeConfig(sink_tokens=4, window=16, block_size=4, retrieval_blocks=2, routing="token")
    runs = []
    for native in (True, False):
        b = TorchBackend(
            model, "cpu", quantize="q8_0", native_steps=native
        )  # False: the same weights, every step through PyTorch
        if b.native_isa is None:
            pytest.skip(f"the native kernels are not available here: {b.kernels_note}")
        m = CascadeMemory(b, cfg)
        logits, summaries = [prefill(b, m, ids[:10], chunk=10)], []
        for t in ids[10:]:
            misses = m.working.counters.misses
            logits.append(decode_step(b, m, t))
            summaries.append((b.query_summary(), m.working.counters.misses > misses))
        runs.append((torch.stack(logits), summaries))
    (native_logits, native_sums), (torch_logits, torch_sums) = runs
    torch.testing.assert_close(
        native_logits, torch_logits, atol=5e-4, rtol=1e-4
    )  # fp32 attention summed in another order
    paged = 0
    for (a, was_paged), (want, _) in zip(native_sums, torch_sums, strict=True):
        torch.testing.assert_close(a, want, atol=2e-4, rtol=5e-3)  # the hidden states drift by attention rounding
        paged += was_paged
    assert paged >= 5  # the comparison covered steps right after page-ins


def test_page_in_steps_run_on_the_native_decoder(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "llama", "llama")
    b = TorchBackend(model, "cpu", quantize="q8_0")
    if b.decoder is None:
        pytest.skip(f"the native kernels are not available here: {b.kernels_note}")
    m = CascadeMemory(b, CascadeConfig(sink_tokens=4, window=16, block_size=4, retrieval_blocks=2, routing="token"))
    prefill(b, m, random_ids(40, seed=2), chunk=10)
    steps = NativeStepCounter()
    with b.timed_parts(steps):
        for t in random_ids(30, seed=3):
            plan = m.plan([t])
            b.forward(torch.tensor([[t]]), plan.as_batch(), last_only=True)
            m.after_forward()
    assert steps.native_steps == 30


def test_geometry_covers_the_trained_context(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", max_positions=1024)
    config = ModelConfig.from_file(model / "config.json")
    c = CascadeConfig.for_model(model, config)
    assert c.used_slots == 1024 and c.window == 1024 - c.sink_tokens - c.retrieval_slots
    assert CascadeConfig.for_model(model, config, max_slots=600).used_slots == 600  # the memory budget caps it
    (model / "cascade.json").write_text(json.dumps({"window": 128}))
    assert CascadeConfig.for_model(model, config).window == 128  # cascade.json still overrides


def test_a_conversation_that_fits_is_exactly_full_attention(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", max_positions=512)
    b = TorchBackend(model, kv_dtype=torch.float32)
    cfg = CascadeConfig.for_model(model, b.config)
    ids = random_ids(200, seed=5)
    cascade = CascadeMemory(b, cfg)
    got, _ = greedy(b, cascade, prefill(b, cascade, ids, 64), 40)
    b.allocate(1, 300)
    full = FullAttentionMemory(b)
    want, _ = greedy(b, full, prefill(b, full, ids, 64), 40)
    assert got == want and cascade.working.evicted == 0


def test_a_format_1_state_restores_and_continues(tiny_model: Path) -> None:
    """tests/engine/memory/cascade/data holds a state written by the format-1 code (commit e515223, token routing over
    150 tokens of this tiny model): it migrates, restores its tokens and KV, and decoding continues with blocks
    routed per layer again."""
    meta = json.loads((DATA / "cascade_state_v1.json").read_text())
    tensors = load_file(str(DATA / "cascade_state_v1.safetensors"))
    assert meta["version"] == 1
    cfg = CascadeConfig(sink_tokens=4, window=32, block_size=8, retrieval_blocks=2, routing="token")
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, cfg)
    m.load_state(meta, tensors)
    assert m.tokens == meta["tokens"]
    window = m.working.window_start + torch.arange(cfg.window)
    k, _ = b.read_kv(0, window)
    assert torch.equal(k, tensors["wk.k"][:, :, window])
    assert set(m.episodic.blocks) and all(m.episodic.blocks[i].k is not None for i in m.episodic.blocks)
    assert m.working.resident_blocks == 0  # format 1 placed blocks differently: they page back in on routing
    logits = feed(b, m, [5])[-1]
    out, _ = greedy(b, m, logits, 8)
    assert len(out) == 8 and m.working.resident_blocks == 2
    again = CascadeMemory(TorchBackend(tiny_model), cfg)  # the migrated state saves and restores as format 2
    meta2, tensors2 = m.state()
    again.load_state(meta2, tensors2)
    assert again.tokens == m.tokens and meta2["version"] == 2
