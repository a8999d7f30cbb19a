"""Small parts on their own: the coalescer, preferences, the settings dialog, the icons."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QSettings, Qt
from PySide6.QtWidgets import QDialogButtonBox, QLabel

from app.misc.coalescer import TextCoalescer
from app.misc.icons import app_icon, draw_app_icon, tray_icon
from app.misc.words import counted
from app.settings.conversation_sampling import ConversationSamplingDialog
from app.settings.preferences import Preferences
from app.settings.sampling_choice import SamplingChoice
from app.settings.settings_dialog import SettingsDialog
from app.worker.client import ConversationClient
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.generation.speculative import Speculation
from engine.hw import DecisionKind, HardwarePolicy, PolicyDecision, SystemMemorySource, ThermalState
from tests.helpers.app_window import ScriptedThermal
from tests.helpers.sampling import model_sampling


def test_coalescer_repaints_at_most_once_per_frame(qtbot) -> None:  # type: ignore[no-untyped-def]
    c = TextCoalescer(interval_ms=16)
    out: list[str] = []
    c.flushed.connect(out.append)
    for i in range(500):
        c.push(str(i % 10))
    assert out == []  # nothing until the frame timer fires
    qtbot.waitUntil(lambda: bool(out), timeout=1000)
    assert out == ["".join(str(i % 10) for i in range(500))]
    c.push("tail")
    c.flush()
    assert out[-1] == "tail"


def test_preferences_round_trip_and_survive_garbage(tmp_path: Path) -> None:
    s = QSettings(str(tmp_path / "p.ini"), QSettings.Format.IniFormat)
    prefs = Preferences(s)
    g = GenerationSettings(
        max_tokens=99,
        sampling=SamplingSettings(temperature=0.0, top_p=0.5, seed=None, greedy=True),
        speculative=Speculation.OFF,
    )
    assert prefs.generation().speculative == Speculation.AUTO  # on where it pays, until the user turns it off
    prefs.set_generation(g)
    assert Preferences(QSettings(str(tmp_path / "p.ini"), QSettings.Format.IniFormat)).generation() == g
    s.setValue("generation/settings", '{"sampling": {"temperature": -3}}')
    assert prefs.generation().sampling == SamplingSettings()


def test_settings_dialog_edits_and_validates(qtbot) -> None:  # type: ignore[no-untyped-def]
    d = SettingsDialog(GenerationSettings(max_tokens=33, sampling=SamplingSettings(seed=4)))
    qtbot.addWidget(d)
    assert d.value().max_tokens == 33 and d.value().sampling.seed == 4
    d.seed.setValue(-1)
    d.greedy.setChecked(True)
    assert d.value().sampling.seed is None and d.value().sampling.greedy
    assert not d.temperature.isEnabled()
    assert d.value().speculative == Speculation.OFF  # as the settings it was opened with say
    d.speculative.setChecked(True)
    assert d.value().speculative == Speculation.AUTO
    assert SettingsDialog(d.value()).speculative.isChecked()
    d.speculative.setChecked(False)
    d.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.RestoreDefaults).click()
    assert d.value().speculative == Speculation.AUTO and d.value().max_tokens == 33  # the app's default back


def test_icons_exist_and_draw(qtbot) -> None:  # type: ignore[no-untyped-def]
    assert not app_icon().isNull()
    icon = tray_icon()
    assert not icon.isNull() and icon.isMask()
    img = draw_app_icon(64)
    assert img.width() == 64 and img.pixelColor(32, 32).alpha() == 255


def test_a_shut_down_worker_no_longer_hears_the_policy(qtbot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    thermal = ScriptedThermal()
    policy = HardwarePolicy(thermal, SystemMemorySource())
    client = ConversationClient("test-worker", policy, tmp_path)
    heard: list[PolicyDecision] = []
    client.worker.policy.connect(heard.append, Qt.ConnectionType.DirectConnection)  # on the deciding thread
    thermal.change(ThermalState.SERIOUS)
    policy.refresh()
    assert DecisionKind.THROTTLE in [d.kind for d in heard]
    before = list(heard)
    assert client.shutdown()
    thermal.change(ThermalState.CRITICAL)
    policy.refresh()  # a pause is decided; the worker that was shut down is no longer told
    assert heard == before


def test_settings_show_their_wrapped_text_whole_at_the_default_size(qtbot) -> None:  # type: ignore[no-untyped-def]
    d = SettingsDialog(
        GenerationSettings(), model_defaults=model_sampling("generation_config", "catalog", "loop_guard")
    )
    qtbot.addWidget(d)
    d.show()
    qtbot.waitExposed(d)
    wrapped = [w for w in d.findChildren(QLabel) if w.wordWrap() and w.isVisible() and w.text()]
    assert wrapped
    for label in wrapped:
        assert label.height() >= label.heightForWidth(label.width()), label.text()


def test_the_conversation_sampling_sheet_starts_from_the_values_in_use(qtbot) -> None:  # type: ignore[no-untyped-def]
    model = model_sampling("generation_config")
    d = ConversationSamplingDialog(None, SamplingChoice(True, SamplingSettings()), model)
    qtbot.addWidget(d)
    d.custom.setChecked(True)  # "Use these settings": from the model's top-p 0.9 and penalty 1.1, not 1.0
    assert d.form.top_p.value() == 0.9 and d.form.repetition.value() == 1.1
    own = SamplingSettings(top_p=0.5)
    d2 = ConversationSamplingDialog(SamplingChoice(False, own), SamplingChoice(True, SamplingSettings()), model)
    qtbot.addWidget(d2)
    assert d2.form.top_p.value() == 0.5  # a conversation's own values stay its own


def test_counted_nouns() -> None:
    assert counted(1, "message") == "1 message" and counted(2, "message") == "2 messages"
    assert counted(1, "repository", "repositories") == "1 repository" and counted(0, "turn") == "0 turns"
