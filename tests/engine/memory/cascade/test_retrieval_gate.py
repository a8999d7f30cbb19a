"""The retrieval gate: an evicted block is paged in only where it outscores the window's own blocks; the window's
bounds are the ones episodic memory gives the same blocks when they leave; a decoding step never empties a group
(which would re-number the window)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.memory.cascade import CascadeConfig, CascadeMemory
from engine.memory.cascade.episodic import bound_scores, key_bounds
from tests.engine.memory.cascade.helpers import feed, random_ids
from tests.helpers.steered import SteeredBackend

GATED = CascadeConfig(sink_tokens=4, window=32, block_size=8, retrieval_blocks=2, routing="token", proxy_tokens=1)


def _steer(b: SteeredBackend, seed: int) -> torch.Tensor:
    c = b.config
    return torch.randn(
        1, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, generator=torch.Generator().manual_seed(seed)
    )


def test_window_bounds_are_those_the_blocks_get_when_they_leave(tiny_model: Path) -> None:
    b = SteeredBackend(tiny_model)
    m = CascadeMemory(b, GATED)
    wb, w, ep = m.retriever.window_bounds, m.working, m.episodic
    query = _steer(b, 0)[0]  # (L, Hkv, D)
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for at in range(0, 150, 6):  # odd chunks: blocks straddle forwards and the ring's wrap
        feed(b, m, random_ids(6, seed=at))
        span = w.window_blocks()
        got = wb.scores(query)  # (n, L)
        assert got.shape[0] == len(span) and (at < 36 or len(span) >= 3)
        for i, c in enumerate(span):
            k, _ = b.read_kv(0, w.window_block_slots(torch.tensor([c])))  # (L, Hkv, B, D)
            kmin, kmax = key_bounds(k)
            torch.testing.assert_close(got[i], bound_scores(kmin[None], kmax[None], query)[0], rtol=0, atol=0)
            memo[c] = kmin, kmax
    assert len(ep.blocks) >= 10
    for bid, block in ep.blocks.items():  # block ids count blocks as the window's ordinals do
        row = int((ep.row_block == bid).nonzero())
        assert torch.equal(ep.kmin[row], memo[bid][0]) and torch.equal(ep.kmax[row], memo[bid][1]), bid
        assert block.k is not None


def test_the_gate_admits_only_blocks_that_outscore_the_window(tiny_model: Path) -> None:
    b = SteeredBackend(tiny_model)
    m = CascadeMemory(b, GATED)
    for at in range(0, 120, 12):
        feed(b, m, random_ids(12, seed=at))
    query = _steer(b, 1)
    b.steer = query
    feed(b, m, [5])  # its summary routes the next plan
    feed(b, m, random_ids(3, seed=9))  # a prompt chunk: the gate decides freely
    ep, w = m.episodic, m.working
    # What the gate must admit, from the definitions: the window's best block per layer (gate_rank 8 > the 3 blocks
    # a 32-token window holds: its worst), and per layer the evicted blocks that outscore it; n is the median layer's.
    q = query[0]
    beat = m.retriever.window_bounds.scores(q).min(0).values  # (L,)
    rows = ep.row_block >= 0
    admitted = (bound_scores(ep.kmin[rows], ep.kmax[rows], q) > beat).sum(0)  # (L,)
    want = min(GATED.retrieval_blocks, int(admitted.median()))
    assert w.resident_blocks == want
    # The zero query scores every block 0, which nothing outscores: the gate closes and the slots are masked.
    b.steer = torch.zeros_like(query)
    feed(b, m, [6])
    feed(b, m, random_ids(3, seed=10))
    assert w.resident_blocks == 0 and w.groups == [[] for _ in w.groups]
    assert not w.valid[w.retrieval_start : w.window_start].any()


def test_without_the_gate_every_group_fills(tiny_model: Path) -> None:
    b = SteeredBackend(tiny_model)
    m = CascadeMemory(b, CascadeConfig(**{**GATED.to_dict(), "gate_rank": 0}))
    for at in range(0, 120, 12):
        feed(b, m, random_ids(12, seed=at))
    b.steer = torch.zeros_like(_steer(b, 1))
    feed(b, m, [6])
    feed(b, m, random_ids(3, seed=10))
    assert m.working.resident_blocks == GATED.retrieval_blocks


def test_a_decoding_step_never_empties_a_group(tiny_model: Path) -> None:
    b = SteeredBackend(tiny_model)
    m = CascadeMemory(b, GATED)
    w = m.working
    for at in range(0, 120, 12):
        feed(b, m, random_ids(12, seed=at))
    for seed in range(20):  # the scenario: a prompt chunk whose query the gate admits blocks for
        b.steer = _steer(b, seed)
        feed(b, m, [5])
        feed(b, m, random_ids(3, seed=9))
        if w.resident_blocks:
            break
    held = w.resident_blocks
    assert held > 0
    b.steer = torch.zeros(b.steer.shape)  # a query that admits none
    for t in range(4):  # decoding steps re-route (routing "token") but keep every group filled
        feed(b, m, [t + 11])
        assert w.resident_blocks == held
    feed(b, m, random_ids(3, seed=12))  # a prompt chunk empties them, and the window follows the sinks directly
    assert w.resident_blocks == 0
    window = w.slot_positions[w.window_start : w.window_start + w.window]
    assert sorted(window.tolist()) == list(range(GATED.sink_tokens, GATED.sink_tokens + GATED.window))


def test_retrieved_blocks_sit_retrieval_near_tokens_back_in_a_long_window(tiny_model: Path) -> None:
    """With a window longer than retrieval_near, a group's block reads as said near + (n - g) * B tokens before the
    newest token; with a window no longer, right before the window (the layout bench passkey --window 256 uses)."""
    for near, window in ((16, 64), (512, 64)):
        cfg = CascadeConfig(**{**GATED.to_dict(), "window": window, "retrieval_near": near, "gate_rank": 0})
        b = SteeredBackend(tiny_model)
        m = CascadeMemory(b, cfg)
        for at in range(0, 160, 16):
            feed(b, m, random_ids(16, seed=at))
        w = m.working
        n, block = w.resident_blocks, cfg.block_size
        assert n == cfg.retrieval_blocks
        newest = int(w.slot_positions[w.window_start :][w.valid[w.window_start :]].max())
        assert newest == cfg.sink_tokens + n * block + window - 1  # the window follows the groups' slots, densely
        got = w.slot_positions[w.retrieval_start : w.window_start]  # (R*B,)
        back = min(near, window) + n * block - 1 - torch.arange(n * block)  # (R*B,) tokens before the newest
        assert torch.equal(newest - got, back)


def test_window_bounds_grow_with_the_blocks_they_bound(tiny_model: Path) -> None:
    """A memory that never routes holds no bounds; once it does, only the rows of the blocks bounded so far."""
    b = SteeredBackend(tiny_model)
    m = CascadeMemory(b, GATED)
    wb = m.retriever.window_bounds
    assert wb.kmin.shape[0] == 0 and wb.rows == GATED.window // GATED.block_size + 1
    feed(b, m, random_ids(20, seed=1))  # 2 whole blocks in the window, nothing evicted yet
    wb.scores(_steer(b, 0)[0])
    assert 2 <= wb.kmin.shape[0] == wb.kmax.shape[0] < wb.rows
    for at in range(0, 120, 12):
        feed(b, m, random_ids(12, seed=at))
        wb.scores(_steer(b, 0)[0])
    assert wb.kmin.shape[0] == wb.rows  # the ring wrapped: every row in use
