"""Model ▸ "Get Models…": the recommended models for this computer, a Hub search, the downloaded models, and one
download at a time with progress, pause and cancel.

Self-contained: it takes a `LibraryTasks` (the slow work, off the GUI thread), this machine's `Machine`, and how to
confirm a deletion and reveal a file; it tells the window what happened through two signals:

- `model_chosen(Path)`: the user wants to chat with this downloaded model now;
- `models_changed()`: a model was downloaded or deleted (the window's model menu lists them).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, QUrl, Signal, Slot
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.misc.words import counted
from app.models.cards import ModelCards
from app.models.tasks import LibraryTasks
from engine.hw.memory import format_bytes
from engine.library.download import DownloadProgress, Phase
from engine.library.hub import HubRepo, RepoFiles
from engine.library.recommend import Fit, Machine, recommend
from engine.library.store import LocalModel

THIS_MACHINE = "this computer"
FIT_WORDS = {
    Fit.RUNS_WELL: "✓ Runs well",
    Fit.FITS: f"✓ Fits {THIS_MACHINE}",
    Fit.SLOW: "Slow here",
    Fit.TOO_BIG: f"✗ Too big for {THIS_MACHINE}",
}
REVEAL_WORDS = "Show in Finder" if sys.platform == "darwin" else "Show in Folder"


def reveal_in_file_manager(path: Path) -> None:
    """Finder with the file selected on macOS; the file manager on the file's folder elsewhere."""
    if sys.platform == "darwin":
        subprocess.Popen(["open", "-R", str(path)])  # returns at once; Finder comes forward
    else:
        QDesktopServices.openUrl(QUrl.fromLocalFile(str(path.parent)))


def confirm_delete(parent: QWidget, name: str) -> bool:
    answer = QMessageBox.question(
        parent, "Delete Model", f"Delete {name}? Its file is removed from this computer; you can download it again."
    )
    return answer == QMessageBox.StandardButton.Yes


def describe_progress(p: DownloadProgress) -> str:
    if p.phase is Phase.CONNECTING:
        return f"Connecting for {p.file}…"
    if p.phase is Phase.VERIFYING:
        return f"Checking {p.file} (sha256 and GGUF header)…"
    if p.phase is Phase.DONE:
        return f"{p.file} is ready."
    parts = [f"{p.file}: {format_bytes(p.done_bytes)} of {format_bytes(p.total_bytes)}"]
    if p.bytes_per_s > 0:
        parts.append(f"{format_bytes(int(p.bytes_per_s))}/s")
    if p.eta_s is not None:
        parts.append(f"about {_duration(p.eta_s)} left")
    return " · ".join(parts)


def _duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _table(headers: list[str], stretch: int = 0) -> QTableWidget:
    t = QTableWidget(0, len(headers))
    t.setHorizontalHeaderLabels(headers)
    t.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    t.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    t.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    t.verticalHeader().setVisible(False)
    t.setAlternatingRowColors(True)
    t.setShowGrid(False)
    header = t.horizontalHeader()
    for col in range(len(headers)):
        mode = QHeaderView.ResizeMode.Stretch if col == stretch else QHeaderView.ResizeMode.ResizeToContents
        header.setSectionResizeMode(col, mode)
    return t


def _cell(text: str, data: object = None, tip: str = "") -> QTableWidgetItem:
    item = QTableWidgetItem(text)
    if data is not None:
        item.setData(Qt.ItemDataRole.UserRole, data)
    if tip:
        item.setToolTip(tip)
    return item


class GetModelsDialog(QDialog):
    model_chosen = Signal(Path)
    models_changed = Signal()

    def __init__(
        self,
        tasks: LibraryTasks,
        machine: Machine,
        *,
        confirm: Callable[[QWidget, str], bool] = confirm_delete,
        reveal: Callable[[Path], None] = reveal_in_file_manager,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Get Models")
        self.setObjectName("getModelsDialog")
        self.tasks = tasks
        self.machine = machine
        self._confirm = confirm
        self._reveal = reveal
        self._last: tuple[str, str | None] | None = None  # the download to resume

        layout = QVBoxLayout(self)
        speed = (
            "measured on the loaded model"
            if machine.measured is not None
            and machine.bytes_per_s == machine.measured.weight_bytes * machine.measured.tokens_per_s
            else "estimated from its processors"
        )
        self.machine_label = QLabel(
            f"{THIS_MACHINE.capitalize()}: {format_bytes(machine.total_bytes)} of memory, {machine.processors}. Models that need up to "
            f"{format_bytes(machine.budget_bytes)} fit; speeds are {speed}. The default model keeps working without a network."
        )
        self.machine_label.setWordWrap(True)
        layout.addWidget(self.machine_label)

        self.tabs = QTabWidget()
        self.tabs.addTab(self._recommended_tab(), "Recommended")
        self.tabs.addTab(self._search_tab(), "Search Hugging Face")
        self.tabs.addTab(self._downloaded_tab(), "Downloaded")
        layout.addWidget(self.tabs, 1)
        layout.addWidget(self._download_strip())

        tasks.search_done.connect(self._on_search_done)
        tasks.files_ready.connect(self._on_files_ready)
        tasks.progress.connect(self._on_progress)
        tasks.downloaded.connect(self._on_downloaded)
        tasks.stopped.connect(self._on_stopped)
        tasks.removed.connect(self._on_removed)
        tasks.failed.connect(self._on_failed)
        self.fill_recommended()
        self.fill_downloaded()
        self.resize(1120, 660)

    # -- building ------------------------------------------------------------------------------------------------
    def _recommended_tab(self) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        self.recommended = ModelCards()
        self.recommended.currentRowChanged.connect(lambda _row: self._update_buttons())
        self.recommended.itemActivated.connect(lambda _item: self._download_recommended())
        v.addWidget(self.recommended)
        row = QHBoxLayout()
        note = QLabel("Sizes marked ~ are estimates; the Hub's exact size and checksum are used when downloading.")
        note.setObjectName("hint")
        row.addWidget(note, 1)
        self.get_button = QPushButton("Download")
        self.get_button.clicked.connect(self._download_recommended)
        row.addWidget(self.get_button)
        v.addLayout(row)
        return page

    def _search_tab(self) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        row = QHBoxLayout()
        self.query = QLineEdit()
        self.query.setPlaceholderText("Search GGUF models on Hugging Face, e.g. qwen3 or gemma-3")
        self.query.returnPressed.connect(self._search)
        self.search_button = QPushButton("Search")
        self.search_button.clicked.connect(self._search)
        row.addWidget(self.query, 1)
        row.addWidget(self.search_button)
        v.addLayout(row)
        split = QSplitter()
        self.repos = QListWidget()
        self.repos.currentItemChanged.connect(self._on_repo_chosen)
        self.files = _table(["File", "Size"])
        self.files.itemSelectionChanged.connect(self._update_buttons)
        self.files.itemDoubleClicked.connect(lambda _item: self._download_file())
        split.addWidget(self.repos)
        split.addWidget(self.files)
        split.setSizes([420, 520])
        v.addWidget(split, 1)
        row = QHBoxLayout()
        self.search_status = QLabel("")
        row.addWidget(self.search_status, 1)
        self.file_button = QPushButton("Download")
        self.file_button.clicked.connect(self._download_file)
        row.addWidget(self.file_button)
        v.addLayout(row)
        return page

    def _downloaded_tab(self) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        self.local = _table(["Model", "Size", "Family", "From"])
        self.local.itemSelectionChanged.connect(self._update_buttons)
        self.local.itemDoubleClicked.connect(lambda _item: self._use())
        v.addWidget(self.local)
        row = QHBoxLayout()
        self.folder_label = QLabel(f"Stored in {self.tasks.library.store.root}")
        self.folder_label.setObjectName("hint")
        row.addWidget(self.folder_label, 1)
        self.reveal_button = QPushButton(REVEAL_WORDS)
        self.reveal_button.clicked.connect(self._reveal_selected)
        self.delete_button = QPushButton("Delete…")
        self.delete_button.clicked.connect(self._delete)
        self.use_button = QPushButton("Chat with It")
        self.use_button.clicked.connect(self._use)
        for b in (self.reveal_button, self.delete_button, self.use_button):
            row.addWidget(b)
        v.addLayout(row)
        return page

    def _download_strip(self) -> QWidget:
        strip = QWidget()
        strip.setObjectName("downloadStrip")
        v = QVBoxLayout(strip)
        v.setContentsMargins(0, 0, 0, 0)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setTextVisible(False)
        v.addWidget(self.bar)
        h = QHBoxLayout()
        self.status = QLabel("")
        self.pause_button = QPushButton("Pause")
        self.pause_button.clicked.connect(self._pause_or_resume)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self._cancel)
        self.close_button = QPushButton("Close")
        self.close_button.clicked.connect(self.close)
        h.addWidget(self.status, 1)
        h.addWidget(self.pause_button)
        h.addWidget(self.cancel_button)
        h.addSpacing(12)
        h.addWidget(self.close_button)
        v.addLayout(h)
        self._show_transfer(False)
        return strip

    # -- filling -------------------------------------------------------------------------------------------------
    def fill_recommended(self) -> None:
        store = self.tasks.library.store
        rows = recommend(self.tasks.library.catalog, self.machine)
        self.recommended.fill([(r, FIT_WORDS[r.fit], store.find(r.model.repo, r.file.file) is not None) for r in rows])
        pick = next((i for i, r in enumerate(rows) if r.first_pick), None)
        if pick is not None:
            self.recommended.setCurrentRow(pick)
        self._update_buttons()

    def fill_downloaded(self) -> None:
        models = self.tasks.library.store.models()
        self.local.setRowCount(len(models))
        for i, m in enumerate(models):
            self.local.setItem(i, 0, _cell(m.name, m, str(m.path)))
            self.local.setItem(i, 1, _cell(format_bytes(m.size_bytes)))
            self.local.setItem(i, 2, _cell(m.family))
            self.local.setItem(i, 3, _cell(m.source.repo))
        self.tabs.setTabText(2, f"Downloaded ({len(models)})" if models else "Downloaded")
        self._update_buttons()

    # -- actions -------------------------------------------------------------------------------------------------
    def _selected(self, table: QTableWidget) -> object:
        rows = table.selectionModel().selectedRows() if table.selectionModel() else []
        if not rows:
            return None
        item = table.item(rows[0].row(), 0)
        return item.data(Qt.ItemDataRole.UserRole) if item else None

    def _update_buttons(self) -> None:
        busy = self.tasks.downloading
        self.get_button.setEnabled(not busy and self.recommended.chosen() is not None)
        self.file_button.setEnabled(not busy and self._selected(self.files) is not None)
        chosen = self._selected(self.local) is not None
        for b in (self.reveal_button, self.delete_button, self.use_button):
            b.setEnabled(chosen)

    @Slot()
    def _download_recommended(self) -> None:
        chosen = self.recommended.chosen()
        if chosen is not None:
            self.start_download(*chosen)

    @Slot()
    def _download_file(self) -> None:
        chosen = self._selected(self.files)
        repo = self.repos.currentItem()
        if isinstance(chosen, str) and repo is not None:
            self.start_download(str(repo.data(Qt.ItemDataRole.UserRole)), chosen)

    def start_download(self, repo: str, file: str | None) -> None:
        if not self.tasks.download(repo, file):
            self.status.setText("Another download is running; pause or cancel it first.")
            return
        self._last = (repo, file)
        self.status.setText(f"Starting {file or repo}…")
        self.bar.setValue(0)
        self.pause_button.setText("Pause")
        self._show_transfer(True)
        self._update_buttons()

    @Slot()
    def _pause_or_resume(self) -> None:
        if self.tasks.downloading:
            self.tasks.pause()
            self.pause_button.setEnabled(False)  # until the download says it stopped
        elif self._last is not None:
            self.start_download(*self._last)

    @Slot()
    def _cancel(self) -> None:
        if self.tasks.downloading:
            self.tasks.cancel()
        elif self._last is not None:  # paused: its partial file goes
            self.tasks.discard(*self._last)

    @Slot()
    def _search(self) -> None:
        query = self.query.text().strip()
        if not query:
            return
        self.search_status.setText(f"Searching for {query!r}…")
        self.search_button.setEnabled(False)
        self.tasks.search(query)

    @Slot()
    def _use(self) -> None:
        model = self._selected(self.local)
        if isinstance(model, LocalModel):
            self.model_chosen.emit(model.path)
            self.accept()

    @Slot()
    def _reveal_selected(self) -> None:
        model = self._selected(self.local)
        if isinstance(model, LocalModel):
            self._reveal(model.path)

    @Slot()
    def _delete(self) -> None:
        model = self._selected(self.local)
        if isinstance(model, LocalModel) and self._confirm(self, model.name):
            self.tasks.remove(model.name)

    # -- results -------------------------------------------------------------------------------------------------
    @Slot(str, list)
    def _on_search_done(self, query: str, repos: list[HubRepo]) -> None:
        self.search_button.setEnabled(True)
        self.repos.clear()
        self.files.setRowCount(0)
        for r in repos:
            gated = "  · gated" if r.gated else ""
            item = QListWidgetItem(f"{r.id}\n{r.downloads:,} downloads{gated}")
            item.setData(Qt.ItemDataRole.UserRole, r.id)
            self.repos.addItem(item)
        found = counted(len(repos), "GGUF repository", "GGUF repositories") if repos else "No GGUF repositories"
        verb = "matches" if len(repos) == 1 else "match"
        self.search_status.setText(f"{found} {verb} {query!r}; choose one to see its files.")

    @Slot(QListWidgetItem, QListWidgetItem)
    def _on_repo_chosen(self, current: QListWidgetItem | None, _previous: QListWidgetItem | None) -> None:
        self.files.setRowCount(0)
        if current is not None:
            repo = str(current.data(Qt.ItemDataRole.UserRole))
            self.search_status.setText(f"Listing the files of {repo}…")
            self.tasks.list_files(repo)

    @Slot(object)
    def _on_files_ready(self, files: RepoFiles) -> None:
        current = self.repos.currentItem()
        if current is None or current.data(Qt.ItemDataRole.UserRole) != files.repo:
            return  # an answer for a repo the user has since left
        self.files.setRowCount(len(files.files))
        for i, f in enumerate(files.files):
            self.files.setItem(i, 0, _cell(f.name, f.name))
            self.files.setItem(i, 1, _cell(format_bytes(f.size_bytes)))
        arch = f" ({files.architecture})" if files.architecture else ""
        self.search_status.setText(f"{files.repo}{arch}: {len(files.files)} GGUF files.")
        self._update_buttons()

    @Slot(object)
    def _on_progress(self, p: DownloadProgress) -> None:
        self.status.setText(describe_progress(p))
        if p.total_bytes:
            self.bar.setValue(int(1000 * p.done_bytes / p.total_bytes))
        self.bar.setRange(0, 0 if p.phase is Phase.VERIFYING else 1000)  # busy while checking

    @Slot(object)
    def _on_downloaded(self, model: LocalModel) -> None:
        self._show_transfer(False)
        self.status.setText(f"{model.name} is ready: choose it in the Model menu, or “Chat with It” here.")
        self.fill_downloaded()
        self.fill_recommended()
        self.tabs.setCurrentIndex(2)
        for i in range(self.local.rowCount()):
            item = self.local.item(i, 0)
            if item is not None and item.text() == model.name:
                self.local.selectRow(i)
        self.models_changed.emit()

    @Slot(str, str, str)
    def _on_stopped(self, repo: str, file: str, reason: str) -> None:
        self.pause_button.setEnabled(True)
        if reason == "paused":
            self.status.setText(f"Paused {file or repo}; Resume continues where it stopped.")
            self.pause_button.setText("Resume")
            self.bar.setRange(0, 1000)
        else:
            self._show_transfer(False)
            self.status.setText(f"Cancelled {file or repo}; nothing was kept.")
            self._last = None
        self._update_buttons()

    @Slot(str)
    def _on_removed(self, name: str) -> None:
        self.status.setText(f"Deleted {name}.")
        self.fill_downloaded()
        self.fill_recommended()
        self.models_changed.emit()

    @Slot(str, str)
    def _on_failed(self, what: str, message: str) -> None:
        if what == "download":
            self._show_transfer(False)
            self.pause_button.setEnabled(True)
        if what in ("search", "files"):
            self.search_button.setEnabled(True)
            self.search_status.setText(message)
        self.status.setText(message)
        self._update_buttons()

    def _show_transfer(self, on: bool) -> None:
        self.bar.setVisible(on)
        self.pause_button.setVisible(on)
        self.cancel_button.setVisible(on)
        self.cancel_button.setEnabled(on)
