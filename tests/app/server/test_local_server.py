"""The "Local Server" switch and the "Add a server…" dialog: the server they start answers the openai client (the
loaded model and the library's models by name, loaded off the GUI thread), and the dialog lists and returns a remote
server (our own, on loopback)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import openai
import pytest
from PySide6.QtCore import QSettings
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QMenu

from app.misc.gap_meter import GapMeter
from app.server.local_server import LibraryServing, LocalServerController, install_local_server_menu, switch_text
from app.settings.remote_servers import AddServerDialog, RemoteServerList
from engine.library.store import ModelSource, ModelStore
from engine.openai.client import RemoteServer
from engine.openai.models import LoadSettings, loader_for
from engine.openai.pool import Loader
from engine.session.engine import Engine, memory_factory_for
from tests.helpers.gguf_files import write_gguf
from tests.helpers.http_clients import closed_after_test
from tests.helpers.tiny_families import make_tiny_qwen3

WAIT_MS = 30_000


def load(tiny_model: Path, tmp_path: Path) -> Engine:
    return Engine.load(tiny_model, "cpu", memory_factory=memory_factory_for(tiny_model, cache_dir=tmp_path / "kv"))


def test_switch_serves_the_loaded_model_and_copies_its_url(qtbot, tiny_model: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    controller = LocalServerController(port=0)
    menu = QMenu()
    menu.addAction("Quit MLoT Spark")
    switch, copy = install_local_server_menu(menu, controller)
    assert menu.actions()[0] is switch and not copy.isEnabled()
    errors: list[str] = []
    controller.failed.connect(errors.append)
    switch.setChecked(True)  # no model yet: refused in one sentence, the switch goes back off
    assert errors and "Load a model" in errors[0] and not switch.isChecked()

    controller.attach(load(tiny_model, tmp_path))
    with qtbot.waitSignal(controller.state_changed, timeout=WAIT_MS):
        switch.setChecked(True)
    try:
        assert controller.running and controller.url.startswith("http://127.0.0.1:")
        assert controller.url in switch.text() and copy.isEnabled()
        copy.trigger()
        assert QGuiApplication.clipboard().text() == controller.url
        client = closed_after_test(openai.OpenAI(base_url=controller.url, api_key="none", max_retries=0, timeout=60))
        assert [m.id for m in client.models.list().data] == [tiny_model.name]
        reply = client.chat.completions.create(
            model=tiny_model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        switch.setChecked(False)
    assert not controller.running and not copy.isEnabled() and switch.text() == switch_text(controller)


def test_library_models_are_served_by_name_loaded_off_the_gui_thread(  # type: ignore[no-untyped-def]
    qtbot, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The library holds a tiny Qwen3 GGUF: another tokenizer and template than the loaded tiny Llama.
    qwen = make_tiny_qwen3(tmp_path / "qwen")
    part = write_gguf(qwen, tmp_path / "part.gguf", "f32")
    source = ModelSource("test/tiny-qwen3", "tiny-qwen3.gguf", "0" * 40, "0" * 64, part.stat().st_size)
    other = ModelStore(tmp_path / "data" / "models").install(part, source, "qwen3").name
    load_threads: list[str] = []

    def recording_loader_for(settings: LoadSettings) -> Loader:
        load_model = loader_for(settings)

        def load_recorded(*args: Any) -> Any:
            load_threads.append(threading.current_thread().name)
            return load_model(*args)

        return load_recorded

    monkeypatch.setattr("app.server.local_server.loader_for", recording_loader_for)
    library = LibraryServing(tmp_path / "data" / "models", lambda: LoadSettings(backend="cpu", cache_dir=tmp_path))
    controller = LocalServerController(port=0, library=library)
    controller.attach(load(tiny_model, tmp_path))
    controller.start()
    try:
        client = closed_after_test(openai.OpenAI(base_url=controller.url, api_key="none", max_retries=0, timeout=120))
        listed = {m.id: m.model_extra["loaded"] for m in client.models.list().data}  # type: ignore[index]
        assert listed == {tiny_model.name: True, other: False}
        replies: dict[str, Any] = {}

        def ask() -> None:
            for name in (other, tiny_model.name):
                try:
                    replies[name] = client.chat.completions.create(
                        model=name, messages=[{"role": "user", "content": "The quick brown fox?"}], max_tokens=2
                    )
                except Exception as exc:  # reported below, on the test's thread
                    replies[name] = exc

        meter = GapMeter()
        meter.start()
        asking = threading.Thread(target=ask)
        asking.start()
        qtbot.waitUntil(lambda: not asking.is_alive(), timeout=4 * WAIT_MS)
        meter.stop()
        assert meter.ticks >= 2  # the GUI's event loop ran while the library model loaded and answered
        assert {name: r.model for name, r in replies.items()} == {other: other, tiny_model.name: tiny_model.name}
        # Each counted its prompt with its own tokenizer and template.
        assert replies[other].usage.prompt_tokens != replies[tiny_model.name].usage.prompt_tokens
        assert len(load_threads) == 1 and load_threads[0].startswith("spark-model-load")  # the pool's, not the GUI's
        listed = {m.id: m.model_extra["loaded"] for m in client.models.list().data}  # type: ignore[index]
        assert listed == {tiny_model.name: True, other: True}
    finally:
        controller.stop()


def test_add_server_dialog_lists_models_and_returns_the_server(qtbot, tiny_model: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    controller = LocalServerController(port=0)
    controller.attach(load(tiny_model, tmp_path))
    controller.start()
    try:
        dialog = AddServerDialog()
        qtbot.addWidget(dialog)
        dialog.url.setText("not a url")
        dialog.accept()
        assert dialog.value() is None and "not a server address" in dialog.status.text()
        dialog.url.setText(controller.url)
        with qtbot.waitSignal(dialog._lister.listed, timeout=WAIT_MS):
            dialog.check.click()
        assert dialog.model.count() == 1 and dialog.model.currentText() == tiny_model.name
        dialog.accept()
        assert dialog.value() == RemoteServer(controller.url, tiny_model.name, "")
    finally:
        controller.stop()


def test_server_list_round_trips_and_skips_broken_entries(tmp_path: Path) -> None:
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    servers = RemoteServerList(settings)
    a, b = RemoteServer("http://a:1/v1", "m1", "k"), RemoteServer("http://b:2/v1", "m2")
    servers.add(a)
    servers.add(b)
    servers.add(a)  # added again: replaces, no duplicate
    assert RemoteServerList(settings).all() == [b, a]
    servers.remove(b)
    assert servers.all() == [a]
    settings.setValue(
        "remote/servers",
        '[{"base_url": "ftp://x", "model": "m"}, {"nope": 1}, ' + '{"base_url": "http://c/v1", "model": "c"}]',
    )
    assert servers.all() == [RemoteServer("http://c/v1", "c")]
    settings.setValue("remote/servers", "{not json")
    assert servers.all() == []
