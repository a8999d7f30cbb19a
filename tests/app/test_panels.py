"""The inspector and its detail panels update while a reply streams, and show the engine's thermal decisions."""

from __future__ import annotations

import time
from pathlib import Path

from app.inspector import model_line
from app.main_window import MainWindow
from app.worker_types import ModelInfo
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
            seen.append((window.inspector.cache_panel._rows["working"].detail.text(), window.inspector.performance_panel.tokens.text()))
            if len(set(seen)) >= 2:  # seen enough: end the reply early
                window.client.stop()

    gui(window.client.worker.memory).connect(sample)
    with qtbot.waitSignal(gui(window.client.worker.finished), timeout=WAIT_MS):
        window.submit("Fill the cache a little")
    assert len(seen) >= 2, "the panels were not updated while streaming"
    assert len({s for s in seen}) >= 2, "panel values did not change while streaming"
    assert set(window.inspector.cache_panel._rows) == {"working", "episodic", "persistent"}
    assert "generated" in window.inspector.performance_panel.tokens.text()
    assert window.inspector.performance_panel.backend.text().startswith("cpu, q8_0 weights, native")  # the app's CPU default
    assert "tokens/s" in window.inspector.performance_panel.speed.text()
    assert "in memory" in window.inspector.session_panel.tokens.text()
    assert window.inspector.memory_panel.model.text().endswith("kB")


def test_thermal_panel_says_what_the_engine_does(qtbot, window: MainWindow, gui, thermal: ScriptedThermal) -> None:  # type: ignore[no-untyped-def]
    thermal.state = ThermalState.SERIOUS
    window.monitor._policy.mark_stale()
    with qtbot.waitSignal(gui(window.client.worker.finished), timeout=WAIT_MS):
        window.submit("Warm it up")
    qtbot.waitUntil(lambda: "throttled: thermal serious" in window.inspector.thermal_panel.action.text(), timeout=WAIT_MS)
    with qtbot.waitSignal(window.monitor.sampled, timeout=WAIT_MS):
        pass
    assert "Serious" in window.inspector.thermal_panel.state.text()
    assert "pause per token" in window.inspector.thermal_panel.limits.text()
    assert window.inspector.memory_panel.rss.text() != "—"


def test_inspector_speaks_plainly_and_toggles(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    window.show()
    with qtbot.waitSignal(gui(window.client.worker.finished), timeout=WAIT_MS):
        window.submit("Hello")
    insp = window.inspector
    assert insp.memory.body.text().startswith("Remembers the last ")
    assert "earlier passage" in insp.memory.body.text()
    model = insp.model.body.text()
    assert model.startswith("tiny-model0 runs on the CPU with q8_0 weights")  # model, backend, precision
    assert "Skipped faster choices: coreml: " in model_line(ModelInfo("m", Path("m"), "cpu", "cpu, q8_0 weights (skipped coreml: not a Mac; mps: no GPU)", 0, 0))
    assert insp.model.body.wordWrap()  # the whole line wraps instead of being cut off
    assert not insp.details.isVisible()  # the jargon waits behind the disclosure
    insp.details_button.click()
    assert insp.details.isVisible() and insp.cache_panel.isVisible()
    assert insp.isVisible()
    window.inspector_action.trigger()  # ⌘I / Ctrl+I
    assert not insp.isVisible() and prefs.inspector_visible() is False
    window.inspector_action.trigger()
    assert insp.isVisible()


def test_a_narrow_window_folds_the_inspector_away_and_back(qtbot, window: MainWindow, prefs) -> None:  # type: ignore[no-untyped-def]
    window.show()
    window.resize(1400, 860)
    qtbot.waitUntil(lambda: window.inspector.isVisible())
    window.resize(900, 700)
    qtbot.waitUntil(lambda: not window.inspector.isVisible())
    assert prefs.inspector_visible() is True  # the user's choice is kept
    qtbot.waitUntil(lambda: window.chat.width() >= 600, timeout=3000)  # the chat keeps the room at 900 px
    window.resize(1400, 860)
    qtbot.waitUntil(lambda: window.inspector.isVisible())
