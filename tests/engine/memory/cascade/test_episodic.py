"""L2: retrieval picks the relevant blocks; paging writes them into the slots; the byte budget holds."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.backends.torch_backend import TorchBackend
from engine.memory.cascade import CascadeConfig, CascadeMemory, PersistentStore
from engine.memory.cascade.episodic import EpisodicMemory, PagedBlocks
from engine.memory.cascade.retrieval import consensus_groups
from tests.engine.memory.cascade.helpers import feed, random_ids

L, HKV, D, B = 2, 2, 16, 8


def _blocks_with_directions(n: int) -> tuple[EpisodicMemory, torch.Tensor]:
    """n blocks whose keys point (noisily) along n orthogonal directions; returns memory and the directions."""
    cfg = CascadeConfig(block_size=B, retrieval_blocks=2)
    ep = EpisodicMemory(cfg, (L, HKV, D), None)
    dirs = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(0)))[0][:n]  # (n, D) orthonormal
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        k = dirs[i].expand(L, HKV, B, D) + 0.05 * torch.randn(L, HKV, B, D, generator=g)  # (L, Hkv, B, D)
        ep.append(k.half(), torch.randn(L, HKV, B, D, generator=g).half())
    return ep, dirs


def test_retrieval_returns_the_most_relevant_blocks() -> None:
    ep, dirs = _blocks_with_directions(6)
    for target in range(6):
        q = dirs[target].expand(L, HKV, D)
        assert ep.select(q, 1) == [[target]] * L
    mix = (0.8 * dirs[2] + 0.6 * dirs[4]).expand(L, HKV, D)
    assert ep.select(mix, 2) == [[2, 4]] * L


def test_each_layer_selects_its_own_blocks() -> None:
    ep, dirs = _blocks_with_directions(6)
    q = torch.stack([dirs[1].expand(HKV, D), dirs[5].expand(HKV, D)])  # (L, Hkv, D): layer 0 asks for 1, layer 1 for 5
    assert ep.select(q, 1) == [[1], [5]]


def test_key_bounds_find_a_single_outlier_key() -> None:
    """Quest's bound sees one matching key among filler, which a block mean would average away."""
    cfg = CascadeConfig(block_size=B, retrieval_blocks=1)
    ep = EpisodicMemory(cfg, (L, HKV, D), None)
    g = torch.Generator().manual_seed(3)
    needle = torch.zeros(D)
    needle[0] = 4.0
    for i in range(5):
        k = 0.3 * torch.randn(L, HKV, B, D, generator=g)  # (L, Hkv, B, D) filler
        if i == 2:
            k[:, :, 5] = needle
        ep.append(k.half(), torch.zeros(L, HKV, B, D).half())
    assert ep.select(needle.expand(L, HKV, D), 1) == [[2]] * L


def test_paging_writes_blocks_into_retrieval_slots(tiny_model: Path) -> None:
    cfg = CascadeConfig(sink_tokens=4, window=32, block_size=8, retrieval_blocks=2, routing="token")
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, cfg)
    for at in range(0, 120, 10):
        feed(b, m, random_ids(10, seed=at))
    m.plan([5])  # token routing: re-routes before every plan
    w = m.working
    assert all(len(groups) == 2 for groups in w.groups)  # every layer fills both groups
    for layer, groups in enumerate(w.groups):
        for g, bid in enumerate(groups):
            k, v = b.read_kv(0, w.group_slots(g))
            torch.testing.assert_close(k[layer], m.episodic.blocks[bid].k[layer])
            torch.testing.assert_close(v[layer], m.episodic.blocks[bid].v[layer])
            assert int(w.slot_positions[w.group_slots(g)][0]) == cfg.sink_tokens + g * cfg.block_size


def test_budget_spills_to_l3_and_pages_back(tiny_model: Path, tmp_path: Path) -> None:
    b = TorchBackend(tiny_model)
    block_bytes = 2 * 2 * 2 * 8 * 16 * 2  # L=2, Hkv=2, B=8, D=16, fp16
    cfg = CascadeConfig(
        sink_tokens=4,
        window=32,
        block_size=8,
        retrieval_blocks=2,
        routing="token",
        episodic_budget_bytes=8 * block_bytes,
    )
    store = PersistentStore(tmp_path, b.fingerprint, b.numerics)
    m = CascadeMemory(b, cfg, store=store)
    for at in range(0, 600, 20):
        feed(b, m, random_ids(20, seed=at))
    ep = m.episodic
    assert ep.bytes <= cfg.episodic_budget_bytes
    assert ep.stubs > 0 and ep.counters.evictions > 0
    assert len(store._index) >= ep.stubs
    stub = next(blk for blk in ep.blocks.values() if blk.k is None)
    kv = ep.fetch(stub.id, protect=(stub.id,))
    assert kv is not None and ep.counters.misses >= 1
    assert store.counters.hits >= 1


def test_spill_under_pressure_moves_kv_to_disk_and_keeps_it_reachable(tiny_model: Path, tmp_path: Path) -> None:
    b = TorchBackend(tiny_model)
    cfg = CascadeConfig(sink_tokens=4, window=32, block_size=8, retrieval_blocks=2, routing="token")
    m = CascadeMemory(b, cfg, store=PersistentStore(tmp_path, b.fingerprint, b.numerics))
    for at in range(0, 200, 20):
        feed(b, m, random_ids(20, seed=at))
    ep = m.episodic
    resident = {i: (blk.k.clone(), blk.v.clone()) for i, blk in ep.blocks.items() if blk.k is not None}
    before = ep.bytes
    freed = m.spill()
    assert resident and freed == before - ep.bytes and freed >= len(resident) * ep.block_bytes
    assert all(blk.k is None for blk in ep.blocks.values())  # every block is now a stub...
    some = next(iter(resident))
    k, v = ep.fetch(some, protect=(some,))  # ...whose exact KV comes back from disk
    assert torch.equal(k, resident[some][0]) and torch.equal(v, resident[some][1])


def test_spill_without_a_store_forgets_blocks() -> None:
    ep, _ = _blocks_with_directions(4)
    assert ep.spill() > 0 and not ep.blocks


def test_retrieval_groups_hold_each_layers_blocks_in_conversation_order(tiny_model: Path) -> None:
    """Positions rise with the group, so blocks must sit in the order they were written: a fact split over blocks
    j and j + 1 (a passkey's digits) reads whole only if j comes first, however the selection changed. While a
    prompt is read every group is the layer's own; while answering (one-token steps) the shared groups hold the same
    blocks in every layer and the layer's own groups follow."""
    cfg = CascadeConfig(sink_tokens=4, window=32, block_size=8, retrieval_blocks=3, layer_blocks=1, routing="token")
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, cfg)
    seen_orders = set()
    differ_reading = False
    for at in range(0, 400, 10):
        feed(b, m, random_ids(10, seed=at))  # reading: each layer's own picks
        groups = m.working.groups
        assert all(layer == sorted(layer) for layer in groups)
        differ_reading |= any(layer[:-1] != groups[0][:-1] for layer in groups)
        feed(b, m, random_ids(1, seed=at + 1))  # answering: the consensus in the first groups
        groups = m.working.groups
        for layer in groups:
            shared, own = layer[:-1], layer[-1:]
            assert shared == sorted(shared) and shared == groups[0][:-1]
            assert own == sorted(own) and not set(own) & set(shared)
            seen_orders.add(tuple(layer))
    assert len(seen_orders) > 3 and differ_reading  # the selection really changed; reading layers really differ


def test_consensus_groups_share_the_blocks_layers_agree_on_and_keep_each_layers_own() -> None:
    chosen = [[9, 4, 2], [4, 9, 7], [4, 3, 9]]  # per layer, best first
    # Borda: 4 -> 2+3+3 = 8, 9 -> 3+2+1 = 6, 3 -> 2, then 2 and 7 with 1 each
    assert consensus_groups(chosen, 2) == [[4, 9, 2], [4, 9, 7], [4, 9, 3]]
    assert consensus_groups(chosen, 3) == [[3, 4, 9]] * 3
    assert consensus_groups([[1, 2], [2, 1]], 1) == [[1, 2], [1, 2]]  # a tie goes to the older block
    assert consensus_groups(chosen, 0) == [[2, 4, 9], [4, 7, 9], [3, 4, 9]]  # each layer's own, in order


def test_per_token_queries_find_the_block_one_token_asks_for_where_their_mean_does_not() -> None:
    ep, dirs = _blocks_with_directions(4)
    # Two question tokens that agree on block 1 a little and disagree on block 0 strongly: their mean asks for
    # block 1, while token a alone asks for block 0 (look-alike facts blur in the mean; attached documents).
    a = (2 * dirs[0] + 0.5 * dirs[1]).expand(L, HKV, D)
    b = (-2 * dirs[0] + 0.5 * dirs[1]).expand(L, HKV, D)
    tokens = torch.stack([a, b])  # (T, L, Hkv, D)
    assert ep.select(tokens.mean(0), 1) == [[1]] * L
    assert ep.select(tokens.mean(0), 1, tokens=tokens) == [[0]] * L
    assert ep.select(tokens.mean(0), 1, tokens=tokens, depth=3)[0][0] == 0  # ranked deeper, best still first
    assert len(ep.select(tokens.mean(0), 1, tokens=tokens, depth=3)[0]) == 3


def test_consensus_votes_over_rankings_deeper_than_the_groups() -> None:
    # Each layer's own top 1 differs, but block 5 sits second everywhere: voting over the top 3, it is shared.
    chosen = [[1, 5, 7], [2, 5, 8], [3, 5, 9]]
    assert consensus_groups(chosen, 1, n=2) == [[5, 1], [5, 2], [5, 3]]
    assert consensus_groups([pick[:2] for pick in chosen], 1) == [[5, 1], [5, 2], [5, 3]]
    assert consensus_groups([pick[:1] for pick in chosen], 1) == [[1]] * 3  # the top 1 alone: no agreement seen
    assert consensus_groups(chosen, 0, n=2) == [[1, 5], [2, 5], [3, 5]]  # each layer's own top 2


class _Paged:
    """Blocks' KV held elsewhere (as a kept file holds them): counts reads; `bad` ids fail their check."""

    def __init__(self, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], bad: frozenset[int]) -> None:
        self.kv, self.bad = kv, bad
        self.reads: list[int] = []

    def read(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        self.reads.append(block_id)
        return None if block_id in self.bad else self.kv[block_id]


def _paged_copy(
    ep: EpisodicMemory, cfg: CascadeConfig, store: PersistentStore | None = None, bad: frozenset[int] = frozenset()
) -> tuple[EpisodicMemory, _Paged]:
    """ep's state loaded into a new memory with every block's KV left paged (shapes only, as engine.session.kept
    gives them)."""
    meta, tensors = ep.state()
    kv = {b: (tensors.pop(f"ep.{b}.k"), tensors.pop(f"ep.{b}.v")) for b in ep.blocks}
    for b, (k, v) in kv.items():
        tensors[f"ep.{b}.k"] = torch.empty(k.shape, dtype=k.dtype, device="meta")
        tensors[f"ep.{b}.v"] = torch.empty(v.shape, dtype=v.dtype, device="meta")
    paged = _Paged(kv, bad)
    copy = EpisodicMemory(cfg, (L, HKV, D), store)
    copy.load_state(meta, tensors, paged)
    return copy, paged


def test_paged_blocks_are_read_once_when_first_fetched_and_route_as_resident_ones() -> None:
    ep, dirs = _blocks_with_directions(6)
    copy, paged = _paged_copy(ep, ep.cfg)
    assert paged.reads == [] and copy.resident == 6 and copy.stubs == 0 and copy.bytes == ep.bytes
    assert copy.select(dirs[3].expand(L, HKV, D), 1) == ep.select(dirs[3].expand(L, HKV, D), 1) == [[3]] * L
    got = copy.fetch(3, protect=())
    want = ep.fetch(3, protect=())
    assert got is not None and want is not None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    copy.fetch(3, protect=())
    assert paged.reads == [3]  # read once, then held
    _, tensors = copy.state()  # a whole state reads the rest, without keeping them
    assert sorted(paged.reads) == list(range(6)) and all(b.paged is not None for i, b in copy.blocks.items() if i != 3)
    assert all(torch.equal(tensors[f"ep.{i}.k"], ep.blocks[i].k) for i in range(6))  # type: ignore[arg-type]
    by_ref: dict[int, PagedBlocks] = {}
    _, shallow = copy.state(by_ref)
    assert sorted(by_ref) == [0, 1, 2, 4, 5] and "ep.0.k" not in shallow and "ep.3.k" in shallow


def test_a_paged_block_that_fails_its_check_is_forgotten_never_used() -> None:
    ep, _ = _blocks_with_directions(4)
    copy, _ = _paged_copy(ep, ep.cfg, bad=frozenset({2}))
    assert copy.fetch(2, protect=()) is None and 2 not in copy.blocks and copy.resident == 3
    meta, tensors = copy.state()
    assert [b[0] for b in meta["blocks"]] == [0, 1, 3] and "ep.2.k" not in tensors


def test_a_paged_block_over_budget_is_read_and_spilled_to_l3_as_a_resident_one_is(tmp_path: Path) -> None:
    ep, _ = _blocks_with_directions(6)
    per_block = ep.block_bytes + ep.rep_bytes
    small = CascadeConfig(block_size=B, retrieval_blocks=2, episodic_budget_bytes=4 * per_block)
    store = PersistentStore(tmp_path / "l3", "fingerprint", "numerics")
    copy, paged = _paged_copy(ep, small, store)
    assert copy.bytes <= small.episodic_budget_bytes and copy.stubs >= 1
    assert sorted(paged.reads) == sorted(b for b, blk in copy.blocks.items() if blk.k is None and blk.paged is None)
    for b in list(copy.blocks):
        got = copy.fetch(b, protect=(b,))
        assert got is not None and torch.equal(got[0], ep.blocks[b].k)  # type: ignore[arg-type]
