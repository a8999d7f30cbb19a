"""The history sidebar: the library's conversations (title, date, model), a search field, and a context menu to
rename, duplicate, export or delete one. It only shows the library and asks; the window acts."""

from __future__ import annotations

import time

from PySide6.QtCore import QPoint, Qt, Signal, Slot
from PySide6.QtWidgets import (
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QVBoxLayout,
    QWidget,
)

from app.library import ConversationEntry, ConversationLibrary

ID_ROLE = Qt.ItemDataRole.UserRole


def when_text(epoch_s: float, now: float | None = None) -> str:
    """ "14:05" today, "Yesterday", a weekday within the week, else the date."""
    now = time.time() if now is None else now
    t, n = time.localtime(epoch_s), time.localtime(now)
    days = (
        time.mktime((n.tm_year, n.tm_mon, n.tm_mday, 0, 0, 0, 0, 0, -1))
        - time.mktime((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0, 0, 0, -1))
    ) / 86400
    if days < 0.5:
        return time.strftime("%H:%M", t)
    if days < 1.5:
        return "Yesterday"
    if days < 7:
        return time.strftime("%A", t)
    return time.strftime("%d %b %Y", t)


class HistorySidebar(QWidget):
    open_requested = Signal(str)  # conversation id
    rename_requested = Signal(str)
    duplicate_requested = Signal(str)
    delete_requested = Signal(str)
    export_requested = Signal(str, str)  # id, "md" | "json"

    def __init__(self, library: ConversationLibrary, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("historySidebar")
        self.library = library
        self.current_id = ""
        self.search = QLineEdit()
        self.search.setObjectName("historySearch")
        self.search.setPlaceholderText("Search")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.refresh)
        self.list = QListWidget()
        self.list.setObjectName("historyList")
        self.list.setFrameShape(QListWidget.Shape.NoFrame)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._on_menu)
        self.list.itemActivated.connect(self._on_activated)
        self.list.itemClicked.connect(self._on_activated)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 10, 8, 8)
        layout.setSpacing(8)
        layout.addWidget(self.search)
        layout.addWidget(self.list, 1)

    def ids(self) -> list[str]:
        """The conversations as listed, top to bottom (⌘1…9 pick from these)."""
        return [self.list.item(i).data(ID_ROLE) for i in range(self.list.count())]

    @Slot()
    def refresh(self) -> None:
        self.list.blockSignals(True)
        self.list.clear()
        for e in self.library.entries(self.search.text()):
            item = QListWidgetItem(f"{e.title}\n{self._subtitle(e)}")
            item.setData(ID_ROLE, e.id)
            item.setToolTip(
                f"{e.title}\n{time.strftime('%d %b %Y, %H:%M', time.localtime(e.updated))}"
                + (f" · {e.model}" if e.model else "")
            )
            self.list.addItem(item)
            if e.id == self.current_id:
                item.setSelected(True)
                self.list.setCurrentItem(item)
        if not self.list.count():
            hint = QListWidgetItem("No matches." if self.search.text() else "Your conversations appear here.")
            hint.setFlags(Qt.ItemFlag.NoItemFlags)
            self.list.addItem(hint)
        self.list.blockSignals(False)

    def set_current(self, conversation_id: str) -> None:
        self.current_id = conversation_id
        self.refresh()

    def selected_id(self) -> str:
        item = self.list.currentItem()
        return str(item.data(ID_ROLE) or "") if item is not None else ""

    def _subtitle(self, e: ConversationEntry) -> str:
        return when_text(e.updated) + (f" · {e.model}" if e.model else "")

    @Slot(QListWidgetItem)
    def _on_activated(self, item: QListWidgetItem) -> None:
        cid = item.data(ID_ROLE)
        if cid and cid != self.current_id:
            self.open_requested.emit(cid)

    @Slot(QPoint)
    def _on_menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        cid = item.data(ID_ROLE) if item is not None else None
        if not cid:
            return
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.rename_requested.emit(cid))
        menu.addAction("Duplicate", lambda: self.duplicate_requested.emit(cid))
        menu.addSeparator()
        menu.addAction("Export as Markdown…", lambda: self.export_requested.emit(cid, "md"))
        menu.addAction("Export as JSON…", lambda: self.export_requested.emit(cid, "json"))
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete_requested.emit(cid))
        menu.exec(self.list.viewport().mapToGlobal(pos))
