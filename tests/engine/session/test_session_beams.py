"""Beam search in a conversation: the next turn continues from the chosen reply, and a session saved after beams
(compact or full) restores to the same continuation as never having stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.generation.beam import BeamSettings
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.session.engine import Engine, memory_factory_for
from tests.helpers.small_window import event_tokens as tokens
from tests.helpers.tiny import make_tiny_model

GREEDY = GenerationSettings(max_tokens=8, sampling=SamplingSettings(greedy=True), ignore_eos=True)
BEAMS = GenerationSettings(max_tokens=8, ignore_eos=True, beam=BeamSettings(3))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    d = make_tiny_model(tmp_path_factory.mktemp("sess-beams") / "m")
    factory = memory_factory_for(d, cache_dir=tmp_path_factory.mktemp("l3"), window=64, block_size=16)
    return Engine.load(d, "cpu", memory_factory=factory)


@pytest.mark.parametrize("compact", [False, True])
def test_a_session_saved_after_beams_continues_as_if_never_stopped(
    engine: Engine, tmp_path: Path, compact: bool
) -> None:
    a = engine.new_session()
    first = tokens(a.chat("The quick brown fox", BEAMS))
    assert len(first) == 8 and a.memory.tokens[-7:] == first[:7]
    path = tmp_path / "s.spark"
    a.save(path, compact=compact)
    second = tokens(a.chat("and then?", GREEDY))
    b = engine.new_session()
    b.load(path)
    assert tokens(b.chat("and then?", GREEDY)) == second
