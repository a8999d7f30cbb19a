"""Model ▸ Get Models… against the loopback Hub: recommendations for the machine, a Hub search with per-file sizes,
a download on its own thread with pause, resume and cancel, delete and reveal, and a downloaded model that chats in
the window and appears in its model menu."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import Qt, SignalInstance
from PySide6.QtWidgets import QLabel

from app.misc.signal_wait import GuiRelay
from app.models.cards import ModelCard
from app.models.dialog import FIT_WORDS, GetModelsDialog
from app.models.tasks import LibraryTasks
from app.window.main_window import MainWindow
from engine.library.catalog import load_catalog
from engine.library.hub import HubClient, HubSettings
from engine.library.library import Library
from engine.library.recommend import Fit, Machine, Recommendation
from engine.library.store import DOWNLOADS, ModelStore
from tests.helpers.app_window import WAIT_MS, dispose
from tests.helpers.fake_hub import FakeHub, running_hub
from tests.helpers.gguf_files import write_gguf

REPO = "spark-tests/tiny-GGUF"
FILE = "tiny-f32.gguf"


@pytest.fixture
def hub(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    data = write_gguf(tiny_model, tmp_path / FILE, "f32").read_bytes()
    with running_hub() as fake:
        fake.add(REPO, {FILE: data})
        yield fake


@pytest.fixture
def dialog(qtbot, hub: FakeHub, tmp_path: Path) -> GetModelsDialog:  # type: ignore[no-untyped-def]
    settings = HubSettings(endpoint=hub.endpoint, token=None, offline=False)
    library = Library(ModelStore(tmp_path / "models"), HubClient(settings), load_catalog(), free_space=free_space)
    d = GetModelsDialog(
        LibraryTasks(library), Machine(16 << 30, ("mps", "cpu")), confirm=lambda _w, _n: True, reveal=REVEALED.append
    )
    qtbot.addWidget(d)
    REVEALED.clear()
    CHECKED_SPACE_ON.clear()
    return d


REVEALED: list[Path] = []
CHECKED_SPACE_ON: list[str] = []  # the threads the downloads ran on


def free_space(_path: Path) -> int:
    CHECKED_SPACE_ON.append(threading.current_thread().name)
    return 1 << 40


def on_gui(d: GetModelsDialog, signal: SignalInstance) -> SignalInstance:
    """A LibraryTasks signal re-emitted on the GUI thread (pytest-qt's waiter would otherwise run on the task's)."""
    return GuiRelay(signal, parent=d).fired


def download(qtbot, d: GetModelsDialog, start: object) -> None:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(on_gui(d, d.tasks.downloaded), timeout=WAIT_MS):
        start()  # type: ignore[operator]


def test_recommendations_mark_what_fits_and_the_best_pick(dialog: GetModelsDialog) -> None:
    cards = dialog.recommended
    rows = {cards.card(i).name_label.text(): cards.card(i).fit_words for i in range(cards.count())}
    assert len(rows) == sum(not m.bundled for m in load_catalog().models)
    assert rows["Qwen3 8B"] == "★ Best pick · " + FIT_WORDS[Fit.RUNS_WELL]  # 16 GB with a graphics processor
    assert sum(text.startswith("★") for text in rows.values()) == 1
    assert cards.currentRow() == list(rows).index("Qwen3 8B") and cards.card(cards.currentRow()).property("selected")
    assert dialog.get_button.isEnabled()
    badges = [b.text() for b in cards.card(cards.currentRow()).findChildren(QLabel, "badge")]
    assert "Thinks" in badges and any("tokens/s here" in b for b in badges)  # Qwen3 reasons first; its speed here
    assert all(cards.card(i).accessibleName() for i in range(cards.count()))


def test_search_download_reveal_delete(qtbot, dialog: GetModelsDialog) -> None:  # type: ignore[no-untyped-def]
    dialog.tabs.setCurrentIndex(1)
    dialog.query.setText("tiny")
    with qtbot.waitSignal(on_gui(dialog, dialog.tasks.search_done), timeout=WAIT_MS):
        dialog.search_button.click()
    assert dialog.repos.count() == 1
    assert dialog.search_status.text().startswith("1 GGUF repository matches ")  # one, not "1 … repos"
    with qtbot.waitSignal(on_gui(dialog, dialog.tasks.files_ready), timeout=WAIT_MS):
        dialog.repos.setCurrentRow(0)
    assert dialog.files.rowCount() == 1 and dialog.files.item(0, 0).text() == FILE
    assert dialog.files.item(0, 1).text().endswith("kB")  # its size, from the Hub's metadata
    dialog.files.selectRow(0)
    changed: list[bool] = []
    dialog.models_changed.connect(lambda: changed.append(True))
    download(qtbot, dialog, dialog.file_button.click)
    assert CHECKED_SPACE_ON == ["models-download"]  # the download ran on its own thread, not the GUI's
    assert dialog.tabs.currentIndex() == 2 and dialog.local.rowCount() == 1 and changed == [True]
    assert "ready" in dialog.status.text()

    dialog.local.selectRow(0)
    dialog.reveal_button.click()
    assert [dialog.tasks.library.store.models()[0].path] == REVEALED
    chosen: list[Path] = []
    dialog.model_chosen.connect(chosen.append)
    with qtbot.waitSignal(on_gui(dialog, dialog.tasks.removed), timeout=WAIT_MS):
        dialog.delete_button.click()
    assert dialog.local.rowCount() == 0 and dialog.tasks.library.store.models() == [] and changed == [True, True]
    assert chosen == []


def test_pause_resume_and_cancel(qtbot, dialog: GetModelsDialog, hub: FakeHub) -> None:  # type: ignore[no-untyped-def]
    """A download is over by the time it says so: a Resume clicked as "paused" arrives starts it again, not pauses
    the one that just stopped."""
    busy_when_told: list[bool] = []
    for end in (dialog.tasks.stopped, dialog.tasks.downloaded):  # on the download's thread, as it tells
        end.connect(lambda *_a: busy_when_told.append(dialog.tasks.downloading), Qt.ConnectionType.DirectConnection)
    hub.repos[REPO].files[FILE].hold_after = 50_000  # the Hub stalls after a few bytes until released
    stopped = on_gui(dialog, dialog.tasks.stopped)
    with qtbot.waitSignal(stopped, timeout=WAIT_MS) as paused:
        dialog.start_download(REPO, FILE)
        dialog.pause_button.click()
    assert paused.args[0][2] == "paused" and dialog.pause_button.text() == "Resume"
    assert dialog.tasks.library.store.models() == []
    hub.release()
    download(qtbot, dialog, dialog.pause_button.click)  # Resume
    assert [m.source.file for m in dialog.tasks.library.store.models()] == [FILE]

    hub.add("spark-tests/other-GGUF", {"other.gguf": hub.repos[REPO].files[FILE].data})
    with qtbot.waitSignal(stopped, timeout=WAIT_MS) as cancelled:
        dialog.start_download("spark-tests/other-GGUF", "other.gguf")
        dialog.cancel_button.click()
    assert cancelled.args[0][2] == "cancelled" and "nothing was kept" in dialog.status.text()
    assert dialog.tasks.library.store.partials() == [] and len(dialog.tasks.library.store.models()) == 1
    assert busy_when_told == [False, False, False]  # paused, downloaded, cancelled


def test_cancel_while_paused_discards_what_was_kept(qtbot, dialog: GetModelsDialog, hub: FakeHub) -> None:  # type: ignore[no-untyped-def]
    hub.repos[REPO].files[FILE].hold_after = 50_000
    stopped = on_gui(dialog, dialog.tasks.stopped)
    kept = dialog.tasks.library.store.root / DOWNLOADS
    dialog.start_download(REPO, FILE)
    qtbot.waitUntil(lambda: any(kept.glob("*.part")), timeout=WAIT_MS)  # the partial file is begun
    with qtbot.waitSignal(stopped, timeout=WAIT_MS):
        dialog.pause_button.click()
    assert any(kept.glob("*.part")) and dialog.cancel_button.isEnabled()  # not greyed out while paused
    with qtbot.waitSignal(stopped, timeout=WAIT_MS) as cancelled:
        dialog.cancel_button.click()
    assert cancelled.args[0][2] == "cancelled" and "nothing was kept" in dialog.status.text()
    assert not any(kept.iterdir()) and not dialog.pause_button.isVisible()
    hub.release()


def test_offline_search_fails_at_once_in_one_sentence(qtbot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:  # a port nobody listens on: the Hub is unreachable
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = HubSettings(endpoint=f"http://127.0.0.1:{port}", token=None, offline=False)
    library = Library(ModelStore(tmp_path / "models"), HubClient(settings), load_catalog(), free_space=free_space)
    asked: list[str] = []
    library.hub.search = lambda query, limit=20: asked.append(query) or []  # type: ignore[method-assign]
    d = GetModelsDialog(LibraryTasks(library), Machine(16 << 30, ("cpu",)), confirm=lambda _w, _n: True)
    qtbot.addWidget(d)
    d.query.setText("qwen")
    with qtbot.waitSignal(on_gui(d, d.tasks.failed), timeout=WAIT_MS):
        d.search_button.click()
    assert asked == []  # the Hub client (and its retries) was never asked
    text = d.search_status.text()
    assert text.startswith("Cannot reach the Hugging Face Hub") and "\n" not in text and d.search_button.isEnabled()


def test_a_failure_is_one_sentence_in_the_dialog(qtbot, dialog: GetModelsDialog, hub: FakeHub) -> None:  # type: ignore[no-untyped-def]
    hub.repos[REPO].gated = True
    with qtbot.waitSignal(on_gui(dialog, dialog.tasks.failed), timeout=WAIT_MS):
        dialog.start_download(REPO, FILE)
    assert "gated" in dialog.status.text() and "\n" not in dialog.status.text()
    assert not dialog.pause_button.isVisible()


def test_a_downloaded_model_chats_in_the_window(
    qtbot, window: MainWindow, gui, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    window.menus.model_menu.aboutToShow.emit()
    assert "Get Models…" in [a.text() for a in window.menus.model_menu.actions()]
    window.menus.get_models_action.trigger()
    d = window.get_models_dialog
    assert isinstance(d, GetModelsDialog)
    assert d.isVisible()
    download(qtbot, d, lambda: d.start_download(REPO, FILE))
    window.menus.model_menu.aboutToShow.emit()  # the menu refills as it opens
    assert "tiny-f32" in [a.text() for a in window.menus.model_menu.actions()]
    d.local.selectRow(0)
    with qtbot.waitSignal(gui(window.client.loaded), timeout=WAIT_MS):
        d.use_button.click()
    assert window.state.model_path is not None and window.state.model_path.name == FILE
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        assert window.submit("Hello")
    assert window.chat.toPlainText().count("Hello") >= 1


def test_first_launch_offers_the_library_once(window: MainWindow, prefs, dirs, dialogs, thermal) -> None:  # type: ignore[no-untyped-def]
    from app.models import FIRST_LAUNCH_HINT
    from app.wiring import build_main_window

    assert prefs.models_offer_shown()
    assert window.notice.text() == FIRST_LAUNCH_HINT and window.notice.action_button.text() == "Get Models…"
    again = build_main_window(prefs, dirs, dialogs, thermal)
    try:
        assert again.notice.text() != FIRST_LAUNCH_HINT
    finally:
        dispose(again)


def test_a_model_that_sees_images_says_so_on_its_card(qtbot) -> None:  # type: ignore[no-untyped-def]
    # The catalog's `vision` flag (no catalog model has it yet: vision models come as folders, not one GGUF) is the
    # card's "Sees images" badge and `models recommend --json`'s `vision`; a text model's card has no such badge.
    base = next(m for m in load_catalog().models if not m.bundled)
    sees = replace(base, vision=True)
    for model, expected in ((base, False), (sees, True)):
        r = Recommendation(model, model.file(), Fit.RUNS_WELL, False, 20.0)
        card = ModelCard(r, FIT_WORDS[Fit.RUNS_WELL], downloaded=False)
        qtbot.addWidget(card)
        badges = [b.text() for b in card.findChildren(QLabel, "badge")]
        assert ("Sees images" in badges) is expected
        assert r.as_json()["vision"] is expected
