"""Documents attached to the open conversation, in the composer: a chip per attachment (its name, its size in
tokens once read, a ✕ that removes it or cancels its first reading), how files come in (the paperclip's file dialog,
files dropped on the window or the prompt, a file or a file's path pasted into the prompt), and the refusals in one
sentence. The chips follow the worker's memory reports; the bar only shows and asks, the window's client acts.

Pictures come in the same ways and sit in the same row as thumbnail chips (app.window.pictures), but they are not
memory: they wait for the next message and go with it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from PySide6.QtCore import QEvent, QMimeData, QObject, Qt, Signal, Slot
from PySide6.QtGui import QDragMoveEvent, QDropEvent
from PySide6.QtWidgets import QFileDialog, QFrame, QHBoxLayout, QLabel, QToolButton, QWidget

from app.window.pictures import PictureChip, is_picture
from app.worker.types import AttachKind, AttachmentView, AttachProgress, MemoryReport
from engine import DecodedImage

# What the file dialog offers (the engine decides what it reads: anything else is refused in one sentence).
DOCUMENTS = (
    "*.txt *.md *.markdown *.rst *.csv *.log *.html *.htm *.pdf *.py *.js *.ts *.c *.h *.cpp *.rs *.go *.java *.swift "
    "*.json *.yaml *.yml *.toml"
)
PICTURES = "*.png *.jpg *.jpeg *.webp *.gif"
DOCUMENT_FILTER = (
    f"Documents and pictures ({DOCUMENTS} {PICTURES});;Documents ({DOCUMENTS});;Pictures ({PICTURES});;All files (*)"
)
NOT_DOCUMENTS = frozenset({".spark", ".gguf"})  # conversations open and models load; they are never attached
MAX_PASTED_PATH = 4096


def attachable(path: Path) -> bool:
    """A dropped or pasted file the composer attaches (a folder, a model or a conversation is the window's)."""
    return path.is_file() and path.suffix.lower() not in NOT_DOCUMENTS


def dropped_documents(mime: QMimeData) -> list[Path]:
    """The local files in `mime` when every one of them is a document to attach, else none."""
    if not mime.hasUrls():
        return []
    paths = [Path(u.toLocalFile()) for u in mime.urls() if u.isLocalFile()]
    return paths if paths and len(paths) == len(mime.urls()) and all(attachable(p) for p in paths) else []


def pasted_path(text: str) -> Path | None:
    """Text pasted into the prompt that is one existing document's path (quoted or not, ~ expanded), else None."""
    line = text.strip().strip("'\"")
    if not line or "\n" in line or len(line) > MAX_PASTED_PATH:
        return None
    if line.startswith("file://"):
        line = line.removeprefix("file://")
    try:
        path = Path(line).expanduser()
        return path if path.is_absolute() and attachable(path) else None
    except (OSError, ValueError):  # a name the file system refuses (NUL, too long): just text
        return None


def tokens_text(n: int) -> str:
    return f"{n:,} token{'s' if n != 1 else ''}"


class AttachmentChip(QFrame):
    """One attachment: its name, then how big it is or how far its reading is, and ✕."""

    remove_clicked = Signal(Path)

    def __init__(self, path: Path, name: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("attachmentChip")
        self.path = path
        self.name = name
        self.label = QLabel(name)
        self.label.setObjectName("attachmentChipText")
        self.remove = QToolButton()
        self.remove.setObjectName("attachmentChipRemove")
        self.remove.setText("✕")
        self.remove.setAutoRaise(True)
        self.remove.setCursor(Qt.CursorShape.PointingHandCursor)
        self.remove.clicked.connect(lambda: self.remove_clicked.emit(self.path))
        row = QHBoxLayout(self)
        row.setContentsMargins(8, 2, 4, 2)
        row.setSpacing(4)
        row.addWidget(self.label)
        row.addWidget(self.remove)
        self.show_reading(0, 0)

    def show_reading(self, done: int, total: int) -> None:
        share = f" {done * 100 // total}%" if total else "…"
        # As wide as "reading 100%" from the start: the chip does not jitter as the share grows.
        self.label.setMinimumWidth(self.label.fontMetrics().horizontalAdvance(f"{self.name} · reading 100%"))
        self.label.setText(f"{self.name} · reading{share}")
        self.remove.setToolTip(f"Stop reading {self.name}")
        self.remove.setAccessibleName(f"Stop reading {self.name}")

    def show_attached(self, view: AttachmentView) -> None:
        self.name = view.shown
        self.label.setMinimumWidth(0)
        what = "conversation" if view.kind == AttachKind.CONVERSATION else "document"
        self.label.setText(f"{view.shown} · {tokens_text(view.tokens)}")
        self.setToolTip(
            f"{view.path}\nThe model may draw on this {what} ({tokens_text(view.tokens)}); "
            + ("read once just now." if view.read_tokens else "read before, so nothing was read again.")
        )
        self.remove.setToolTip(f"Remove {view.shown} from this conversation's memory")
        self.remove.setAccessibleName(f"Remove {view.shown}")

    def text(self) -> str:
        return self.label.text()


class AttachmentsBar(QWidget):
    """The chips above the prompt; hidden while nothing is attached."""

    attach_requested = Signal(Path)  # a file to attach (dialog, drop, paste)
    pictures_requested = Signal(list)  # list[Path]: picture files for the next message (dialog, drop, paste)
    remove_requested = Signal(Path)  # ✕: stop its reading, or take it out of the memory

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("attachmentsBar")
        self._row = QHBoxLayout(self)
        self._row.setContentsMargins(8, 0, 8, 0)
        self._row.setSpacing(6)
        self._row.addStretch(1)
        self.chips: dict[Path, AttachmentChip] = {}
        self.pictures: list[PictureChip] = []  # pictures waiting for the next message, in the order given
        self._pending: set[Path] = set()  # asked for, not yet in a memory report
        self.hide()

    def chip_texts(self) -> list[str]:
        return [c.text() for c in self.chips.values()]

    def request(self, paths: Sequence[Path]) -> None:
        """Attach these files: a chip each at once (reading…), then the worker's answer; pictures are asked for
        the next message instead (the window checks and decodes them, then `add_picture`)."""
        pictures = [p for p in paths if is_picture(p)]
        if pictures:
            self.pictures_requested.emit(pictures)
        for path in paths:
            if is_picture(path):
                continue
            if path in self.chips:
                continue
            self._pending.add(path)
            self._add_chip(path, path.name)
            self.attach_requested.emit(path)

    def show_pending(self, path: Path, title: str) -> None:
        """A chip for something asked for elsewhere (an earlier conversation recalled, an attachment reattached)."""
        if path not in self.chips:
            self._pending.add(path)
            self._add_chip(path, title)

    @Slot(AttachProgress)
    def on_progress(self, p: AttachProgress) -> None:
        chip = self.chips.get(p.path)
        if chip is not None and p.path in self._pending:
            chip.show_reading(p.done, p.total)

    @Slot(str, str)
    def on_failed(self, path: str, _why: str) -> None:
        """Not attached (the window shows why): its chip goes."""
        self._pending.discard(Path(path))
        self._drop_chip(Path(path))

    @Slot(MemoryReport)
    def on_memory(self, report: MemoryReport) -> None:
        """The open conversation's attachments as the worker reports them; chips still reading stay."""
        views = {v.path: v for v in report.attachments}
        self._pending -= views.keys()
        for path in [p for p in self.chips if p not in views and p not in self._pending]:
            self._drop_chip(path)
        for path, view in views.items():
            chip = self.chips.get(path) or self._add_chip(path, view.shown)
            chip.show_attached(view)

    def add_picture(self, picture: DecodedImage, name: str) -> None:
        """A picture accepted for the next message: its thumbnail chip (a picture given twice shows once)."""
        if any(c.picture.sha256 == picture.sha256 for c in self.pictures):
            return
        chip = PictureChip(picture, name)
        chip.remove_clicked.connect(self._drop_picture)
        self.pictures.append(chip)
        self._row.insertWidget(self._row.count() - 1, chip)
        self.show()

    def take_pictures(self) -> tuple[DecodedImage, ...]:
        """The waiting pictures, which go with the message being sent: their chips go."""
        taken = tuple(c.picture for c in self.pictures)
        for chip in list(self.pictures):
            self._drop_picture(chip)
        return taken

    @Slot(object)
    def _drop_picture(self, chip: PictureChip) -> None:
        if chip in self.pictures:
            self.pictures.remove(chip)
            chip.hide()
            chip.deleteLater()
        self.setVisible(bool(self.chips or self.pictures))

    def clear(self) -> None:
        """Another conversation: its own attachments arrive with its memory report."""
        self._pending.clear()
        for path in list(self.chips):
            self._drop_chip(path)

    def _add_chip(self, path: Path, name: str) -> AttachmentChip:
        chip = AttachmentChip(path, name)
        chip.remove_clicked.connect(self._on_remove)
        self.chips[path] = chip
        self._row.insertWidget(self._row.count() - 1, chip)
        self.show()
        return chip

    def _drop_chip(self, path: Path) -> None:
        chip = self.chips.pop(path, None)
        if chip is not None:
            chip.hide()
            chip.deleteLater()
        self.setVisible(bool(self.chips or self.pictures))

    @Slot(Path)
    def _on_remove(self, path: Path) -> None:
        self._pending.discard(path)
        self._drop_chip(path)  # at once: the worker's next report agrees
        self.remove_requested.emit(path)


class DocumentDrops(QObject):
    """Files dropped anywhere on the window that are documents are attached (an event filter on the window, ahead
    of its own drops: conversations and models still open there)."""

    def __init__(self, attach: Callable[[list[Path]], None], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._attach = attach

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        dragging = event.type() in (QEvent.Type.DragEnter, QEvent.Type.DragMove)
        if dragging and isinstance(event, QDragMoveEvent) and dropped_documents(event.mimeData()):
            event.acceptProposedAction()
            return True
        if event.type() == QEvent.Type.Drop and isinstance(event, QDropEvent):
            paths = dropped_documents(event.mimeData())
            if paths:
                event.acceptProposedAction()
                self._attach(paths)
                return True
        return False


def choose_documents(parent: QWidget, start: Path) -> list[Path]:
    """The paperclip's file dialog: the documents picked (none when cancelled)."""
    names, _ = QFileDialog.getOpenFileNames(parent, "Attach Documents", str(start), DOCUMENT_FILTER)
    return [Path(n) for n in names]
