"""Small parts on their own: the coalescer, preferences, the settings dialog, the icons."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QSettings, Qt
from PySide6.QtWidgets import QDialogButtonBox

from app.misc.coalescer import TextCoalescer
from app.misc.icons import app_icon, draw_app_icon, tray_icon
from app.settings.preferences import Preferences
from app.settings.settings_dialog import SettingsDialog
from app.worker.client import ConversationClient
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.generation.speculative import Speculation
from engine.hw import DecisionKind, HardwarePolicy, PolicyDecision, SystemMemorySource, ThermalState
from tests.helpers.app_window import ScriptedThermal


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
