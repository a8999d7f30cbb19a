"""Conversation commands: new chat, undo, save a copy, open, rename, duplicate, branch, delete, export.

Every conversation is already stored in the library, so none of these asks about unsaved work; New Chat and
Delete can be undone (the stored conversation reopens: after New Chat with its memory; after Delete, whose memory,
in RAM and on disk, goes with it, by recomputing). The commands read and write the window's
`WindowState`, send requests through the client, and say what the window should show through their signals.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from app.history.export import Exported, ExportMessage, export_conversation
from app.history.library import ConversationEntry, ConversationLibrary, new_id
from app.models.dialog import REVEAL_WORDS, reveal_in_file_manager
from app.window.dialogs import Dialogs
from app.window.state import Notice, WindowState
from app.worker.client import ConversationClient
from app.worker.conversation import pictures_by_message
from engine import SESSION_SUFFIX, load_session


@dataclass(frozen=True)
class UndoStep:
    label: str  # "New Chat" | "Delete" | "Branch"
    reopen: str  # conversation id to open again
    entry: ConversationEntry | None = None  # a deleted conversation's row, to put back


class ConversationCommands(QObject):
    """The commands on the window's conversations, and the undo stack they share."""

    current_changed = Signal()  # state.current_id (or its title) changed: select it, retitle the window
    chat_cleared = Signal()  # an empty conversation is open now: clear the chat and the panels
    history_changed = Signal()  # rows were added, renamed or removed
    open_requested = Signal(str)  # open this stored conversation
    file_requested = Signal(Path)  # open this file
    notice = Signal(Notice)
    undo_changed = Signal(str)  # the label of what Undo would undo, "" when nothing

    def __init__(
        self,
        state: WindowState,
        library: ConversationLibrary,
        client: ConversationClient,
        dialogs: Dialogs,
        documents: Path,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._state = state
        self._library = library
        self._client = client
        self._dialogs = dialogs
        self._documents = documents
        self._undo: list[UndoStep] = []

    def title(self) -> str:
        entry = self._library.get(self._state.current_id)
        return entry.title if entry else "New Chat"

    @Slot()
    def new_chat(self) -> None:
        self._client.stop()
        if self._library.get(self._state.current_id):
            self._push_undo(UndoStep("New Chat", self._state.current_id))
        self.start_new()

    def start_new(self) -> None:
        self._state.current_id = new_id()
        self._state.file = None
        self._client.new_chat(self._library.path_for(self._state.current_id))
        self.chat_cleared.emit()
        self.current_changed.emit()

    @Slot()
    def undo(self) -> None:
        if not self._undo:
            return
        step = self._undo.pop()
        if step.entry is not None and not self._library.undelete(step.entry):
            self.notice.emit(
                Notice("The deleted conversation is no longer in the trash, so it cannot come back.", True)
            )
        elif self._library.get(step.reopen):
            self.history_changed.emit()
            self.open_requested.emit(step.reopen)
        self._update_undo()

    def _push_undo(self, step: UndoStep) -> None:
        self._undo.append(step)
        self._update_undo()

    def _update_undo(self) -> None:
        self.undo_changed.emit(self._undo[-1].label if self._undo else "")

    def save(self, full_memory: bool = False) -> None:
        start = self._state.file or self._documents_dir() / f"{_file_name(self.title())}{SESSION_SUFFIX}"
        path = self._dialogs.save_path(start)
        if path is not None:
            self._client.save(path, full_memory)

    @Slot()
    def open_session(self) -> None:
        path = self._dialogs.open_path(self._state.file.parent if self._state.file else self._documents_dir())
        if path is not None:
            self.file_requested.emit(path)

    def _documents_dir(self) -> Path:
        """Where file dialogs start: Documents, or the home folder where there is none (never the working folder)."""
        return self._documents if self._documents.is_dir() else Path.home()

    def rename(self, conversation_id: str, title: str) -> None:
        """Give a stored conversation a title the user typed (inline in the sidebar)."""
        title = " ".join(title.split())
        if not title or self._library.get(conversation_id) is None:
            return
        self._library.rename(conversation_id, title)
        self.history_changed.emit()
        self.current_changed.emit()

    @Slot(str)
    def duplicate(self, conversation_id: str) -> None:
        entry = self._library.get(conversation_id)
        if entry is None:
            return
        copy_id = new_id()
        try:
            shutil.copyfile(self._library.path_for(conversation_id), self._library.path_for(copy_id))
            messages = [(m.role, m.content) for m in load_session(self._library.path_for(copy_id)).messages]
        except Exception as exc:  # one sentence; the original is untouched
            self._library.path_for(copy_id).unlink(missing_ok=True)
            self.notice.emit(Notice(f"The conversation could not be duplicated ({exc}).", True))
            return
        self._library.set_sampling(copy_id, entry.sampling)  # a copy samples as the original does
        self._library.record(copy_id, messages, entry.model)
        self._library.rename(copy_id, f"{entry.title} (copy)")
        self.history_changed.emit()
        self.open_requested.emit(copy_id)

    @Slot(int)
    def branch(self, index: int) -> None:
        """A new conversation holding this one up to message `index`, with the memory of that point."""
        entry = self._library.get(self._state.current_id)
        if self._client.busy:
            self.notice.emit(Notice("Wait for the reply to finish, then branch."))
            return
        if entry is None or not self._state.model_loaded:
            return
        source = self._library.path_for(self._state.current_id)
        self._push_undo(UndoStep("Branch", self._state.current_id))
        self._state.current_id = new_id()
        self._state.titles_for_new[self._state.current_id] = f"{entry.title} (branch)"
        self._library.set_sampling(self._state.current_id, entry.sampling)
        self._client.branch(source, self._library.path_for(self._state.current_id), index)
        self.chat_cleared.emit()
        self.current_changed.emit()

    @Slot(str)
    def delete(self, conversation_id: str) -> None:
        current = conversation_id == self._state.current_id
        if self._client.busy and current:
            self._client.stop()
        entry = self._library.get(conversation_id)
        if current:
            self.start_new()  # an empty chat: deleting it is just clearing it
        if entry is None:
            return
        self._library.delete(conversation_id)
        self._client.forget(self._library.path_for(conversation_id))  # its kept memory goes with it
        self._push_undo(UndoStep("Delete", conversation_id, entry))
        self.history_changed.emit()
        self.notice.emit(Notice(f"Deleted “{entry.title}”.", False, ("Undo", self.undo)))

    @Slot(str, str)
    def export(self, conversation_id: str, kind: str) -> None:
        """Export as Markdown ("md") or JSON ("json"), the pictures with it (app.history.export)."""
        entry = self._library.get(conversation_id)
        if entry is None:
            self.notice.emit(Notice("This conversation has no messages yet, so there is nothing to export."))
            return
        try:
            data = load_session(self._library.path_for(conversation_id))
        except Exception as exc:  # one sentence, nothing lost
            self.notice.emit(Notice(f"The conversation could not be read for export ({exc}).", True))
            return
        pairs = [(m.role, m.content) for m in data.messages]
        messages = [
            ExportMessage(r, c, ps) for (r, c), ps in zip(pairs, pictures_by_message(pairs, data.images), strict=True)
        ]
        start = self._documents_dir() / f"{_file_name(entry.title)}.{kind}"
        chosen = self._dialogs.export_path(start, kind, bool(data.images))
        if chosen is None:
            return
        path, form = chosen
        try:
            done = export_conversation(path, form, entry.title, entry.model, messages)
        except Exception as exc:  # one sentence, nothing lost
            self.notice.emit(Notice(f"The conversation could not be exported to {path.name} ({exc}).", True))
            return
        self.notice.emit(Notice(_exported_words(done), False, (REVEAL_WORDS, lambda: reveal_in_file_manager(path))))


def _exported_words(done: Exported) -> str:
    if done.folder is None:
        return f"Exported {done.path.name}."
    n = len(done.pictures)
    return f"Exported {done.path.name}, its {n} picture{'s' if n != 1 else ''} in “{done.folder.name}”."


def _file_name(title: str) -> str:
    """A title as a file name: no path separators or characters Finder or Windows refuse."""
    name = "".join(c if c not in '/\\:*?"<>|' and c.isprintable() else " " for c in title).strip(" .…")
    return name[:80] or "Conversation"
