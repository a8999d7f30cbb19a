"""The slot table's read copies (rotated keys, rounded to the table's dtype) always equal what rotating on read
would give, whatever changed the table: decoding, a sliding window, restores, beam row copies. The table grows in
blocks as it fills, never to the whole trained context up front. And the small-step attention equals PyTorch's
SDPA."""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import decode_step, prefill
from engine.memory.base import FullAttentionMemory
from engine.memory.cascade.config import CascadeConfig
from engine.memory.cascade.core import CascadeMemory
from engine.model.attention import apply_rope, small_step_attention, split_frame_attention
from engine.model.config import ModelConfig
from engine.model.slots import KVCache
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("reads"), "llama")


def assert_read_copies_exact(b: TorchBackend, slot_positions: torch.Tensor) -> int:
    """slot_positions (B, S): every read rank holding a slot equals a fresh read of that slot's k, v: the key
    rotated at the slot's current position in the compute dtype (and kept so), the value as the table holds it.
    Returns how many ranks hold a slot."""
    c: KVCache = b.cache
    assert b.model.rope is not None
    held = (c.read_slots >= 0).nonzero().squeeze(1)  # (m,) ranks
    slots = c.read_slots[held]
    assert torch.equal(c.read_positions[:, held], slot_positions[:, slots])
    cos, sin = b.model.rope.lookup(slot_positions[:, slots])  # (B, 1, m, D)
    fresh_k = apply_rope(c.k[:, :, :, slots].to(c.compute_dtype), cos.unsqueeze(0), sin.unsqueeze(0)).to(
        c.k_read.dtype
    )  # (L, B, Hkv, m, D)
    assert c.k_read.dtype == c.compute_dtype and c.v_read.dtype == c.v.dtype  # values: no copy wider than the table
    assert torch.equal(c.k_read[:, :, :, held], fresh_k)
    assert torch.equal(c.v_read[:, :, :, held], c.v[:, :, :, slots])
    return held.numel()


def test_small_step_attention_equals_sdpa() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 3, 16, generator=g)  # (B, H, T, D), 3 query heads per KV head
    k, v = torch.randn(2, 2, 20, 16, generator=g), torch.randn(2, 2, 20, 16, generator=g)  # (B, Hkv, S, D)
    mask = torch.rand(2, 1, 3, 20, generator=g) > 0.4  # (B, 1, T, S)
    mask[..., 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ours = small_step_attention(q, k, v, ~mask.unsqueeze(1))
    assert torch.allclose(ours, ref, atol=1e-6), (ours - ref).abs().max()
    one = q[:, :, :1]  # (B, H, 1, D): the single-token, nothing-masked shortcut
    assert torch.allclose(
        small_step_attention(one, k, v, None), F.scaled_dot_product_attention(one, k, v, enable_gqa=True), atol=1e-6
    )
    mask[1] = False  # a padding row that may attend to nothing stays finite
    assert torch.isfinite(small_step_attention(q, k, v, ~mask.unsqueeze(1))).all()


@pytest.mark.parametrize("t", [1, 3])  # one token: two fused attentions merged; more: one masked softmax
def test_split_frame_attention_is_one_softmax_over_both_groups(t: int) -> None:
    g = torch.Generator().manual_seed(1)
    q0, q1 = torch.randn(1, 4, t, 16, generator=g), torch.randn(1, 4, t, 16, generator=g)  # (1, H, T, D)
    k, v = torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g)  # (1, Hkv, S, D)
    scores = torch.cat(
        (
            q0.reshape(1, 2, 2 * t, 16) @ k[:, :, :7].transpose(-1, -2),
            q1.reshape(1, 2, 2 * t, 16) @ k[:, :, 7:].transpose(-1, -2),
        ),
        -1,
    )
    ref = ((scores / 4).softmax(-1) @ v).view(1, 4, t, 16)
    blocked = None if t == 1 else torch.zeros(1, 1, 1, t, 20, dtype=torch.bool)
    assert torch.allclose(split_frame_attention(q0, q1, k, v, 7, blocked), ref, atol=1e-5)
    assert torch.allclose(
        split_frame_attention(q0, q1, k, v, 0, blocked), small_step_attention(q1, k, v, blocked), atol=1e-6
    )


def test_decoding_keeps_read_copies_exact_and_restores_refresh_them(model_dir: Path) -> None:
    b = TorchBackend(model_dir, "cpu")  # fp16 KV: the copies widen as well as rotate
    b.allocate(1, 64)
    mem = FullAttentionMemory(b)
    ids = list(range(3, 33))
    prefill(b, mem, ids[:20], chunk=8)  # small steps (T <= 8) fill the read copies
    for t in ids[20:]:
        decode_step(b, mem, t)
    pos = torch.arange(64)[None]
    assert assert_read_copies_exact(b, pos) == len(ids)
    # A restore writes k, v behind the forward's back: the next step must re-derive those slots.
    slots = torch.tensor([2, 5, 11])
    k, v = b.read_kv(0, slots)
    b.write_kv(0, slots, torch.randn_like(k), torch.randn_like(v))
    decode_step(b, mem, 7)
    assert assert_read_copies_exact(b, pos) == len(ids) + 1
    # A new conversation re-uses the slots at the same positions with other tokens: large steps (converted on
    # read) and small ones both overwrite slots whose copies are held, and no old copy may survive either.
    for chunk in (12, 4):
        mem.reset()
        prefill(b, mem, list(range(40 + chunk, 52 + chunk)), chunk=chunk)
        decode_step(b, mem, 9)
        assert assert_read_copies_exact(b, pos) == 13


def test_sliding_window_keeps_copies_in_a_frame(model_dir: Path) -> None:
    b = TorchBackend(model_dir, "cpu")
    cfg = CascadeConfig(sink_tokens=4, window=16, block_size=4, retrieval_blocks=1)
    mem = CascadeMemory(b, cfg)
    ids = [3 + i % 200 for i in range(60)]  # well past the window: positions re-number every step
    prefill(b, mem, ids[:10], chunk=10)
    for t in ids[10:]:
        decode_step(b, mem, t)
    w = mem.working
    assert w.evicted > 0 and w.frame_period > 0 and w.frame == 1 + w.evicted % w.frame_period
    # Window keys sit rotated at position + frame, constant while the window slides; sinks and blocks at their
    # own positions.
    rotated_at = w.slot_positions.clone()
    rotated_at[w.window_start :] += w.frame
    assert assert_read_copies_exact(b, rotated_at[None]) == int(w.valid.sum())


def test_sinks_written_by_small_steps_keep_their_own_frame(model_dir: Path) -> None:
    """A short first prompt writes the sinks in small steps while the window's frame is already on."""
    b = TorchBackend(model_dir, "cpu")
    mem = CascadeMemory(b, CascadeConfig(sink_tokens=4, window=16, block_size=4, retrieval_blocks=1))
    w = mem.working
    for t in [5, 6, 7, 8, 9, 10]:  # one token at a time: sinks, then the window
        decode_step(b, mem, t)
    assert w.frame == 1 and w.n_sink == 4
    rotated_at = w.slot_positions.clone()
    rotated_at[w.window_start :] += w.frame
    assert assert_read_copies_exact(b, rotated_at[None]) == 6


def test_frames_change_nothing_but_rounding(model_dir: Path) -> None:
    """The same sliding conversation with frames (read copies kept) and without (all re-rotated each step)."""
    ids = [3 + (i * 7) % 200 for i in range(60)]
    outs = []
    for period in (None, 0):
        b = TorchBackend(model_dir, "cpu", kv_dtype=torch.float32)
        mem = CascadeMemory(b, CascadeConfig(sink_tokens=4, window=16, block_size=4, retrieval_blocks=1))
        if period is not None:
            mem.working.frame_period = period  # 0: no frames
        logits = [prefill(b, mem, ids[:10], chunk=10)] + [decode_step(b, mem, t) for t in ids[10:]]
        outs.append(torch.stack(logits))
    framed, plain = outs
    assert not torch.equal(framed, plain)  # frames were really used past the window
    assert torch.allclose(framed, plain, atol=1e-4), (framed - plain).abs().max()


def test_the_table_grows_in_blocks_keeping_its_contents_and_gives_them_back(model_dir: Path) -> None:
    b = TorchBackend(model_dir, "cpu")
    b.allocate(1, 2000)
    c: KVCache = b.cache
    assert c.num_slots == 2000 and c.capacity == 0 and c.k_read.numel() == 0
    slots = torch.tensor([0, 7, 300])  # a restore writes past the first block: the table grows to hold it
    k = torch.randn(2, 2, 3, 16).half()  # (L, Hkv, n, D) canonical fp16
    b.write_kv(0, slots, k, -k)
    assert c.capacity == 512  # 301 slots, rounded up to GROWTH_SLOTS
    c.reserve(600)  # grows by half at least, in whole blocks
    assert c.capacity == 768 and not c.reads_in_use
    got_k, got_v = b.read_kv(0, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)  # fp16 in, the same bits out, across growths
    with pytest.raises(IndexError):
        c.reserve(2001)
    b.release()
    assert c.capacity == 0 and c.allocated_bytes() < 2000 * 8 * 3  # bookkeeping only


def _resident_pages(t: torch.Tensor) -> int:
    """How many of the pages under `t`'s storage are resident (mincore)."""
    page = mmap.PAGESIZE
    begin = t.untyped_storage().data_ptr()
    start = begin // page * page
    n = -(-(begin + t.untyped_storage().nbytes() - start) // page)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


@pytest.mark.skipif(sys.platform == "win32", reason="mincore is POSIX")
def test_slots_not_yet_written_hold_no_memory() -> None:
    """A grown table's slots hold memory once written, not when reserved: the retrieval groups before anything is
    evicted and the reserve for a reply cost nothing until used."""
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "num_hidden_layers": 2,
            "intermediate_size": 512,
            "vocab_size": 64,
            "max_position_embeddings": 8192,
        }
    )
    cache = KVCache(cfg, 1, 8192, "cpu", torch.float16, torch.float32)
    cache.reserve(8192, exact=True)  # 2 x 4 x 8192 x 64 fp16: 8 MiB for each of k and v
    assert torch.equal(cache.k[:, :, :, ::997], torch.zeros_like(cache.k[:, :, :, ::997]))  # zeros, as reserved
    written = torch.arange(100)
    k = torch.ones(1, 4, 100, 64)
    for layer in range(2):
        cache.write(layer, written[None], k, 2 * k)
    # Written: 100 slots x 128 bytes in each of the 8 (layer, head) rows, a few pages each; and the zeros read above.
    pages = cache.k.numel() * 2 // mmap.PAGESIZE
    assert _resident_pages(cache.k) <= 8 * (-(-100 * 128 // mmap.PAGESIZE) + 1 + 9) < pages // 10
    assert torch.equal(cache.v[1, 0, :, :100], 2 * k[0].half()) and not cache.k[:, :, :, 100:].any()
