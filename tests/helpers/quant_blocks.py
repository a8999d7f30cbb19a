"""Block-quantized weights in tests: random blocks of a format with plausible scales, and a backend's logits over a
fixed prompt (prefill, then the native decoding step)."""

from __future__ import annotations

import numpy as np
import torch

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import decode_step, prefill
from engine.memory.base import FullAttentionMemory
from engine.model.quant import BlockType

# Where each format's fp16 fields lie in its block: d, then dmin (or Q5_1's m) where it has one.
FLOATS = {"Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,), "TQ1_0": (52,), "TQ2_0": (64,), "Q4_K": (0, 2)}
FLOATS |= {"Q5_K": (0, 2), "Q5_1": (0, 2)}


def random_blocks(qtype: BlockType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """(n, K/E * block bytes) uint8 of `qtype`: random quants with finite fp16 scales of a plausible size."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n * k // qtype.elements, qtype.block_bytes), dtype=np.uint8)

    def scale(m: int) -> np.ndarray:  # (m, 2) uint8: fp16 scales
        return (rng.uniform(-1, 1, size=(m, 1)) * 0.01).astype(np.float16).view(np.uint8)

    for at in FLOATS.get(qtype.name, (0,)):
        b[:, at : at + 2] = scale(len(b))
    return b.reshape(n, -1)


def logits_of(b: TorchBackend, ids: list[int]) -> torch.Tensor:
    """Prefill 24 tokens in chunks, then decode the rest one at a time (the native step): (n, V)."""
    b.allocate(1, 64)
    mem = FullAttentionMemory(b)
    return torch.stack([prefill(b, mem, ids[:24], chunk=8)] + [decode_step(b, mem, t) for t in ids[24:]])


IDS = [3 + (i * 37) % 290 for i in range(40)]
