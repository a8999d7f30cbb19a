"""The modal questions the main window asks, behind one small class so tests can answer them without a human."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QFileDialog, QMessageBox, QWidget

from app.settings_dialog import SettingsDialog
from engine.generate import GenerationSettings

SESSION_FILTER = "Spark sessions (*.spark)"


class Dialogs:
    def __init__(self, parent: QWidget | None = None) -> None:
        self.parent = parent

    def confirm(self, title: str, text: str, accept: str) -> bool:
        box = QMessageBox(QMessageBox.Icon.Question, title, text, QMessageBox.StandardButton.Cancel, self.parent)
        ok = box.addButton(accept, QMessageBox.ButtonRole.AcceptRole)
        box.setDefaultButton(ok)
        box.exec()
        return box.clickedButton() is ok

    def save_path(self, start: Path) -> Path | None:
        name, _ = QFileDialog.getSaveFileName(self.parent, "Save Session", str(start), SESSION_FILTER)
        if not name:
            return None
        path = Path(name)
        return path if path.suffix == ".spark" else path.with_suffix(".spark")

    def open_path(self, start: Path) -> Path | None:
        name, _ = QFileDialog.getOpenFileName(self.parent, "Open Session", str(start), SESSION_FILTER)
        return Path(name) if name else None

    def model_dir(self, start: Path) -> Path | None:
        name = QFileDialog.getExistingDirectory(self.parent, "Open Model Folder", str(start))
        return Path(name) if name else None

    def edit_settings(self, current: GenerationSettings) -> GenerationSettings | None:
        dialog = SettingsDialog(current, self.parent)
        return dialog.value() if dialog.exec() == SettingsDialog.DialogCode.Accepted else None
