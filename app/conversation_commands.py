"""Conversation commands: new chat, undo, save a copy, open, find, switch, rename, duplicate, branch, delete, export.

Every conversation is already stored in the library, so none of these asks about unsaved work; New Chat and
Delete can be undone (the stored conversation reopens with its memory).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Slot

from app.library import ConversationEntry, export_json, export_markdown, new_id
from engine.session.file import SUFFIX as SESSION_SUFFIX
from engine.session.file import atomic_write, load_session

if TYPE_CHECKING:
    from app.main_window import MainWindow


@dataclass(frozen=True)
class UndoStep:
    label: str  # "New Chat" | "Delete" | "Branch"
    reopen: str  # conversation id to open again
    entry: ConversationEntry | None = None  # a deleted conversation's row, to put back


class ConversationCommands(QObject):
    """The commands on the window's conversations, and the undo stack they share."""

    def __init__(self, window: MainWindow) -> None:
        super().__init__(window)
        self._w = window
        self._undo: list[UndoStep] = []

    @Slot()
    def new_chat(self) -> None:
        self._w.client.stop()
        if self._w.library.get(self._w.current_id):
            self._push_undo(UndoStep("New Chat", self._w.current_id))
        self.start_new()

    def start_new(self) -> None:
        self._w.current_id = new_id()
        self._w.file = None
        self._w.client.new_chat(self._w.library.path_for(self._w.current_id))
        self._w.coalescer.discard()
        self._w.chat.set_messages([])
        self._w.sidebar.set_current(self._w.current_id)
        self._w.inspector.session_panel.show_untitled(None)
        self._w.update_title()

    @Slot()
    def undo(self) -> None:
        if not self._undo:
            return
        step = self._undo.pop()
        if step.entry is not None and not self._w.library.undelete(step.entry):
            self._w.notice.show_message(
                "The deleted conversation is no longer in the trash, so it cannot come back.", error=True
            )
        elif self._w.library.get(step.reopen):
            self._w.sidebar.refresh()
            self._w.open_conversation(step.reopen)
        self._update_undo()

    def _push_undo(self, step: UndoStep) -> None:
        self._undo.append(step)
        self._update_undo()

    def _update_undo(self) -> None:
        self._w.menus.undo_action.setEnabled(bool(self._undo))
        self._w.menus.undo_action.setText(f"Undo {self._undo[-1].label}" if self._undo else "Undo")

    def save(self, full_memory: bool = False) -> None:
        start = self._w.file or self._w.dirs.documents / f"{_file_name(self._w.title())}{SESSION_SUFFIX}"
        path = self._w.dialogs.save_path(start)
        if path is not None:
            self._w.client.save(path, full_memory)

    @Slot()
    def open_session(self) -> None:
        path = self._w.dialogs.open_path(self._w.file.parent if self._w.file else self._w.dirs.documents)
        if path is not None:
            self._w.open_file(path)

    @Slot()
    def find(self) -> None:
        self._w.menus.sidebar_action.setChecked(True)
        self._w.sidebar.search.setFocus()
        self._w.sidebar.search.selectAll()

    def switch_to(self, n: int) -> None:
        ids = self._w.sidebar.ids()
        if n <= len(ids) and ids[n - 1]:
            self._w.open_conversation(ids[n - 1])

    @Slot(str)
    def rename(self, conversation_id: str) -> None:
        entry = self._w.library.get(conversation_id)
        if entry is None:
            self._w.notice.show_message(
                "This conversation has no messages yet, so there is nothing to rename.", error=False
            )
            return
        title = self._w.dialogs.ask_text("Rename Conversation", "Title:", entry.title)
        if title:
            self._w.library.rename(conversation_id, title)
            self._w.sidebar.refresh()
            self._w.update_title()

    @Slot(str)
    def duplicate(self, conversation_id: str) -> None:
        entry = self._w.library.get(conversation_id)
        if entry is None:
            return
        copy_id = new_id()
        try:
            shutil.copyfile(self._w.library.path_for(conversation_id), self._w.library.path_for(copy_id))
            messages = [(m.role, m.content) for m in load_session(self._w.library.path_for(copy_id)).messages]
        except Exception as exc:  # one sentence; the original is untouched
            self._w.library.path_for(copy_id).unlink(missing_ok=True)
            self._w.notice.show_message(f"The conversation could not be duplicated ({exc}).", error=True)
            return
        self._w.library.record(copy_id, messages, entry.model)
        self._w.library.rename(copy_id, f"{entry.title} (copy)")
        self._w.sidebar.refresh()
        self._w.open_conversation(copy_id)

    @Slot(int)
    def branch(self, index: int) -> None:
        """A new conversation holding this one up to message `index`, with the memory of that point."""
        entry = self._w.library.get(self._w.current_id)
        if entry is None or self._w.client.busy or not self._w.model_loaded:
            if self._w.client.busy:
                self._w.notice.show_message("Wait for the reply to finish, then branch.", error=False)
            return
        source = self._w.library.path_for(self._w.current_id)
        self._push_undo(UndoStep("Branch", self._w.current_id))
        self._w.current_id = new_id()
        self._w.titles_for_new[self._w.current_id] = f"{entry.title} (branch)"
        self._w.client.branch(source, self._w.library.path_for(self._w.current_id), index)
        self._w.chat.set_messages([])
        self._w.sidebar.set_current(self._w.current_id)
        self._w.update_title()

    @Slot(str)
    def delete(self, conversation_id: str) -> None:
        if self._w.client.busy and conversation_id == self._w.current_id:
            self._w.client.stop()
        entry = self._w.library.get(conversation_id)
        if entry is None:
            if conversation_id == self._w.current_id:
                self.start_new()  # an empty chat: deleting it is just clearing it
            return
        if conversation_id == self._w.current_id:
            self.start_new()
        self._w.library.delete(conversation_id)
        self._push_undo(UndoStep("Delete", conversation_id, entry))
        self._w.sidebar.refresh()
        self._w.notice.show_message(f"Deleted “{entry.title}”.", error=False, action=("Undo", self.undo))

    @Slot(str, str)
    def export(self, conversation_id: str, kind: str) -> None:
        entry = self._w.library.get(conversation_id)
        if entry is None:
            self._w.notice.show_message(
                "This conversation has no messages yet, so there is nothing to export.", error=False
            )
            return
        path = self._w.dialogs.export_path(self._w.dirs.documents / f"{_file_name(entry.title)}.{kind}", kind)
        if path is None:
            return
        try:
            messages = [(m.role, m.content) for m in load_session(self._w.library.path_for(conversation_id)).messages]
            text = (
                export_markdown(entry.title, messages)
                if kind == "md"
                else export_json(entry.title, messages, entry.model)
            )
            atomic_write(path, [text.encode("utf-8")])
        except Exception as exc:  # one sentence, nothing lost
            self._w.notice.show_message(f"The conversation could not be exported to {path.name} ({exc}).", error=True)
            return
        self._w.notice.show_message(f"Exported {path.name}.", error=False)


def _file_name(title: str) -> str:
    """A title as a file name: no path separators or characters Finder or Windows refuse."""
    name = "".join(c if c not in '/\\:*?"<>|' and c.isprintable() else " " for c in title).strip(" .…")
    return name[:80] or "Conversation"
