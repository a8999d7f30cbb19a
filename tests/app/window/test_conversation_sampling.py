"""A conversation's own sampling (Chat ▸ Sampling for This Conversation…): its replies and Regenerate use it,
another conversation's do not, the inspector says whose settings a reply used, and it survives a relaunch."""

from __future__ import annotations

from pathlib import Path

from app.history.library import ConversationLibrary
from app.misc.signal_wait import GuiRelay
from app.settings.conversation_sampling import SamplingEdit
from app.settings.sampling_choice import SamplingChoice
from app.window.main_window import MainWindow
from app.wiring import build_main_window
from engine import SamplingSettings
from tests.helpers.app_window import WAIT_MS, ScriptedDialogs, dispose

MINE = SamplingSettings(temperature=0.5, top_k=7, seed=3)


def say(qtbot, gui, window: MainWindow, text: str) -> None:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        assert window.submit(text)


def used(window: MainWindow) -> SamplingSettings:
    """The sampler settings the worker's conversation answered the last reply with."""
    session = window.client.worker.session
    assert session is not None
    return session.sampler.settings


def test_a_conversations_own_sampling_answers_its_replies_and_not_anothers(
    qtbot, window: MainWindow, gui, prefs, dialogs: ScriptedDialogs
) -> None:  # type: ignore[no-untyped-def]
    app = prefs.generation().sampling  # the tests' own values, chosen in Settings
    dialogs.conversation_sampling = SamplingEdit(SamplingChoice(False, MINE))
    window.menus.conversation_sampling_action.trigger()  # before the first message: kept until it is stored
    assert "this conversation's setting: its own values (temperature 0.5" in window.inspector.sampling.body.text()
    say(qtbot, gui, window, "first")
    first = window.state.current_id
    assert used(window) == MINE
    assert window.inspector.sampling.body.text().startswith("The last reply used this conversation's setting")
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.regenerate()
    assert used(window) == MINE
    window.menus.new_chat_action.trigger()
    assert "the app setting: the values chosen in Settings" in window.inspector.sampling.body.text()
    say(qtbot, gui, window, "another")
    assert window.state.current_id != first and used(window) == app
    assert window.library.sampling_for(first) == SamplingChoice(False, MINE)
    assert window.library.sampling_for(window.state.current_id) is None


def test_the_models_defaults_for_one_conversation(qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "hello")
    dialogs.conversation_sampling = SamplingEdit(SamplingChoice(True, SamplingSettings(seed=8)))
    window.inspector.sampling_button.click()  # the inspector's way to the same sheet
    assert dialogs.asked[-1] == "conversation sampling"
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.regenerate()
    model = window.state.model_sampling
    assert model is not None and used(window) == SamplingSettings.from_model(model, 8)
    assert "this conversation's setting: the model's defaults" in window.inspector.sampling.body.text()
    dialogs.conversation_sampling = SamplingEdit(None)  # back to the app's setting
    window.menus.conversation_sampling_action.trigger()
    assert window.library.sampling_for(window.state.current_id) is None


def test_it_survives_a_relaunch(
    qtbot, window: MainWindow, gui, prefs, dirs, dialogs: ScriptedDialogs, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "remember how to sample")
    cid = window.state.current_id
    dialogs.conversation_sampling = SamplingEdit(SamplingChoice(False, MINE))
    window.menus.conversation_sampling_action.trigger()
    window.shutdown()
    library = ConversationLibrary(dirs.conversations)
    library.load()
    assert library.sampling_for(cid) == SamplingChoice(False, MINE) and not library.load_error
    library.close()
    again = build_main_window(prefs, dirs, dialogs)
    try:
        with qtbot.waitSignal(GuiRelay(again.client.restored, parent=again).fired, timeout=WAIT_MS):
            again.load_model(tiny_model, "cpu")
        assert again.state.current_id == cid
        with qtbot.waitSignal(GuiRelay(again.client.finished, parent=again).fired, timeout=WAIT_MS):
            assert again.submit("and now?")
        assert used(again) == MINE
    finally:
        dispose(again)


def test_a_duplicate_samples_as_the_original(qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "copy me")
    original = window.state.current_id
    dialogs.conversation_sampling = SamplingEdit(SamplingChoice(False, MINE))
    window.menus.conversation_sampling_action.trigger()
    before = {e.id for e in window.library.entries()}
    window.commands.duplicate(original)
    (copy,) = {e.id for e in window.library.entries()} - before
    assert window.library.sampling_for(copy) == SamplingChoice(False, MINE)
