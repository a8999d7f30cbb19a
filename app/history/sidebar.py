"""The history sidebar: the library's conversations (title over date and model), a search field (Esc clears it),
rename in place, and a context menu to duplicate, export, recall or delete one ("Recall in Current Conversation": its
memory joins the open conversation's, as an attached document does). It only shows the library and asks; the window
acts."""

from __future__ import annotations

import time

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, QPoint, QRect, QSize, Qt, Signal, Slot
from PySide6.QtGui import QColor, QFont, QGuiApplication, QKeyEvent, QPainter, QPalette
from PySide6.QtWidgets import (
    QAbstractItemView,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QVBoxLayout,
    QWidget,
)

from app.history.library import ConversationEntry, ConversationLibrary

ID_ROLE = Qt.ItemDataRole.UserRole
SUBTITLE_ROLE = Qt.ItemDataRole.UserRole + 1


def _mix(a: QColor, b: QColor, t: float) -> QColor:
    ca, cb = (a.redF(), a.greenF(), a.blueF()), (b.redF(), b.greenF(), b.blueF())
    return QColor.fromRgbF(*(x + (y - x) * t for x, y in zip(ca, cb, strict=True)))


class RowDelegate(QStyledItemDelegate):
    """A row: the title (the text an inline rename edits) over a smaller, dimmed line with the date and model."""

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex) -> QSize:
        line = option.fontMetrics.lineSpacing()
        sub = index.data(SUBTITLE_ROLE)
        return QSize(120, line * (2 if sub else 1) + 14)

    def paint(
        self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex
    ) -> None:
        opt = QStyleOptionViewItem(option)
        self.initStyleOption(opt, index)
        title, sub = opt.text, index.data(SUBTITLE_ROLE) or ""
        selected = bool(opt.state & QStyle.StateFlag.State_Selected)
        hovered = bool(opt.state & QStyle.StateFlag.State_MouseOver)
        pal: QPalette = opt.palette
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        if selected or hovered:  # a soft tint of the accent, the row's text keeps its own colour (light or dark)
            app = QGuiApplication.palette()  # the list's own is transparent (the sidebar shows through)
            strength = 0.22 if selected else 0.1
            tint = _mix(app.color(QPalette.ColorRole.Window), app.color(QPalette.ColorRole.Highlight), strength)
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(tint)
            painter.drawRoundedRect(opt.rect.adjusted(2, 1, -2, -1), 8, 8)
        rect: QRect = opt.rect.adjusted(10, 6, -8, -6)
        text_role = QPalette.ColorRole.Text
        font = QFont(opt.font)
        font.setWeight(QFont.Weight.DemiBold if sub else QFont.Weight.Normal)
        painter.setFont(font)
        painter.setPen(pal.color(text_role))
        line = painter.fontMetrics().lineSpacing()
        top = QRect(rect.left(), rect.top(), rect.width(), line)
        flags = Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter
        painter.drawText(top, flags, painter.fontMetrics().elidedText(title, Qt.TextElideMode.ElideRight, rect.width()))
        if sub:
            small = QFont(opt.font)
            small.setPointSizeF(max(small.pointSizeF() - 1.5, 8))
            painter.setFont(small)
            painter.setPen(pal.color(QPalette.ColorRole.PlaceholderText))
            bottom = QRect(rect.left(), rect.top() + line, rect.width(), line)
            elided = painter.fontMetrics().elidedText(sub, Qt.TextElideMode.ElideRight, rect.width())
            painter.drawText(bottom, flags, elided)
        painter.restore()


def when_text(epoch_s: float, now: float | None = None) -> str:
    """ "Just now", "12 min ago", "14:05" earlier today, "Yesterday", a weekday within the week, else the date."""
    now = time.time() if now is None else now
    if 0 <= now - epoch_s < 60:
        return "Just now"
    if 0 <= now - epoch_s < 3600:
        return f"{int(now - epoch_s) // 60} min ago"
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
    renamed = Signal(str, str)  # id, the title typed in place
    duplicate_requested = Signal(str)
    delete_requested = Signal(str)
    export_requested = Signal(str, str)  # id, "md" | "json"
    recall_requested = Signal(str)  # id: an earlier conversation to join the open one's memory

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
        self.list.setItemDelegate(RowDelegate(self.list))
        self.list.setEditTriggers(QAbstractItemView.EditTrigger.EditKeyPressed)  # Return/F2 on a row, or Rename
        self.list.itemActivated.connect(self._on_activated)
        self.list.itemClicked.connect(self._on_activated)
        self.list.itemChanged.connect(self._on_item_changed)
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
            item = QListWidgetItem(e.title)
            item.setData(ID_ROLE, e.id)
            item.setData(SUBTITLE_ROLE, self._subtitle(e))
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
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

    def start_rename(self, conversation_id: str) -> bool:
        """Edit the row's title in place; False when the conversation has no row (nothing stored yet)."""
        for i in range(self.list.count()):
            item = self.list.item(i)
            if item.data(ID_ROLE) == conversation_id:
                self.list.setCurrentItem(item)
                self.list.editItem(item)
                return True
        return False

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() == Qt.Key.Key_Escape and self.search.text():  # Esc clears the search, as in Finder
            self.search.clear()
            return
        super().keyPressEvent(event)

    @Slot(QListWidgetItem)
    def _on_item_changed(self, item: QListWidgetItem) -> None:
        cid = item.data(ID_ROLE)
        if cid:
            self.renamed.emit(str(cid), item.text())

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
        self.context_menu(str(cid)).exec(self.list.viewport().mapToGlobal(pos))

    def context_menu(self, cid: str) -> QMenu:
        """The menu of one conversation's row."""
        menu = QMenu(self)
        menu.addAction("Rename", lambda: self.start_rename(cid))
        menu.addAction("Duplicate", lambda: self.duplicate_requested.emit(cid))
        menu.addSeparator()
        menu.addAction("Export as Markdown…", lambda: self.export_requested.emit(cid, "md"))
        menu.addAction("Export as JSON…", lambda: self.export_requested.emit(cid, "json"))
        menu.addSeparator()
        recall = menu.addAction("Recall in Current Conversation", lambda: self.recall_requested.emit(cid))
        recall.setToolTip("The open conversation may draw on what was said in this one")
        recall.setEnabled(cid != self.current_id)  # a conversation is its own memory already
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete_requested.emit(cid))
        return menu
