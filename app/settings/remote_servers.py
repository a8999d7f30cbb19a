"""Remote OpenAI-compatible servers as model choices: the "Add a server…" dialog and where the choices are kept.

`AddServerDialog` asks for a base URL, an API key, a model and whether the model sees images (pictures go to it as
`image_url` parts only when ticked). "Check" lists the server's models (on a worker thread, so a slow server never
freezes the window), fills the model box, and ticks or clears "Sees images" where the server says (llama.cpp, Ollama
and LM Studio do; OpenAI's model list does not). `RemoteServerList` keeps the added
servers in QSettings as JSON (QSettings back ends disagree on types). Chatting with one goes through
`engine.openai.client.RemoteSession` (the same GenerationEvents as a local session); the cascade and session memory
panels do not apply to it.

The API key is stored in the app's settings file in plain text, as LM Studio and Jan do; the Keychain would be the
next step on macOS.
"""

from __future__ import annotations

import json
import threading

from PySide6.QtCore import QObject, QSettings, Signal, Slot
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from engine import RemoteClient, RemoteError, RemoteServer

SETTINGS_KEY = "remote/servers"


class RemoteServerList:
    """The remote servers the user added, in QSettings."""

    def __init__(self, settings: QSettings) -> None:
        self._s = settings

    def all(self) -> list[RemoteServer]:
        try:
            data = json.loads(str(self._s.value(SETTINGS_KEY, "") or "[]"))
        except json.JSONDecodeError:
            return []
        out = []
        for d in data if isinstance(data, list) else []:
            try:
                sees = d.get("sees_images", False) is True  # only a JSON true: a hand-edited value is not a yes
                out.append(RemoteServer(str(d["base_url"]), str(d["model"]), str(d.get("api_key", "")), sees))
            except (KeyError, TypeError, RemoteError):
                continue  # a hand-edited entry that no longer makes sense is skipped, the others stay
        return out

    def add(self, server: RemoteServer) -> None:
        """Keep `server`, replacing one with the same address and model (adding it again changes its settings)."""
        self._store([s for s in self.all() if (s.url, s.model) != (server.url, server.model)] + [server])

    def remove(self, server: RemoteServer) -> None:
        self._store([s for s in self.all() if (s.url, s.model) != (server.url, server.model)])

    def _store(self, servers: list[RemoteServer]) -> None:
        rows = [
            {"base_url": s.base_url, "model": s.model, "api_key": s.api_key, "sees_images": s.sees_images}
            for s in servers
        ]
        self._s.setValue(SETTINGS_KEY, json.dumps(rows))


class _ModelLister(QObject):
    """Lists a server's models on a plain thread, then asks whether the model chosen sees images, and reports back
    through queued signals."""

    listed = Signal(list)
    failed = Signal(str)
    seen = Signal(str, object)  # model, True | False | None (the server does not say)

    def run(self, base_url: str, api_key: str, model: str) -> None:
        def work() -> None:
            try:
                client = RemoteClient(RemoteServer(base_url, "-", api_key))
                try:
                    names = client.list_models()
                    self.listed.emit(names)
                    chosen = model if model in names else (names[0] if names else "")
                    if chosen:
                        asked = RemoteClient(RemoteServer(base_url, chosen, api_key))
                        try:
                            self.seen.emit(chosen, asked.sees_images())
                        finally:
                            asked.close()
                finally:
                    client.close()
            except RemoteError as exc:
                self.failed.emit(str(exc))

        threading.Thread(target=work, name="remote-models", daemon=True).start()


class AddServerDialog(QDialog):
    """Base URL, API key, model; `value()` is the RemoteServer once accepted."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Add a Server")
        self.url = QLineEdit()
        self.url.setPlaceholderText("http://192.168.1.20:8000/v1")
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("optional")
        self.model = QComboBox()
        self.model.setEditable(True)
        self.sees_images = QCheckBox("Sees images")
        self.sees_images.setToolTip(
            "Tick this if the server's model takes pictures (a vision model): they are sent to it with the message."
        )
        self.check = QPushButton("Check")
        self.status = QLabel("")
        self.status.setWordWrap(True)
        form = QFormLayout()
        form.addRow("Server URL", self.url)
        form.addRow("API key", self.key)
        form.addRow("Model", self.model)
        form.addRow("", self.sees_images)
        form.addRow("", self.check)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.status)
        layout.addWidget(buttons)
        self._lister = _ModelLister(self)
        self._lister.listed.connect(self._on_listed)
        self._lister.failed.connect(self._on_failed)
        self._lister.seen.connect(self._on_seen)
        self.check.clicked.connect(self._on_check)
        self._value: RemoteServer | None = None

    def value(self) -> RemoteServer | None:
        return self._value

    @Slot()
    def _on_check(self) -> None:
        self.status.setText("Asking the server for its models…")
        self.check.setEnabled(False)
        self._lister.run(self.url.text().strip(), self.key.text(), self.model.currentText().strip())

    @Slot(list)
    def _on_listed(self, names: list[str]) -> None:
        self.check.setEnabled(True)
        current = self.model.currentText()
        self.model.clear()
        self.model.addItems([str(n) for n in names])
        if current in names:
            self.model.setCurrentText(current)
        self.status.setText(
            f"The server offers {len(names)} model{'s' if len(names) != 1 else ''}."
            if names
            else "The server lists no models."
        )

    @Slot(str, object)
    def _on_seen(self, model: str, sees: bool | None) -> None:
        """The server said whether `model` sees images: the box follows (the user may still change it)."""
        if sees is None or model != self.model.currentText():
            return
        self.sees_images.setChecked(sees)
        words = "sees images" if sees else "reads text only"
        self.status.setText(f"{self.status.text()} It says {model} {words}.".strip())

    @Slot(str)
    def _on_failed(self, message: str) -> None:
        self.check.setEnabled(True)
        self.status.setText(message)

    def accept(self) -> None:
        try:
            self._value = RemoteServer(
                self.url.text().strip(),
                self.model.currentText().strip(),
                self.key.text(),
                self.sees_images.isChecked(),
            )
        except RemoteError as exc:
            self.status.setText(str(exc))
            return
        super().accept()
