"""The app's sampling choice (an explicit switch, migrated from older preference files), a conversation's own
override, what they resolve to, and stored choices checked as hostile input."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings

from app.settings.conversation_sampling import ConversationSamplingDialog
from app.settings.preferences import Preferences
from app.settings.sampling_choice import (
    SamplingChoice,
    SamplingSource,
    choice_from_json,
    resolve,
    resolved_words,
)
from engine import GenerationSettings, InvalidSamplingSettings, SamplingSettings
from tests.helpers.sampling import model_sampling

MODEL = model_sampling("catalog")
MINE = SamplingSettings(temperature=0.5, top_k=7, seed=3)


def prefs_at(path: Path) -> Preferences:
    return Preferences(QSettings(str(path), QSettings.Format.IniFormat))


def test_the_app_choice_resolves_to_the_models_defaults_with_the_users_seed() -> None:
    r = resolve(SamplingChoice(True, replace(MINE, greedy=True)), None, MODEL)
    assert r.sampling == replace(SamplingSettings.from_model(MODEL, 3), greedy=True)
    assert r.source is SamplingSource.APP and r.model_defaults
    assert resolved_words(r).startswith("the app setting: the model's defaults (greedy, top-p 0.9")
    own = resolve(SamplingChoice(False, MINE), None, MODEL)
    assert own.sampling == MINE and resolved_words(own).startswith("the app setting: the values chosen in Settings")


def test_a_conversations_override_wins_and_a_server_model_gets_the_users_values() -> None:
    app = SamplingChoice(True, SamplingSettings())
    r = resolve(app, SamplingChoice(False, MINE), MODEL)
    assert r.sampling == MINE and r.source is SamplingSource.CONVERSATION
    assert resolved_words(r).startswith("this conversation's setting: its own values (temperature 0.5")
    theirs = resolve(SamplingChoice(False, MINE), SamplingChoice(True, MINE), MODEL)
    assert theirs.sampling == SamplingSettings.from_model(MODEL, 3)
    assert resolved_words(theirs).startswith("this conversation's setting: the model's defaults")
    remote = resolve(SamplingChoice(True, MINE), None, None)  # a server's model: no defaults of its own known here
    assert remote.sampling == MINE and not remote.model_defaults
    assert "the values chosen in Settings, as the model's own defaults are not known here" in resolved_words(remote)


def test_the_switch_round_trips_and_keeps_the_users_own_values(tmp_path: Path) -> None:
    p = prefs_at(tmp_path / "p.ini")
    assert p.sampling_choice() == SamplingChoice(True, SamplingSettings())  # a fresh install: the model's own
    p.set_generation(GenerationSettings(sampling=MINE))
    p.set_use_model_defaults(True)  # own values kept while the model's defaults answer
    p.sync()
    assert prefs_at(tmp_path / "p.ini").sampling_choice() == SamplingChoice(True, MINE)
    p.set_generation(GenerationSettings(sampling=SamplingSettings()))  # exactly the generic values, on purpose
    p.set_use_model_defaults(False)
    p.sync()
    assert prefs_at(tmp_path / "p.ini").sampling_choice() == SamplingChoice(False, SamplingSettings())


@pytest.mark.parametrize(
    ("sampling", "model_defaults"),
    [('{"temperature": 0.7, "seed": 5}', True), ('{"temperature": 0.3, "top_p": 0.8}', False)],
)
def test_an_older_preferences_file_loads_as_it_did(tmp_path: Path, sampling: str, model_defaults: bool) -> None:
    # Written before the switch existed: the generic knobs (seed and greedy aside) meant "the model's own".
    old = tmp_path / "old.ini"
    old.write_text(
        '[generation]\nsettings="{\\"max_tokens\\": 300, \\"sampling\\": ' + sampling.replace('"', '\\"') + '}"\n',
        encoding="utf-8",
    )
    p = prefs_at(old)
    assert p.generation().max_tokens == 300
    assert p.use_model_defaults() is model_defaults


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("fast", "not a sampling choice"),
        ({"use_model_defaults": "yes", "own": {}}, "not true or false"),
        ({"use_model_defaults": False, "own": {"temperature": -1.0}}, "temperature must be"),
        ({"use_model_defaults": False, "own": {"top_k": 10**5000}}, "not a usable number"),
        ({"use_model_defaults": False, "own": {"temperature": float("nan")}}, "not a usable number"),
        ({"use_model_defaults": False, "own": {"temperature": "x" * 10_000}}, "not a usable number"),
        ({"use_model_defaults": False, "own": {"__class__": 1}}, "does not know"),
        ({"use_model_defaults": False, "own": [], "extra": 1}, "not a sampling choice"),
    ],
)
def test_a_hostile_stored_choice_is_refused_in_one_sentence(raw: object, words: str) -> None:
    with pytest.raises(InvalidSamplingSettings) as err:
        choice_from_json(raw)
    assert words in str(err.value) and len(str(err.value)) < 200 and "\n" not in str(err.value)


def test_the_sheet_offers_the_apps_setting_the_models_defaults_or_its_own(qtbot) -> None:  # type: ignore[no-untyped-def]
    app = SamplingChoice(True, SamplingSettings())
    d = ConversationSamplingDialog(None, app, MODEL)
    qtbot.addWidget(d)
    assert d.follow_app.isChecked() and d.edit().choice is None and not d.form.temperature.isEnabled()
    d.model.setChecked(True)
    assert d.form.temperature.value() == 0.2 and not d.form.temperature.isEnabled() and d.form.seed.isEnabled()
    assert d.edit().choice == SamplingChoice(True, SamplingSettings())
    d.custom.setChecked(True)
    # Its own values, to edit, starting from those in use (the model's), not the generic ones.
    assert d.form.temperature.isEnabled() and d.form.temperature.value() == 0.2 and d.form.top_p.value() == 0.9
    d.form.temperature.setValue(0.4)
    d.model.setChecked(True)  # back and forth: the edit is kept
    d.custom.setChecked(True)
    in_use = resolve(app, None, MODEL).sampling
    assert d.edit().choice == SamplingChoice(False, replace(in_use, temperature=0.4))
    reopened = ConversationSamplingDialog(SamplingChoice(False, MINE), app, MODEL)
    qtbot.addWidget(reopened)
    assert reopened.custom.isChecked() and reopened.form.temperature.value() == 0.5 and reopened.form.top_k.value() == 7
