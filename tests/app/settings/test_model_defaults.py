"""Settings shows the model's own sampling defaults with where they came from; the user may override them, and
"Use the model's defaults" returns to them."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtWidgets import QDialogButtonBox

from app.settings.settings_dialog import SettingsDialog, describe, uses_model_defaults
from engine import GenerationSettings, ModelSampling, SamplingSettings

OWN = ModelSampling(
    temperature=0.2,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    repetition_penalty=1.1,
    repetition_window=64,
    greedy=False,
    sources=("catalog", "loop_guard"),
)


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
    assert uses_model_defaults(d.value().sampling) and d.value().max_tokens == 100


def test_an_override_starts_from_the_models_values_and_persists(qtbot) -> None:  # type: ignore[no-untyped-def]
    d = SettingsDialog(GenerationSettings(), model_defaults=OWN)
    qtbot.addWidget(d)
    d.use_model_defaults.setChecked(False)
    assert d.temperature.isEnabled() and d.repetition.isEnabled()
    d.temperature.setValue(0.5)
    s = d.value().sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (0.5, 0.9, 40, 0.05, 1.1)
    assert not uses_model_defaults(s)
    again = SettingsDialog(d.value(), model_defaults=OWN)  # reopened: the override is shown as such
    qtbot.addWidget(again)
    assert not again.use_model_defaults.isChecked() and again.temperature.value() == 0.5


def test_use_the_models_defaults_returns_to_them(qtbot) -> None:  # type: ignore[no-untyped-def]
    chosen = SamplingSettings(temperature=1.3, top_p=0.5, seed=9)
    d = SettingsDialog(GenerationSettings(sampling=chosen), model_defaults=OWN)
    qtbot.addWidget(d)
    assert not d.use_model_defaults.isChecked() and d.temperature.value() == 1.3
    d.use_model_defaults.setChecked(True)
    assert d.temperature.value() == 0.2 and d.top_p.value() == 0.9
    assert d.value().sampling == SamplingSettings(seed=9)  # the seed stays the user's
    d.use_model_defaults.setChecked(False)
    d.temperature.setValue(1.0)
    d.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.RestoreDefaults).click()
    assert d.use_model_defaults.isChecked() and d.temperature.value() == 0.2


def test_without_a_local_model_the_generic_values_are_shown(qtbot) -> None:  # type: ignore[no-untyped-def]
    d = SettingsDialog(GenerationSettings())
    qtbot.addWidget(d)
    assert d.use_model_defaults.isChecked() and "No local model" in d.model_defaults_note.text()
    assert d.temperature.value() == SamplingSettings().temperature


def test_greedy_from_the_model_is_named() -> None:
    assert describe(replace(OWN, greedy=True)).startswith("greedy, ")
