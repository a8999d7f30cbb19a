"""The model's defaults the app resolves to are the engine's own for that model, and a local conversation answers
with exactly the sampling it is given (the window decides it: app setting or the conversation's own)."""

from __future__ import annotations

from pathlib import Path

import engine
from app.settings.sampling_choice import SamplingChoice, resolve
from app.worker.conversation import LocalConversation
from engine import GenerationSettings, SamplingSettings


def test_the_models_defaults_are_the_engines_own(tiny_model: Path, tmp_path: Path) -> None:
    eng = engine.load(tiny_model, "cpu", cache_dir=tmp_path / "kv")
    own = eng.default_settings(seed=5).sampling
    assert own != SamplingSettings(seed=5)  # a tiny model gets at least the loop guard for small models
    assert resolve(SamplingChoice(True, SamplingSettings(seed=5)), None, eng.sampling_defaults).sampling == own


def test_a_local_conversation_samples_as_it_is_told(tiny_model: Path, tmp_path: Path) -> None:
    eng = engine.load(tiny_model, "cpu", cache_dir=tmp_path / "kv")
    conv = LocalConversation(eng, None)
    chosen = SamplingSettings(temperature=0.3, top_p=0.5, seed=1)
    list(conv.chat("Hi", GenerationSettings(max_tokens=2, sampling=chosen), lambda: False))
    assert conv.session.sampler.settings == chosen  # exactly the same values: no inference from them
    generic = SamplingSettings(seed=1)
    list(conv.regenerate(GenerationSettings(max_tokens=2, sampling=generic), lambda: False))
    assert conv.session.sampler.settings == generic
