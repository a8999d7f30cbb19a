"""The local conversation answers with the model's own recommended sampling unless the user chose other settings."""

from __future__ import annotations

from pathlib import Path

import engine
from app.worker.conversation import LocalConversation
from engine import GenerationSettings, SamplingSettings


def test_generic_defaults_give_way_to_the_models_own(tiny_model: Path, tmp_path: Path) -> None:
    eng = engine.load(tiny_model, "cpu", cache_dir=tmp_path / "kv")
    conv = LocalConversation(eng, None)
    own = eng.default_settings().sampling
    assert own != SamplingSettings()  # a tiny model gets at least the loop guard for small models
    assert conv.with_model_sampling(GenerationSettings(max_tokens=7)).sampling == own
    chosen = SamplingSettings(temperature=0.3, top_p=0.5)
    kept = conv.with_model_sampling(GenerationSettings(max_tokens=7, sampling=chosen))
    assert kept.sampling == chosen and kept.max_tokens == 7  # the user's own choice wins


def test_the_models_defaults_keep_the_users_seed_and_greedy(tiny_model: Path, tmp_path: Path) -> None:
    eng = engine.load(tiny_model, "cpu", cache_dir=tmp_path / "kv")
    conv = LocalConversation(eng, None)
    own = eng.default_settings().sampling
    seeded = conv.with_model_sampling(GenerationSettings(sampling=SamplingSettings(seed=5, greedy=True))).sampling
    assert seeded.seed == 5 and seeded.greedy and seeded.repetition_penalty == own.repetition_penalty
