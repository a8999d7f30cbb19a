from __future__ import annotations

import torch

from engine.backends.base import Backend
from engine.memory.base import Memory


def feed(backend: Backend, memory: Memory, ids: list[int]) -> torch.Tensor:
    """One forward of `ids` through `memory`; returns logits (T, V)."""
    plan = memory.plan(ids)
    out = backend.forward(torch.tensor([ids], dtype=torch.long), plan.as_batch())
    memory.after_forward()
    return out[0]


def prefill(backend: Backend, memory: Memory, ids: list[int], chunk: int) -> torch.Tensor:
    """Feed in chunks (after any prefix reuse); returns the last token's logits (V,)."""
    at = memory.reuse_prefix(ids[:-1])
    logits = None
    for i in range(at, len(ids), chunk):
        logits = feed(backend, memory, ids[i : i + chunk])
    assert logits is not None
    return logits[-1]


def greedy(backend: Backend, memory: Memory, logits: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens starting from `logits` (V,); returns them and the logits after the last one is fed."""
    out = []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        logits = feed(backend, memory, [tok])[-1]
    return out, logits


def random_ids(n: int, seed: int = 0, vocab: int = 300) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
