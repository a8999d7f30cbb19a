"""Settings shows the model's own sampling defaults with where they came from; "Use the model's defaults" is an
explicit switch kept beside the user's own values, which come back when it is switched off."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtWidgets import QDialogButtonBox

from app.settings.settings_dialog import SettingsDialog, describe
from engine import GenerationSettings, SamplingSettings
from tests.helpers.sampling import model_sampling

OWN = model_sampling("catalog", "loop_guard")


def test_the_models_defaults_are_shown_with_their_source(qtbot) -> None:  # type: ignore[no-untyped-def]
    d = SettingsDialog(GenerationSettings(max_tokens=100), model_defaults=OWN)
    qtbot.addWidget(d)
    assert d.use_model_defaults.isChecked()
    note = d.model_defaults_note.text()
    assert "temperature 0.2" in note and "top-p 0.9" in note and "top-k 40" in note and "min-p 0.05" in note
    assert "repetition penalty 1.1" in note and "the model catalog and a loop guard for small models" in note
    assert (d.temperature.value(), d.top_p.value(), d.top_k.value()) == (0.2, 0.9, 40)
    assert (d.min_p.value(), d.repetition.value()) == (0.05, 1.1)
    assert not d.temperature.isEnabled() and not d.repetition.isEnabled()
    edited = d.edited()
    assert edited.use_model_defaults and edited.generation.max_tokens == 100
    assert edited.generation.sampling == SamplingSettings()  # the user's own values stay what they were


def test_switching_the_models_defaults_off_brings_back_the_users_own_values(qtbot) -> None:  # type: ignore[no-untyped-def]
    mine = SamplingSettings(temperature=0.7, top_p=1.0, top_k=0, seed=4)  # exactly the generic values: still mine
    d = SettingsDialog(GenerationSettings(sampling=mine), model_defaults=OWN, use_model_defaults=True)
    qtbot.addWidget(d)
    assert d.temperature.value() == 0.2  # the model's, greyed
    d.use_model_defaults.setChecked(False)
    assert d.temperature.isEnabled() and d.temperature.value() == 0.7 and d.top_k.value() == 0
    d.temperature.setValue(0.5)
    edited = d.edited()
    assert not edited.use_model_defaults and edited.generation.sampling == replace(mine, temperature=0.5)
    d.use_model_defaults.setChecked(True)  # on again: the model's are shown, the edit is kept to come back to
    assert d.temperature.value() == 0.2 and d.edited().generation.sampling.temperature == 0.5
    d.use_model_defaults.setChecked(False)
    assert d.temperature.value() == 0.5
    again = SettingsDialog(edited.generation, model_defaults=OWN, use_model_defaults=False)  # reopened
    qtbot.addWidget(again)
    assert not again.use_model_defaults.isChecked() and again.temperature.value() == 0.5


def test_the_seed_stays_the_users_and_restore_defaults_turns_the_models_back_on(qtbot) -> None:  # type: ignore[no-untyped-def]
    chosen = SamplingSettings(temperature=1.3, top_p=0.5, seed=9)
    d = SettingsDialog(GenerationSettings(sampling=chosen), model_defaults=OWN, use_model_defaults=False)
    qtbot.addWidget(d)
    assert d.temperature.value() == 1.3
    d.use_model_defaults.setChecked(True)
    assert d.temperature.value() == 0.2 and d.top_p.value() == 0.9 and d.seed.isEnabled()
    d.seed.setValue(12)
    assert d.edited().generation.sampling == replace(chosen, seed=12)
    d.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.RestoreDefaults).click()
    assert d.use_model_defaults.isChecked() and d.temperature.value() == 0.2
    assert d.edited().generation.sampling == SamplingSettings()


def test_without_a_local_model_the_generic_values_are_shown(qtbot) -> None:  # type: ignore[no-untyped-def]
    d = SettingsDialog(GenerationSettings())
    qtbot.addWidget(d)
    assert d.use_model_defaults.isChecked() and "No local model" in d.model_defaults_note.text()
    assert d.temperature.value() == SamplingSettings().temperature


def test_greedy_from_the_model_is_named() -> None:
    assert describe(replace(OWN, greedy=True)).startswith("greedy, ")
