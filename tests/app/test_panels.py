"""The docked panels update while a reply streams, and show the engine's thermal decisions."""

from __future__ import annotations

import time

from app.main_window import MainWindow
from engine.hw import ThermalState
from tests.app.conftest import WAIT_MS, ScriptedThermal, set_reply_tokens


def test_panels_update_during_generation(qtbot, window: MainWindow, gui, prefs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 400)
    # The tiny model decodes a reply faster than the panels' report interval: pace it at >= 2 ms a token (the
    # engine's own pacing hook), so the reply outlasts several reports. Stopped once two differ.
    policy = window.monitor._policy
    paced = policy.before_step
    monkeypatch.setattr(policy, "before_step", lambda should_stop: (time.sleep(0.002), paced(should_stop))[1])
    seen: list[tuple[str, str]] = []

    def sample(_report: object) -> None:
        if window.client.busy:
            seen.append((window.cache_panel._rows["working"].detail.text(), window.performance_panel.tokens.text()))
            if len(set(seen)) >= 2:  # seen enough: end the reply early
                window.client.stop()

    gui(window.client.worker.memory).connect(sample)
    with qtbot.waitSignal(gui(window.client.worker.finished), timeout=WAIT_MS):
        window.submit("Fill the cache a little")
    assert len(seen) >= 2, "the panels were not updated while streaming"
    assert len({s for s in seen}) >= 2, "panel values did not change while streaming"
    assert set(window.cache_panel._rows) == {"working", "episodic", "persistent"}
    assert "generated" in window.performance_panel.tokens.text()
    assert window.performance_panel.backend.text().startswith("cpu, q8_0 weights, native")  # the app's CPU default
    assert "tokens/s" in window.performance_panel.speed.text()
    assert "in memory" in window.session_panel.tokens.text()
    assert window.memory_panel.model.text().endswith("kB")


def test_thermal_panel_says_what_the_engine_does(qtbot, window: MainWindow, gui, thermal: ScriptedThermal) -> None:  # type: ignore[no-untyped-def]
    thermal.state = ThermalState.SERIOUS
    window.monitor._policy.mark_stale()
    with qtbot.waitSignal(gui(window.client.worker.finished), timeout=WAIT_MS):
        window.submit("Warm it up")
    qtbot.waitUntil(lambda: "throttled: thermal serious" in window.thermal_panel.action.text(), timeout=WAIT_MS)
    with qtbot.waitSignal(window.monitor.sampled, timeout=WAIT_MS):
        pass
    assert "Serious" in window.thermal_panel.state.text()
    assert "pause per token" in window.thermal_panel.limits.text()
    assert window.memory_panel.rss.text() != "—"


def test_panels_toggle_from_the_view_menu(window: MainWindow) -> None:
    window.show()
    for dock in window.panels:
        toggle = dock.toggleViewAction()
        was = dock.isVisible()
        toggle.trigger()
        assert dock.isVisible() is not was
        toggle.trigger()
        assert dock.isVisible() is was
