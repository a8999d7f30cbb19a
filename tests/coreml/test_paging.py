"""KV leaves and re-enters the converted program's state (read_kv / write_kv), and the memory cascade drives the
package exactly as it drives the torch engine: blocks evicted from the window, kept on the host, paged back in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from coreml.reference import InterpreterBackend
from engine.backends.torch_backend import TorchBackend
from engine.memory.base import FullAttentionMemory
from engine.memory.cascade import CascadeConfig, CascadeMemory
from tests.helpers.coreml_bundles import feed, prompt_ids, run_greedy

ATOL = 3e-2


def test_read_kv_is_canonical_and_write_kv_round_trips(
    coreml_tiny_dir: Path, coreml_bundle: Callable[[str], Path]
) -> None:
    interp = InterpreterBackend(coreml_bundle("none"))
    torch_be = TorchBackend(coreml_tiny_dir, device="cpu", dtype=torch.float16)
    torch_be.allocate(1, interp.num_slots)
    ids = prompt_ids(40, interp.config.vocab_size)
    feed(interp, FullAttentionMemory(interp), ids)
    feed(torch_be, FullAttentionMemory(torch_be), ids)
    slots = torch.arange(40)
    for got, ref in zip(interp.read_kv(0, slots), torch_be.read_kv(0, slots), strict=True):
        c = interp.config
        assert got.shape == (c.num_hidden_layers, c.num_key_value_heads, 40, c.head_dim) and got.dtype == torch.float16
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    # Page a block out to another place and back: bit-exact, and no other slot changes.
    k, v = interp.read_kv(0, torch.arange(8, 24))
    before_k, before_v = interp.read_kv(0, torch.arange(interp.num_slots))
    target = torch.arange(100, 116)
    interp.write_kv(0, target, k, v)
    k2, v2 = interp.read_kv(0, target)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    after_k, after_v = interp.read_kv(0, torch.arange(interp.num_slots))
    untouched = torch.ones(interp.num_slots, dtype=torch.bool)
    untouched[target] = False
    assert torch.equal(after_k[:, :, untouched], before_k[:, :, untouched])
    assert torch.equal(after_v[:, :, untouched], before_v[:, :, untouched])


def test_moved_kv_continues_the_conversation(coreml_tiny_dir: Path, coreml_bundle: Callable[[str], Path]) -> None:
    """A conversation saved from one slot table (read_kv) and restored into a fresh one (write_kv) continues with
    the same logits as if it had never left: what session save/restore and paging rely on."""
    interp = InterpreterBackend(coreml_bundle("none"))
    memory = FullAttentionMemory(interp)
    ids = prompt_ids(70, interp.config.vocab_size, seed=3)
    feed(interp, memory, ids)
    meta, tensors = memory.state()
    expected = feed(interp, memory, [7])
    twin = interp.fork()
    restored = FullAttentionMemory(twin)
    restored.load_state(meta, tensors)
    torch.testing.assert_close(feed(twin, restored, [7]), expected, atol=0, rtol=0)


def test_cascade_pages_blocks_through_the_package(coreml_tiny_dir: Path, coreml_bundle: Callable[[str], Path]) -> None:
    interp = InterpreterBackend(coreml_bundle("none"))
    torch_be = TorchBackend(coreml_tiny_dir, device="cpu", dtype=torch.float16)
    # 4 sinks + 3 retrieval blocks of 16 + a 96-token window = 148 slots -> 160, the shared packages' size.
    cfg = CascadeConfig(sink_tokens=4, window=96, block_size=16, retrieval_blocks=3, routing="hybrid")
    assert cfg.num_slots == interp.num_slots
    prompt = prompt_ids(300, interp.config.vocab_size, seed=5)
    ref_mem, got_mem = CascadeMemory(torch_be, cfg), CascadeMemory(interp, cfg)
    ref_logits, ref_tokens = run_greedy(torch_be, ref_mem, prompt, 24, chunk=64)
    got_logits, _ = run_greedy(interp, got_mem, prompt, 24, forced=ref_tokens, chunk=64)
    for r, g in zip(ref_logits, got_logits, strict=True):
        torch.testing.assert_close(g, r.float(), atol=ATOL, rtol=0)
    ref_stats, got_stats = ref_mem.stats(), got_mem.stats()
    assert got_stats.working.evictions > 0 and got_stats.working.misses > 0  # blocks left and were paged back in
    assert (got_stats.working.hits, got_stats.working.misses) == (ref_stats.working.hits, ref_stats.working.misses)
