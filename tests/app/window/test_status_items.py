"""The status bar's items: a load shows its words with the seconds counting and Cancel, which asks to cancel; the
model's words replace them; the server's address shows only while it serves, and its link asks to copy it. In the
window, the model presenter says the client's loading and cancelling there."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QLabel, QMainWindow, QProgressBar, QPushButton

from app.window.main_window import MainWindow
from app.window.status_items import StatusItems


def test_loading_counts_seconds_offers_cancel_and_gives_way_to_the_model(qtbot) -> None:  # type: ignore[no-untyped-def]
    host = QMainWindow()
    qtbot.addWidget(host)
    now = [100.0]
    items = StatusItems(host.statusBar(), host, clock=lambda: now[0])
    host.show()
    model = next(label for label in host.statusBar().findChildren(QLabel) if label.text() == "No model")
    progress = host.statusBar().findChild(QProgressBar)
    cancel = host.statusBar().findChild(QPushButton)
    assert not progress.isVisible() and not cancel.isVisible()

    items.show_loading("Loading tiny…")
    assert model.text() == "Loading tiny…" and progress.isVisible() and cancel.isVisible()
    now[0] = 112.5
    qtbot.waitUntil(lambda: model.text() == "Loading tiny… (12 s)", timeout=5000)  # the clock ticks each second
    with qtbot.waitSignal(items.cancel_requested, timeout=1000):
        cancel.click()

    items.end_loading()
    items.show_model("tiny · runs on the CPU", "/models/tiny\nfp32")
    assert not progress.isVisible() and not cancel.isVisible()
    assert model.text() == "tiny · runs on the CPU" and model.toolTip() == "/models/tiny\nfp32"
    items.show_model("Model loading cancelled")  # no details given: the last ones stay
    assert model.toolTip() == "/models/tiny\nfp32"
    now[0] = 200.0
    qtbot.wait(1200)  # a tick after the load ended would have rewritten the words
    assert model.text() == "Model loading cancelled"


def test_the_server_address_shows_while_it_serves_and_its_link_asks_to_copy(qtbot) -> None:  # type: ignore[no-untyped-def]
    host = QMainWindow()
    qtbot.addWidget(host)
    items = StatusItems(host.statusBar(), host)
    host.show()
    server = host.statusBar().findChild(QLabel, "serverStatus")
    assert not server.isVisible()
    items.show_server(True, "http://127.0.0.1:8080/v1")
    assert (
        server.isVisible() and "Serving on http://127.0.0.1:8080/v1" in server.text() and 'href="copy"' in server.text()
    )
    with qtbot.waitSignal(items.copy_requested, timeout=1000):
        server.linkActivated.emit("copy")
    items.show_server(False, "http://127.0.0.1:8080/v1")
    assert not server.isVisible()


def test_the_window_says_a_load_and_its_cancelling_in_the_status_bar(window: MainWindow, tiny_model: Path) -> None:
    bar = window.statusBar()
    model = next(label for label in bar.findChildren(QLabel) if label.text().endswith(" · runs on the CPU"))
    cancel = bar.findChild(QPushButton)
    assert not cancel.isVisibleTo(window)
    window.client.loading.emit(str(tiny_model))  # as the worker says a load began
    assert model.text() == f"Loading {tiny_model.name}…" and cancel.isVisibleTo(window)
    window.client.load_cancelled.emit()
    assert model.text() == "Model loading cancelled" and not cancel.isVisibleTo(window)
    assert window.state.opening is None
