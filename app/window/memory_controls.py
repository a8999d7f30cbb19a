"""Documents and earlier conversations as the open conversation's memory, wired between the window's widgets and its
worker's client: the composer's chips (paperclip, drops, pastes), "Recall in Current Conversation" from the
sidebar and Chat ▸ Recall from…, citations under replies and the passage they open, refusals on the notice bar.

What each conversation has attached is also kept in a small record of its own (`attachments.json` in the data
folder: conversation id -> the files, as the user chose them): a conversation reopened without its memory in RAM
(after a relaunch, or dropped from RAM) attaches them again, which reads nothing when their capsules are still in
the cache folder. The record is read as hostile input: bounded, checked, an entry that does not hold dropped."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Slot
from PySide6.QtWidgets import QInputDialog, QMenu, QWidget

from app.history.library import ConversationLibrary
from app.history.sidebar import HistorySidebar
from app.window.attachments import AttachmentsBar, DocumentDrops, attachable, choose_documents
from app.window.chat_view import ChatView
from app.window.composer import Composer
from app.window.passage import show_passage
from app.worker.client import ConversationClient
from app.worker.types import AttachKind, CitationView, MemoryReport, SessionFileEvent, TurnResult
from engine import SparkError, atomic_write

log = logging.getLogger(__name__)

RECORD_NAME = "attachments.json"
RECORD_MAX_BYTES = 1024**2
RECORD_MAX_CONVERSATIONS = 10_000
RECORD_MAX_PER_CONVERSATION = 32  # as many as a conversation may hold (engine.documents.attach)
MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class Attachment:
    """One line of the record: a file attached to a conversation, and what it is."""

    path: Path
    kind: AttachKind
    title: str = ""


class AttachmentRecord:
    """conversation id -> what it has attached, kept in one small JSON file (written atomically on each change)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._by_id: dict[str, list[Attachment]] = read_record(path)

    def get(self, conversation_id: str) -> list[Attachment]:
        return list(self._by_id.get(conversation_id, []))

    def set(self, conversation_id: str, items: list[Attachment]) -> None:
        if self._by_id.get(conversation_id, []) == items:
            return
        if items:
            self._by_id[conversation_id] = list(items)
        else:
            self._by_id.pop(conversation_id, None)
        rows = {
            cid: [{"path": str(a.path), "kind": a.kind.value, "title": a.title} for a in got]
            for cid, got in self._by_id.items()
        }
        try:
            atomic_write(self.path, [json.dumps(rows, ensure_ascii=False).encode()])
        except (OSError, SparkError):  # a convenience only: the conversation itself is stored elsewhere
            log.exception("the attachments record could not be written")


def read_record(path: Path) -> dict[str, list[Attachment]]:
    """The record at `path`, every entry checked; a missing, oversized or damaged file is an empty record."""
    try:
        with path.open("rb") as f:
            raw = f.read(RECORD_MAX_BYTES + 1)
    except OSError:
        return {}
    if len(raw) > RECORD_MAX_BYTES:
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    out: dict[str, list[Attachment]] = {}
    for cid, rows in list(data.items())[:RECORD_MAX_CONVERSATIONS]:
        if not isinstance(rows, list):
            continue
        items = [a for a in (_attachment(r) for r in rows[:RECORD_MAX_PER_CONVERSATION]) if a is not None]
        if items and len(cid) <= 64:
            out[cid] = items
    return out


def _attachment(row: object) -> Attachment | None:
    if not isinstance(row, dict):
        return None
    path, kind, title = row.get("path"), row.get("kind"), row.get("title", "")
    if not (isinstance(path, str) and isinstance(kind, str) and isinstance(title, str)):
        return None
    if not path or len(path) > MAX_PATH_CHARS or "\x00" in path or len(title) > 500:
        return None
    try:
        return Attachment(Path(path), AttachKind(kind), title) if Path(path).is_absolute() else None
    except ValueError:
        return None


class MemoryControls(QObject):
    """The wiring of documents and recalled conversations between the window's widgets and its client."""

    def __init__(
        self,
        window: QWidget,
        client: ConversationClient,
        composer: Composer,
        chat: ChatView,
        sidebar: HistorySidebar,
        library: ConversationLibrary,
        current_id: Callable[[], str],
        notify: Callable[[str], None],
        record: AttachmentRecord,
        documents_dir: Path,
        chat_menu: QMenu | None = None,
    ) -> None:
        super().__init__(window)
        self.window = window
        self.client = client
        self.bar: AttachmentsBar = composer.attachments
        self.chat = chat
        self.library = library
        self.current_id = current_id
        self.notify = notify
        self.record = record
        self.documents_dir = documents_dir
        self.passage: QWidget | None = None  # the passage window opened last
        self._attached: dict[Path, Attachment] = {}  # the open conversation's, as the worker last reported them
        self._asked: dict[Path, Attachment] = {}  # asked for, not yet reported
        self.drops = DocumentDrops(self.bar.request, self)
        window.installEventFilter(self.drops)
        composer.attach_button.clicked.connect(self.browse)
        self.bar.attach_requested.connect(self._on_attach_requested)
        self.bar.remove_requested.connect(self._on_remove)
        client.attaching.connect(self.bar.on_progress)
        client.attach_failed.connect(self._on_failed)
        client.memory.connect(self._on_memory)
        client.finished.connect(self._on_finished)  # after the window's own: the reply is closed first
        client.restored.connect(self._on_restored)
        chat.citation_opened.connect(self.open_passage)
        sidebar.recall_requested.connect(self.recall)
        if chat_menu is not None:
            chat_menu.addSeparator()
            self.recall_action = chat_menu.addAction("Recall from…", self.choose_recall)
            self.recall_action.setToolTip("Let this conversation draw on what was said in an earlier one")

    # -- asking --------------------------------------------------------------------------------------------------------
    @Slot()
    def browse(self) -> None:
        self.bar.request(choose_documents(self.window, self.documents_dir))

    @Slot(str)
    def recall(self, conversation_id: str) -> None:
        """The conversation `conversation_id` joins the open one's memory."""
        entry = self.library.get(conversation_id)
        if entry is None or conversation_id == self.current_id():
            return
        path = self.library.path_for(conversation_id)
        self._ask(Attachment(path, AttachKind.CONVERSATION, entry.title))
        self.bar.show_pending(path, entry.title)

    @Slot()
    def choose_recall(self) -> None:
        """Chat ▸ Recall from…: pick one of the other conversations."""
        entries = [e for e in self.library.entries() if e.id != self.current_id()]
        if not entries:
            self.notify("There is no earlier conversation to recall yet.")
            return
        titles = [e.title for e in entries]
        title, ok = QInputDialog.getItem(
            self.window, "Recall from…", "Let this conversation draw on:", titles, 0, False
        )
        if ok and title in titles:
            self.recall(entries[titles.index(title)].id)

    @Slot(object)
    def open_passage(self, citation: CitationView) -> None:
        self.passage = show_passage(self.window, citation)

    def _ask(self, item: Attachment) -> None:
        self._asked[item.path] = item
        self.client.attach_file(item.path, item.kind, item.title)

    @Slot(object)
    def _on_attach_requested(self, path: Path) -> None:
        self._ask(Attachment(path, AttachKind.DOCUMENT))

    @Slot(object)
    def _on_remove(self, path: Path) -> None:
        self._asked.pop(path, None)
        self._attached.pop(path, None)
        self.client.detach(path)
        self.record.set(self.current_id(), list(self._attached.values()))

    # -- answers -------------------------------------------------------------------------------------------------------
    @Slot(str, str)
    def _on_failed(self, path: str, why: str) -> None:
        self._asked.pop(Path(path), None)
        self.bar.on_failed(path, why)
        if why:
            self.notify(why)

    @Slot(MemoryReport)
    def _on_memory(self, report: MemoryReport) -> None:
        self.bar.on_memory(report)
        if report.remote:
            return
        now = {}
        for v in report.attachments:
            now[v.path] = self._attached.get(v.path) or self._asked.pop(v.path, None) or Attachment(v.path, v.kind)
        changed = now.keys() != self._attached.keys()
        self._attached = now
        if changed and now:  # an empty report is also a conversation just opened: its record is not erased
            self.record.set(self.current_id(), list(now.values()))

    @Slot(TurnResult)
    def _on_finished(self, result: TurnResult) -> None:
        self.chat.add_citations(result.recalled)

    @Slot(SessionFileEvent)
    def _on_restored(self, _event: SessionFileEvent) -> None:
        QTimer.singleShot(0, self._reattach)  # after the window has made the opened conversation current

    def _reattach(self) -> None:
        """A conversation reopened without its attachments in memory attaches them again (capsules on disk: nothing
        is read); one whose file is gone is dropped from the record, saying so."""
        cid = self.current_id()
        wanted = self.record.get(cid)
        kept = []
        for item in wanted:
            if item.path in self._attached or item.path in self._asked:
                kept.append(item)
            elif attachable(item.path) or (item.kind == AttachKind.CONVERSATION and item.path.is_file()):
                kept.append(item)
                self._ask(item)
                self.bar.show_pending(item.path, item.title or item.path.name)
            else:
                self.notify(f"{item.title or item.path.name} is no longer attached: its file is gone.")
        if kept != wanted:
            self.record.set(cid, kept)
