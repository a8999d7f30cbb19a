"""A tiny model whose conversations overflow the window at once, and the tokens a reply's events carry: what the
session tests (saving, replaying, keeping, beams) run on."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from engine.generation.loop import GenerationEvent
from engine.session.engine import Engine, memory_factory_for


def small_window_engine(model: Path, cache_dir: Path) -> Engine:
    """`model` on the CPU with a 64-token window, 16-token blocks and 2 retrieval groups: a short conversation
    overflows it, so episodic blocks and routing state are part of what a session holds."""
    factory = memory_factory_for(model, cache_dir=cache_dir, window=64, block_size=16, retrieval_blocks=2)
    return Engine.load(model, "cpu", memory_factory=factory)


def event_tokens(events: Iterable[GenerationEvent]) -> list[int]:
    return [e.token for e in events if e.token is not None]
