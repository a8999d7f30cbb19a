"""The slot table's read copies (rotated keys, widened values) always equal what rotating on read would give,
whatever changed the table: decoding, a sliding window, restores, beam row copies. And the small-step attention
equals PyTorch's SDPA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.backends.torch_backend import TorchBackend
from engine.cascade.config import CascadeConfig
from engine.cascade.memory import CascadeMemory
from engine.generate import decode_step, prefill
from engine.memory import FullAttentionMemory
from engine.model import KVCache, apply_rope, small_step_attention
from tests.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("reads"), "llama")


def assert_read_copies_exact(b: TorchBackend, slot_positions: torch.Tensor, valid: torch.Tensor) -> None:
    """slot_positions (B, S) and valid (B, S) bool: every valid slot's copies equal a fresh read of k, v."""
    c: KVCache = b.cache
    assert b.model.rope is not None
    cos, sin = b.model.rope.lookup(slot_positions)  # (B, 1, S, D)
    fresh_k = apply_rope(c.k.to(c.k_rot.dtype), cos.unsqueeze(0), sin.unsqueeze(0))  # (L, B, Hkv, S, D)
    keep = valid[None, :, None, :, None].expand_as(fresh_k)
    assert torch.equal(c.k_rot[keep], fresh_k[keep])
    assert torch.equal(c.v_wide[keep], c.v.to(c.v_wide.dtype)[keep])


def test_small_step_attention_equals_sdpa() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 3, 16, generator=g)  # (B, H, T, D), 3 query heads per KV head
    k, v = torch.randn(2, 2, 20, 16, generator=g), torch.randn(2, 2, 20, 16, generator=g)  # (B, Hkv, S, D)
    mask = torch.rand(2, 1, 3, 20, generator=g) > 0.4  # (B, 1, T, S)
    mask[..., 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ours = small_step_attention(q, k, v, ~mask.unsqueeze(1))
    assert torch.allclose(ours, ref, atol=1e-6), (ours - ref).abs().max()
    mask[1] = False  # a padding row that may attend to nothing stays finite
    assert torch.isfinite(small_step_attention(q, k, v, ~mask.unsqueeze(1))).all()


def test_decoding_keeps_read_copies_exact_and_restores_refresh_them(model_dir: Path) -> None:
    b = TorchBackend(model_dir, "cpu")  # fp16 KV: the copies widen as well as rotate
    b.allocate(1, 64)
    mem = FullAttentionMemory(b)
    ids = list(range(3, 33))
    prefill(b, mem, ids[:20], chunk=8)
    for t in ids[20:]:
        decode_step(b, mem, t)
    n = len(ids)
    pos = torch.arange(64)[None]
    valid = (pos < n)
    assert_read_copies_exact(b, pos, valid)
    # A restore writes k, v behind the forward's back: the next step must re-derive those slots.
    slots = torch.tensor([2, 5, 11])
    k, v = b.read_kv(0, slots)
    b.write_kv(0, slots, torch.randn_like(k), torch.randn_like(v))
    decode_step(b, mem, 7)
    assert_read_copies_exact(b, pos, pos < n + 1)


def test_beam_row_copies_carry_read_copies(model_dir: Path) -> None:
    b = TorchBackend(model_dir, "cpu")
    b.allocate(2, 32)
    b.cache.k.normal_()
    b.cache.v.normal_()
    b.cache.forget()
    pos = torch.arange(32)[None].expand(2, -1)
    for row in range(2):
        b.cache.rot_positions[row] = pos[row]
    cos, sin = b.model.rope.lookup(pos)  # type: ignore[union-attr]
    b.cache.k_rot.copy_(apply_rope(b.cache.k.float(), cos.unsqueeze(0), sin.unsqueeze(0)))
    b.cache.v_wide.copy_(b.cache.v)
    b.copy_rows(torch.tensor([1, 1]))
    assert torch.equal(b.cache.k_rot[:, 0], b.cache.k_rot[:, 1]) and torch.equal(b.cache.rot_positions[0], b.cache.rot_positions[1])
    assert_read_copies_exact(b, pos, torch.ones(2, 32, dtype=torch.bool))


def test_sliding_window_re_derives_every_moved_slot(model_dir: Path) -> None:
    b = TorchBackend(model_dir, "cpu")
    cfg = CascadeConfig(sink_tokens=4, window=16, block_size=4, retrieval_blocks=1)
    mem = CascadeMemory(b, cfg)
    ids = [3 + i % 200 for i in range(60)]  # well past the window: positions re-number every step
    prefill(b, mem, ids[:10], chunk=10)
    for t in ids[10:]:
        decode_step(b, mem, t)
    w = mem.working
    assert w.evicted > 0
    assert_read_copies_exact(b, w.slot_positions[None], w.valid[None])
