"""A session keeps its speculation controllers: a second reply starts with the costs and acceptance the first
measured, instead of measuring them again."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.generation.speculative import Speculation
from engine.session.engine import Engine, memory_factory_for
from tests.helpers.tiny import make_tiny_model

PROMPT = "one two three four one two three four one two three four five six seven one two three"


@pytest.mark.parametrize("mode", [Speculation.LOOKUP, Speculation.DRAFT])
def test_a_second_reply_starts_with_the_first_replys_measurements(tmp_path: Path, mode: Speculation) -> None:
    model = make_tiny_model(tmp_path / "m", layers=2)
    factory = memory_factory_for(model, cache_dir=tmp_path / "kv")
    draft = model if mode is Speculation.DRAFT else None  # the model drafting for itself: every draft accepted
    engine = Engine.load(model, "cpu", memory_factory=factory, draft_model=draft)
    session = engine.new_session()
    settings = GenerationSettings(
        max_tokens=30, sampling=SamplingSettings(greedy=True), speculative=mode, ignore_eos=True
    )
    list(session.complete(PROMPT, settings))
    ctl = session.controllers[Speculation.DRAFT if mode is Speculation.DRAFT else Speculation.LOOKUP]
    assert ctl.decode_s is not None and ctl.forwards > 0  # the first reply measured
    after_first = (ctl.decode_s, dict(ctl.verify_s), ctl.accept_rate, ctl.forwards)
    second = session.complete(" one two three", settings)
    next(second)  # the second reply's first token (from its prompt's forward): nothing measured yet
    assert (ctl.decode_s, dict(ctl.verify_s), ctl.accept_rate, ctl.forwards) == after_first
    list(second)
    assert ctl.forwards > after_first[3]  # the second reply measured into the same controller
