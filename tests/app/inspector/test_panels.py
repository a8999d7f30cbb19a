"""The inspector and its detail panels update while a reply streams, and show the engine's thermal decisions."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtWidgets import QLabel, QWidget

from app.inspector.inspector import memory_words, model_line
from app.misc.signal_wait import GuiRelay
from app.window.main_window import MainWindow
from app.wiring import build_main_window
from app.worker.types import MemoryReport, ModelInfo
from engine import Speculation, TierStats
from engine.backends import open_backend
from engine.hw import ThermalState
from tests.helpers.app_window import WAIT_MS, ScriptedThermal, dispose, set_reply_tokens


class StepClock:
    """A clock that moves one second each time it is read: every report interval has passed at every token, so the
    worker reports after each one, whatever the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def reporting_window(qtbot, tiny_model: Path, prefs, dirs, dialogs, thermal) -> Iterator[MainWindow]:  # type: ignore[no-untyped-def]
    w = build_main_window(prefs, dirs, dialogs, thermal, clock=StepClock())
    with qtbot.waitSignal(GuiRelay(w.client.loaded, parent=w).fired, timeout=WAIT_MS):
        w.load_model(tiny_model, "cpu")
    yield w
    dispose(w)


def shown(panel: QWidget) -> str:
    """What a panel shows: its labels' text, in order."""
    return "\n".join(label.text() for label in panel.findChildren(QLabel) if label.text())


def test_panels_update_during_generation(qtbot, reporting_window: MainWindow, prefs) -> None:  # type: ignore[no-untyped-def]
    window = reporting_window
    set_reply_tokens(prefs, 16)
    during: list[str] = []  # the cache and performance panels after each memory report of the streaming reply
    reports = GuiRelay(window.client.memory, parent=window).fired  # queued after the inspector's own slot
    reports.connect(
        lambda _: (
            during.append(shown(window.inspector.cache_panel) + shown(window.inspector.performance_panel))
            if window.client.busy
            else None
        )
    )
    with qtbot.waitSignal(GuiRelay(window.client.finished, parent=window).fired, timeout=WAIT_MS):
        window.submit("Fill the cache a little")
    assert len(set(during)) >= 2, f"the panels did not change while the reply streamed: {during}"
    cache = shown(window.inspector.cache_panel)
    assert all(title in cache for title in ("Working (L1)", "Episodic (L2)", "Persistent (L3)"))
    assert "generated" in window.inspector.performance_panel.tokens.text()
    assert window.inspector.performance_panel.backend.text().startswith(
        "cpu, q8_0 weights, native"
    )  # the app's CPU default
    assert "tokens/s" in window.inspector.performance_panel.speed.text()
    assert "in memory" in window.inspector.session_panel.tokens.text()
    assert window.inspector.memory_panel.model.text().endswith("kB")


def test_thermal_panel_says_what_the_engine_does(qtbot, window: MainWindow, gui, thermal: ScriptedThermal) -> None:  # type: ignore[no-untyped-def]
    thermal.change(ThermalState.SERIOUS)
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.submit("Warm it up")
    qtbot.waitUntil(
        lambda: "throttled: thermal serious" in window.inspector.thermal_panel.action.text(), timeout=WAIT_MS
    )
    with qtbot.waitSignal(window.monitor.sampled, timeout=WAIT_MS):
        pass
    assert "Serious" in window.inspector.thermal_panel.state.text()
    assert "pause per token" in window.inspector.thermal_panel.limits.text()
    assert window.inspector.memory_panel.rss.text() != "—"


def test_inspector_speaks_plainly_and_toggles(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    window.show()
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.submit("Hello")
    insp = window.inspector
    assert insp.memory.body.text().startswith("Remembers this whole conversation word for word (")
    model = insp.model.body.text()
    assert model.startswith("tiny-model0 runs on the CPU")  # where, in words; the weights are the Details'
    assert "q8_0" not in model and "kernels" not in model
    plain = model_line(
        ModelInfo("m", Path("m"), "cpu", "cpu, q8_0 weights (skipped coreml: not a Mac; mps: no GPU)", 0, 0)
    )
    assert plain == "m runs on the CPU (the Neural Engine needs a Mac with Apple silicon)."
    evicted = TierStats("working", 64, 640, 900, 0, 0, 0.0, 500)
    recalled = TierStats("episodic", 3, 300, 900, 0, 0, 0.0, 0)
    assert memory_words(MemoryReport((evicted, recalled), 564)).startswith(
        "Remembers the last 64 tokens word for word and can recall 3 earlier passages when they matter"
    )
    assert insp.model.body.wordWrap()  # the whole line wraps instead of being cut off
    assert not insp.details.isVisible()  # the jargon waits behind the disclosure
    insp.details_button.click()
    assert insp.details.isVisible() and insp.cache_panel.isVisible()
    assert insp.isVisible()
    window.menus.inspector_action.trigger()  # ⌘I / Ctrl+I
    assert not insp.isVisible() and prefs.inspector_visible() is False
    window.menus.inspector_action.trigger()
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


def test_tokens_per_forward_show_whether_and_how_a_reply_speculated(
    qtbot, window: MainWindow, prefs, tiny_model
) -> None:  # type: ignore[no-untyped-def]
    panel = window.inspector.performance_panel
    set_reply_tokens(prefs, 16)

    def reply() -> str:
        with qtbot.waitSignal(GuiRelay(window.client.finished, parent=window).fired, timeout=WAIT_MS):
            window.submit("one two three one two three one two three")
        return panel.per_forward.text()

    # The default speculates for greedy replies where verifying pays (the native AVX-512 VNNI kernels); otherwise
    # the reply decodes plainly and the panel says speculation gave nothing.
    assert prefs.generation().speculative == Speculation.AUTO
    greedy = window.generation_settings().sampling.is_greedy
    if greedy and open_backend(tiny_model, "cpu", prefs.precision()).backend.verify_pays:
        assert reply().endswith(" tokens (speculative decoding)")
    else:
        assert reply() == "1 token (speculation would not speed up this reply here)"
    prefs.set_generation(replace(prefs.generation(), speculative=Speculation.OFF))
    assert reply() == "speculation off"
    prefs.set_generation(replace(prefs.generation(), speculative=Speculation.LOOKUP))  # always, where it runs
    value, _, words = reply().partition(" ")
    assert words == "tokens (speculative decoding)" and float(value) >= 1.0  # a forward gives one token or more


def test_the_speed_line_says_why_a_reopened_conversation_has_no_figure(qtbot: object) -> None:
    from app.inspector.inspector import NO_REPLY_YET, NOT_MEASURED_SINCE_OPENED, Inspector
    from app.worker.types import TurnProgress

    inspector = Inspector()
    inspector.show_transcript(replies=2)  # opened: replies from before, none measured yet
    assert inspector.speed.body.text() == NOT_MEASURED_SINCE_OPENED
    inspector.on_progress(TurnProgress(prompt_tokens=12, generated_tokens=5, ttft_s=0.2, tokens_per_s=30.0))
    measured = inspector.speed.body.text()
    assert measured.startswith("30 tokens a second")
    inspector.show_transcript(replies=3)  # back after an undo: the measured figure stays
    assert inspector.speed.body.text() == measured
    inspector.reset_conversation()  # a new chat
    inspector.show_transcript(replies=0)
    assert inspector.speed.body.text() == NO_REPLY_YET
