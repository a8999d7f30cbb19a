"""Cascade snapshots in L3: prompts longer than the window are reused whole (engine.memory.cascade.core), and reuse
never changes what the memory holds (engine.memory.cascade.prefix)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.cli import main as engine_main
from engine.generation.loop import prefill
from engine.memory.cascade import CascadeConfig, CascadeMemory, PersistentStore
from engine.memory.cascade.core import TAIL_STEP, TAIL_STEPS
from engine.session.replay import memory_digest
from tests.engine.memory.cascade.helpers import feed, greedy, random_ids
from tests.helpers.tiny import TOKENIZER_TEXT, make_tiny_model

CFG = CascadeConfig(sink_tokens=4, window=32, block_size=8, retrieval_blocks=2, reroute_every=4)
CHUNK = 16


def memory(model: Path, cache: Path, cfg: CascadeConfig = CFG) -> tuple[TorchBackend, CascadeMemory]:
    """A new backend + memory over `cache`, as a new process would open them."""
    b = TorchBackend(model)
    return b, CascadeMemory(
        b, cfg, store=PersistentStore(cache, b.fingerprint, b.numerics, cfg.persistent_budget_bytes)
    )


def cut_of(n: int, cfg: CascadeConfig = CFG) -> int:
    """Where a fresh read of a prompt of n tokens snapshots: the last grid point (sinks + window, then every
    window here) before the prompt's tail; 0 when there is none."""
    points = range(cfg.sink_tokens + 2 * cfg.window, n - TAIL_STEP * TAIL_STEPS, cfg.window)
    return points[-1] if points else 0


def feed_chunks(b: TorchBackend, m: CascadeMemory, ids: list[int]) -> torch.Tensor:
    logits = None
    for i in range(0, len(ids), CHUNK):
        logits = feed(b, m, ids[i : i + CHUNK])[-1]
    assert logits is not None
    return logits


@pytest.mark.parametrize("routing", ["hybrid", "token"])
def test_snapshot_reuse_continues_exactly(tiny_model: Path, tmp_path: Path, routing: str) -> None:
    """P + Q over a cache that holds P's snapshot: the memory a cold read of P + Q makes without any cache, bit for
    bit, so the reply does not depend on which cache the reader has (a restored session re-reading its
    conversation, engine.session.engine)."""
    cfg = CascadeConfig(**{**CFG.to_dict(), "routing": routing})
    p, q = random_ids(150, seed=1), random_ids(40, seed=2)  # P is > 4 windows: most of it left the window
    prefill(*memory(tiny_model, tmp_path / "warm", cfg), p, CHUNK)
    b1, m1 = memory(tiny_model, tmp_path / "cold", cfg)
    cold = prefill(b1, m1, p + q, CHUNK)
    assert m1.reused_tokens == 0 and m1.episodic.blocks and m1.working.evicted > 0
    b2, m2 = memory(tiny_model, tmp_path / "warm", cfg)  # a restart over P's cache
    warm = prefill(b2, m2, p + q, CHUNK)
    assert m2.reused_tokens == cut_of(len(p)) == 100
    torch.testing.assert_close(warm, cold, atol=0, rtol=0)
    assert memory_digest(m2) == memory_digest(m1)
    want, _ = greedy(b1, m1, cold, 12)
    got, _ = greedy(b2, m2, warm, 12)
    assert got == want
    assert m2.tokens == m1.tokens


def test_a_later_turn_is_never_snapshot(tiny_model: Path, tmp_path: Path) -> None:
    """A turn after the first holds a conversation fed as it came (replies token by token), which no cold read of
    its tokens reproduces: only a prompt read into an empty memory is snapshot."""
    b, m = memory(tiny_model, tmp_path)
    first = random_ids(150, seed=1)
    prefill(b, m, first, CHUNK)
    assert m.store is not None
    entries = m.store.stats().entries
    prefill(b, m, random_ids(60, seed=2), CHUNK)
    assert m.store.stats().entries == entries
    _, m2 = memory(tiny_model, tmp_path)
    assert m2.reuse_prefix(m.tokens[:-1]) == cut_of(len(first))


def test_repeated_prompt_recomputes_at_most_a_block(tiny_model: Path, tmp_path: Path) -> None:
    ids = random_ids(200, seed=3)
    b1, m1 = memory(tiny_model, tmp_path)
    cold = prefill(b1, m1, ids, CHUNK)
    b2, m2 = memory(tiny_model, tmp_path)
    computed: list[int] = []
    plan = m2.plan
    m2.plan = lambda piece: (computed.append(len(piece)), plan(piece))[1]  # type: ignore[method-assign]
    warm = prefill(b2, m2, ids, CHUNK)
    assert sum(computed) == len(ids) - cut_of(len(ids)) <= CFG.window + TAIL_STEP * TAIL_STEPS
    torch.testing.assert_close(warm, cold, atol=0, rtol=0)
    assert memory_digest(m2) == memory_digest(m1)
    assert int(warm.argmax()) == int(cold.argmax())
    assert m2.store is not None and m2.store.stats().hits >= 1


def test_longest_matching_snapshot_wins(tiny_model: Path, tmp_path: Path) -> None:
    short = random_ids(100, seed=4)
    long = short + random_ids(80, seed=5)
    for prompt in (short, long):
        b, m = memory(tiny_model, tmp_path)
        prefill(b, m, prompt, CHUNK)
    b, m = memory(tiny_model, tmp_path)
    assert cut_of(len(short)) < cut_of(len(long))
    assert m.reuse_prefix([*long, 1, 2, 3]) == cut_of(len(long))
    m.reset()
    assert m.reuse_prefix(short + random_ids(90, seed=6)) == cut_of(len(short))  # diverges from `long` after short
    m.reset()
    assert m.reuse_prefix(long[: cut_of(len(long)) + TAIL_STEP * TAIL_STEPS - 1]) == cut_of(
        len(short)
    )  # its tail reaches the long one


def test_foreign_model_or_settings_never_restore_a_snapshot(
    tiny_model: Path, other_model: Path, tmp_path: Path
) -> None:
    ids = random_ids(150, seed=7)
    b, m = memory(tiny_model, tmp_path)
    prefill(b, m, ids, CHUNK)
    _, other = memory(other_model, tmp_path)
    assert other.reuse_prefix(ids) == 0
    for change in (
        {"window": 40},
        {"routing": "rolling"},
        {"reroute_drift": 20},
        {"proxy_tokens": 8},
        {"layer_blocks": 1},
    ):
        cfg = CascadeConfig(**{**CFG.to_dict(), **change})
        _, m2 = memory(tiny_model, tmp_path, cfg)
        # exact (full-attention) prefix blocks are geometry-independent; the snapshot is not
        assert m2.reuse_prefix(ids) <= cfg.sink_tokens + cfg.window
    for budgets in ({"persistent_budget_bytes": 10**9}, {"episodic_budget_bytes": 10**6}):
        _, same = memory(tiny_model, tmp_path, CascadeConfig(**{**CFG.to_dict(), **budgets}))
        assert same.reuse_prefix(ids) == cut_of(len(ids))  # budgets are not part of the state
    # A snapshot planted under another geometry's key is rejected by its recorded identity.
    cfg = CascadeConfig(**{**CFG.to_dict(), "window": 40})
    _, m3 = memory(tiny_model, tmp_path, cfg)
    src = tmp_path / "blocks" / f"{m.snapshot_key(ids[: cut_of(len(ids))])}.safetensors"
    src.rename(tmp_path / "blocks" / f"{m3.snapshot_key(ids[: cut_of(len(ids), cfg)])}.safetensors")  # where m3 looks
    _, m3 = memory(tiny_model, tmp_path, cfg)
    with pytest.warns(RuntimeWarning, match="another model"):
        assert m3.reuse_prefix(ids) <= cfg.sink_tokens + cfg.window


@pytest.mark.parametrize("damage", ["snapshot", "block"])
def test_corrupt_snapshot_is_dropped_with_a_warning(tiny_model: Path, tmp_path: Path, damage: str) -> None:
    ids = random_ids(150, seed=8)
    b, m = memory(tiny_model, tmp_path)
    cold = prefill(b, m, ids, CHUNK)
    key = m.snapshot_key(ids[: cut_of(len(ids))])
    if damage == "block":  # one of the episodic blocks the snapshot references
        key = next(blk.l3_key for blk in m.episodic.blocks.values() if blk.k is not None)
    path = tmp_path / "blocks" / f"{key}.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    b2, m2 = memory(tiny_model, tmp_path)
    with pytest.warns(RuntimeWarning, match="fails the checksum"):
        n = m2.reuse_prefix(ids[:-1])
    assert n <= CFG.sink_tokens + CFG.window  # fell back to the exact prefix blocks
    assert not path.exists()
    assert m2.store is not None and m2.store.stats().misses >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m2.reset()
        warm = prefill(b2, m2, ids, CHUNK)  # recomputed, and the snapshot (or block) written again
    torch.testing.assert_close(warm, cold, atol=2e-3, rtol=0)
    assert path.exists()


def test_budget_evicts_least_recently_used_snapshots(tiny_model: Path, tmp_path: Path) -> None:
    first, second = random_ids(150, seed=9), random_ids(150, seed=10)
    b, m = memory(tiny_model, tmp_path)
    prefill(b, m, first, CHUNK)
    store = m.store
    assert store is not None
    one = store.bytes
    store.budget_bytes = one * 3 // 2
    m.reset()
    prefill(b, m, second, CHUNK)
    assert store.bytes <= store.budget_bytes and store.stats().evictions > 0
    _, m2 = memory(tiny_model, tmp_path, CascadeConfig(**{**CFG.to_dict(), "persistent_budget_bytes": one * 3 // 2}))
    assert m2.reuse_prefix(second) == cut_of(len(second))
    m2.reset()
    assert m2.reuse_prefix(first) < cut_of(len(first))


def test_snapshots_share_episodic_blocks(tiny_model: Path, tmp_path: Path) -> None:
    b, m = memory(tiny_model, tmp_path)
    first = random_ids(150, seed=11)
    prefill(b, m, first, CHUNK)
    store = m.store
    assert store is not None
    entries = store.stats().entries
    on_disk = {
        blk.l3_key
        for blk in m.episodic.blocks.values()
        if blk.k is not None and blk.l3_key is not None and blk.l3_key in store
    }
    assert on_disk  # the blocks of the first snapshot (more formed after its point, not stored yet)
    longer = first + random_ids(60, seed=12)
    m.reset()
    prefill(b, m, longer, CHUNK)  # the conversation re-read: one more snapshot + only the blocks it adds
    now = {blk.l3_key for blk in m.episodic.blocks.values() if blk.k is not None and blk.l3_key is not None}
    assert on_disk & now and all(key in store for key in now)
    assert store.stats().entries == entries + 1 + len(now - on_disk)
    _, m2 = memory(tiny_model, tmp_path)
    assert m2.reuse_prefix(longer[:-1]) == cut_of(len(longer))


def test_generate_twice_reuses_the_long_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "model", max_positions=512)
    (model / "cascade.json").write_text(json.dumps({"window": 32, "block_size": 8, "retrieval_blocks": 2}))
    monkeypatch.setenv("MLOT_SPARK_CACHE_DIR", str(tmp_path / "app-cache"))
    reused: list[int] = []
    computed: list[int] = []
    reuse, plan = CascadeMemory.reuse_prefix, CascadeMemory.plan
    monkeypatch.setattr(CascadeMemory, "reuse_prefix", lambda self, ids: (reused.append(n := reuse(self, ids)), n)[1])
    monkeypatch.setattr(CascadeMemory, "plan", lambda self, ids: (computed.append(len(ids)), plan(self, ids))[1])
    args = ["generate", "--model", str(model), "--cache-dir", str(tmp_path / "l3"), "--prompt", TOKENIZER_TEXT[:700]]
    runs = []
    for _ in range(2):
        computed.clear()
        assert engine_main([*args, "--max-tokens", "4", "--greedy", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        runs.append((out, sum(computed)))
    (first, computed_first), (second, computed_second) = runs
    assert first["prompt_tokens"] > 3 * 32
    assert reused[0] == 0 and reused[1] == cut_of(first["prompt_tokens"])
    assert computed_second == computed_first - reused[1]
    assert second["tokens"] == first["tokens"]
