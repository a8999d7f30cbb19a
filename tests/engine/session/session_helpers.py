"""Shared by the session-file tests: direct greedy/seeded loops over a memory, and an older (v1) file writer."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.backends.base import Backend
from engine.memory.base import Memory

Pick = Callable[[torch.Tensor], int]


def feed(backend: Backend, memory: Memory, ids: Sequence[int]) -> torch.Tensor:
    """One forward of `ids` through `memory`; the last token's logits (V,)."""
    plan = memory.plan(list(ids))
    return backend.forward(torch.tensor([list(ids)], dtype=torch.long), plan.as_batch(), last_only=True)[0, -1]


def decode(backend: Backend, memory: Memory, logits: torch.Tensor, n: int, pick: Pick) -> list[int]:
    """Sample n tokens; like every generate loop, the last one is returned but not fed."""
    out: list[int] = []
    for i in range(n):
        out.append(pick(logits))
        if i < n - 1:
            logits = feed(backend, memory, [out[-1]])
    return out


def greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def seeded(generator: torch.Generator, temperature: float = 1.3) -> Pick:
    """Temperature sampling drawing from `generator` (its state is what a session saves)."""

    def pick(logits: torch.Tensor) -> int:
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    return pick


def write_v1(path: Path, meta: dict, tensor_section: bytes) -> None:
    """Write the v1 layout exactly as a v1 build did: 56-byte preamble (magic, u16 version, u64 metadata length,
    u64 tensor length, SHA-256 over metadata + tensors), then metadata JSON, then raw safetensors bytes."""
    meta_bytes = json.dumps(meta).encode()
    digest = hashlib.sha256(meta_bytes + tensor_section).digest()
    path.write_bytes(
        struct.pack("<6sHQQ32s", b"SPARK\x00", 1, len(meta_bytes), len(tensor_section), digest)
        + meta_bytes
        + tensor_section
    )


def v1_meta(
    fingerprint: str, token_ids: list[int], pending: int | None, memory_meta: dict, rng: list[int] | None
) -> dict:
    """v1 metadata: no tokenizer hash, no `saved`, no `extra`, timestamp-less messages, the sampler state as `rng`."""
    return {
        "format_version": 1,
        "app_version": "0.0.9",
        "model_fingerprint": fingerprint,
        "created": 1_700_000_000.0,
        "system_prompt": "Be brief.",
        "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}],
        "settings": {"max_tokens": 16},
        "token_ids": token_ids,
        "pending_token": pending,
        "rng": rng,
        "memory": memory_meta,
    }


def write_v2(
    path: Path, meta_bytes: bytes, tensor_section: bytes, *, flags: int = 0, raw_len: int | None = None
) -> None:
    """Write the v2 layout around arbitrary metadata/tensor bytes with a *correct* checksum (as a hostile or buggy
    writer could), so the reader's checks after the checksum are what is under test."""
    head = struct.pack(
        "<6sHHHQQQ",
        b"SPARK\x00",
        2,
        flags,
        0,
        len(meta_bytes),
        len(tensor_section),
        len(tensor_section) if raw_len is None else raw_len,
    )
    digest = hashlib.sha256(head + meta_bytes + tensor_section).digest()
    path.write_bytes(head + digest + meta_bytes + tensor_section)
