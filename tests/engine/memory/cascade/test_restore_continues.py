"""A session restored from a full .spark file continues exactly as the original, whatever prefix cache each side
has: the conversation is re-read (a rewritten transcript resets the memory) and only the original's cache holds
snapshots and exact blocks of its first prompt (engine.memory.cascade.prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.session.engine import ChatMessage, Engine, Session, memory_factory_for
from engine.session.replay import memory_digest
from tests.engine.memory.cascade.helpers import random_ids

GEOMETRY: dict[str, Any] = {"window": 32, "block_size": 8, "retrieval_blocks": 2, "routing": "token"}
REPLY = GenerationSettings(max_tokens=8, sampling=SamplingSettings(greedy=True), ignore_eos=True)
FIRST = " ".join(f"w{i}" for i in random_ids(60, seed=21))  # a first prompt several windows long


def _session(model: Path, cache: Path) -> Session:
    factory = memory_factory_for(model, cache_dir=cache, prefix_cache=True, **GEOMETRY)
    return Engine.load(model, "cpu", memory_factory=factory).new_session()


def _edit_and_continue(s: Session) -> list[int]:
    """Rewrite the last reply (the memory no longer holds the transcript: it is reset and re-read, with the
    prefix cache), ask again; the tokens the memory holds after the new reply."""
    messages = [*s.messages[:-1], ChatMessage("assistant", "an edited reply"), ChatMessage("user", "and then?")]
    list(s.submit(messages, REPLY))
    return list(s.memory.tokens)


@pytest.mark.parametrize("shared", [False, True], ids=["own-cache", "shared-cache"])
def test_restored_session_continues_as_the_original(tiny_model: Path, tmp_path: Path, shared: bool) -> None:
    original = _session(tiny_model, tmp_path / "a")
    list(original.chat(FIRST, REPLY))
    reads = original.memory.prefix  # type: ignore[attr-defined]  # a CascadeMemory
    assert reads.store is not None and reads.store.stats().entries > 0  # the original's cache knows the first prompt
    original.save(tmp_path / "t.spark")
    restored = _session(tiny_model, tmp_path / ("a" if shared else "b"))
    assert restored.load(tmp_path / "t.spark").applied
    assert memory_digest(restored.memory) == memory_digest(original.memory)

    want = _edit_and_continue(original)
    got = _edit_and_continue(restored)
    # The original re-read from a snapshot of its first prompt (past the exact blocks: sinks + window)
    assert original.memory.reused_tokens > 4 + GEOMETRY["window"]  # type: ignore[attr-defined]  # a CascadeMemory
    assert got == want
    assert memory_digest(restored.memory) == memory_digest(original.memory)
