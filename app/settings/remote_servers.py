"""Remote OpenAI-compatible servers as model choices: the "Add a server…" dialog and where the choices are kept.

`AddServerDialog` asks for a base URL, an API key and a model; "Check" lists the server's models (on a worker
thread, so a slow server never freezes the window) and fills the model box. `RemoteServerList` keeps the added
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
                out.append(RemoteServer(str(d["base_url"]), str(d["model"]), str(d.get("api_key", ""))))
            except (KeyError, TypeError, RemoteError):
                continue  # a hand-edited entry that no longer makes sense is skipped, the others stay
        return out

    def add(self, server: RemoteServer) -> None:
        servers = [s for s in self.all() if (s.url, s.model) != (server.url, server.model)] + [server]
        self._s.setValue(
            SETTINGS_KEY,
            json.dumps([{"base_url": s.base_url, "model": s.model, "api_key": s.api_key} for s in servers]),
        )

    def remove(self, server: RemoteServer) -> None:
        servers = [s for s in self.all() if (s.url, s.model) != (server.url, server.model)]
        self._s.setValue(
            SETTINGS_KEY,
            json.dumps([{"base_url": s.base_url, "model": s.model, "api_key": s.api_key} for s in servers]),
        )


class _ModelLister(QObject):
    """Lists a server's models on a plain thread and reports back through queued signals."""

    listed = Signal(list)
    failed = Signal(str)

    def run(self, base_url: str, api_key: str) -> None:
        def work() -> None:
            try:
                client = RemoteClient(RemoteServer(base_url, "-", api_key))
                try:
                    self.listed.emit(client.list_models())
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
        self.check = QPushButton("Check")
        self.status = QLabel("")
        self.status.setWordWrap(True)
        form = QFormLayout()
        form.addRow("Server URL", self.url)
        form.addRow("API key", self.key)
        form.addRow("Model", self.model)
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
        self.check.clicked.connect(self._on_check)
        self._value: RemoteServer | None = None

    def value(self) -> RemoteServer | None:
        return self._value

    @Slot()
    def _on_check(self) -> None:
        self.status.setText("Asking the server for its models…")
        self.check.setEnabled(False)
        self._lister.run(self.url.text().strip(), self.key.text())

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

    @Slot(str)
    def _on_failed(self, message: str) -> None:
        self.check.setEnabled(True)
        self.status.setText(message)

    def accept(self) -> None:
        try:
            self._value = RemoteServer(self.url.text().strip(), self.model.currentText().strip(), self.key.text())
        except RemoteError as exc:
            self.status.setText(str(exc))
            return
        super().accept()
