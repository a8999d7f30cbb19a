"""The conversation side of the window: what the user sends and what comes back, and the open conversation —
opening, storing, saving, files and drops, its title and notes.

It hears the client's conversation signals and the commands' signals, writes the shared `WindowState`, and drives
the widgets through `WindowViews`; the window connects the widgets' requests to its slots. The settings a reply is
sent with come from the `SettingsPresenter` (`reply_settings`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from app.history.library import ConversationLibrary, file_origin, new_id
from app.misc.coalescer import TextCoalescer
from app.misc.words import counted
from app.models import FIRST_LAUNCH_HINT
from app.settings.preferences import Preferences
from app.tools.consent import ConsentRequest
from app.window.dialogs import Dialogs
from app.window.menus import shortcut_text
from app.window.state import Notice, WindowState
from app.window.views import WindowViews
from app.worker.client import ConversationClient
from app.worker.types import MessageView, ReadProgress, SessionFileEvent, StoredConversation, TurnResult
from engine import SESSION_SUFFIX, FinishReason, GenerationSettings
from engine.openai.client import CANNOT_SEE_IMAGES

FINISH_NOTES: dict[FinishReason | str, str] = {
    FinishReason.CANCELLED: "Stopped.",
    FinishReason.LENGTH: "Reached the reply length limit; Settings can raise it.",
    "error": "",
}


def is_model_path(path: Path) -> bool:
    return (path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.gguf")))) or (
        path.is_file() and path.suffix.lower() == ".gguf"
    )


class ConversationPresenter(QObject):
    title_changed = Signal(str, str)  # the open conversation's title; the file outside the library it is ("" none)
    current_shown = Signal()  # another conversation is open now (its settings follow)
    model_requested = Signal(Path)  # a model was opened (dropped, from the command line): load it

    def __init__(
        self,
        client: ConversationClient,
        state: WindowState,
        library: ConversationLibrary,
        prefs: Preferences,
        dialogs: Dialogs,
        views: WindowViews,
        reply_settings: Callable[[], GenerationSettings],
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._client = client
        self._state = state
        self._library = library
        self._prefs = prefs
        self._dialogs = dialogs
        self._views = views
        self._reply_settings = reply_settings  # what the next reply is sent with
        self.coalescer = TextCoalescer(parent=self)  # deltas shown at most once per frame
        self._startup_id = prefs.last_conversation() if library.get(prefs.last_conversation()) else ""
        self._shut_down = False
        c, chat = client, views.chat
        c.delta.connect(self.coalescer.push)
        c.reasoning.connect(chat.append_reasoning)
        c.busy_changed.connect(self.show_busy)
        c.stopping.connect(self._on_stopping)
        c.finished.connect(self._on_finished)
        c.error.connect(self._on_error)
        c.conversation_shown.connect(self._on_conversation)
        c.saved.connect(self._on_saved)
        c.restored.connect(self._on_restored)
        c.foreign_session.connect(self._on_foreign_session)
        c.reading.connect(self._on_reading)
        c.stored.connect(self._on_stored)
        c.consent_needed.connect(self._on_consent_needed)
        self.coalescer.flushed.connect(chat.append_reply)

    def show_current(self) -> None:
        """Everything the views show of the open conversation, as at startup."""
        self._views.sidebar.set_current(self._state.current_id)
        self.update_title()
        self.show_busy(False)
        if self._library.load_error:
            self._views.notice.show_message(self._library.load_error, error=True)

    def shut_down(self) -> None:
        """Quit cut any reply off (the worker stores it with a note saying so): nothing more is shown."""
        self._shut_down = True

    # -- the user's requests ----------------------------------------------------------------------------------------
    @Slot(str)
    def submit(self, text: str) -> bool:
        """Send `text` as the next user message; False (with a message saying why) when it cannot be sent now."""
        notice = self._views.notice
        if not self._state.model_loaded:
            notice.show_message(
                "The model is still loading; your message is kept, send it when it is ready.", error=False
            )
            return False
        if self._state.opening is not None:
            notice.show_message(
                "Spark is still opening this conversation (recomputing its memory); your message is kept, send it in a moment.",
                error=False,
            )
            return False
        if self._client.busy:
            notice.show_message(
                f"Spark is still writing; your message is kept. Stop the reply ({shortcut_text(self._views.menus.stop_action)}) to send it now.",
                error=False,
                action=("Stop", self.stop_reply),
            )
            return False
        remote = self._state.remote
        waiting = self._views.composer.attachments.pictures
        if remote is not None and not remote.sees_images and (waiting or self._views.chat.picture_keys()):
            notice.show_message(CANNOT_SEE_IMAGES, error=True)  # refused here, so the message stays in the box
            return False
        notice.hide()
        self._views.composer.prompt.clear()
        pictures = self._views.composer.attachments.take_pictures()  # they go with this message
        chat = self._views.chat
        chat.add_user_message(text, [p.data for p in pictures])
        chat.begin_reply()
        chat.show_reading("Reading…")
        self._client.send(text, self._reply_settings(), pictures)
        return True

    @Slot()
    def send_or_stop(self) -> None:
        """Send's button: Stop while a reply is written, else send the prompt's text."""
        if self._client.busy:
            self.stop_reply()
            return
        text = self._views.composer.prompt.toPlainText().strip()
        if text or self._views.composer.attachments.pictures:
            self.submit(text)

    @Slot()
    def stop_reply(self) -> None:
        self._client.stop()

    @Slot()
    def regenerate(self) -> None:
        if not self._state.model_loaded or self._client.busy:
            return
        self._views.chat.remove_last_reply()
        self._views.chat.begin_reply()
        self._client.regenerate(self._reply_settings())

    @Slot(str)
    def open_conversation(self, conversation_id: str) -> None:
        """Switch to a stored conversation: its transcript and memory come back (recomputed where compact)."""
        if (
            not self._library.get(conversation_id)
            or conversation_id in (self._state.current_id, self._state.opening)
            or not self._state.model_loaded
        ):
            return
        self._client.stop()
        self._state.opening = conversation_id
        self._views.sidebar.set_current(conversation_id)  # selected at once; its words follow, then its memory
        path = self._library.path_for(conversation_id)
        self._client.restore(path, store_path=path)

    @Slot(Path)
    def open_file(self, path: Path) -> None:
        """A .spark file or a model from the command line, Finder/Dock, a drop or Open. The current conversation is
        already stored, so nothing is asked: an opened file becomes a new conversation in the history."""
        if is_model_path(path):
            self.model_requested.emit(path)
            return
        notice = self._views.notice
        if path.suffix != SESSION_SUFFIX:
            notice.show_message(
                f"MLoT Spark opens {SESSION_SUFFIX} conversations, model folders and .gguf models; {path.name} is none of these, so nothing changed.",
                error=True,
            )
            return
        if not path.is_file():
            notice.show_message(f"The file {path.name} no longer exists; nothing changed.", error=True)
            return
        if not self._state.model_loaded or self._state.opening is not None:
            self._state.pending_files.append(
                path
            )  # opened once the model is ready (or the conversation opening now is)
            return
        known = self._in_history(path)
        if known is not None:  # already in the history: selected there, not copied into it again
            self.open_conversation(known)
            return
        self._client.stop()
        self._state.opening = new_id()
        self._library.set_origin(self._state.opening, file_origin(path))
        self._client.restore(path, store_path=self._library.path_for(self._state.opening))

    def _in_history(self, path: Path) -> str | None:
        """The history's conversation this file is: one of its own stored files, or a file opened before and
        unchanged since."""
        try:
            if path.resolve().parent == self._library.folder.resolve() and self._library.get(path.stem):
                return path.stem
            return self._library.find_origin(file_origin(path))
        except OSError:
            return None

    def handle_drop(self, paths: list[Path], count: int) -> None:
        """`paths`: the local files among `count` dropped (or chosen) items."""
        if len(paths) != 1 or count != 1:
            self._views.notice.show_message(
                "Drop one .spark conversation, one model folder or one .gguf file at a time; nothing changed.",
                error=True,
            )
            return
        path = paths[0]
        if path.is_dir() and not is_model_path(path):
            self._views.notice.show_message(
                f"{path.name} is not a model folder (it has no config.json or .gguf); nothing changed.", error=True
            )
            return
        self.open_file(path)

    # -- what the views show of it ----------------------------------------------------------------------------------
    def title(self) -> str:
        entry = self._library.get(self._state.current_id)
        return entry.title if entry else "New Chat"

    @Slot()
    def update_title(self) -> None:
        self.title_changed.emit(self.title(), str(self._state.file) if self._state.file else "")

    @Slot(bool)
    def show_busy(self, busy: bool) -> None:
        menus = self._views.menus
        menus.stop_action.setEnabled(busy)
        # Regenerate needs a prompt to answer again: not in an empty chat.
        menus.regenerate_action.setEnabled(self._state.model_loaded and not busy and not self._views.chat.is_empty())
        send = self._views.composer.send_button
        send.setText("Stop" if busy else "Send")
        send.setEnabled(self._state.model_loaded)
        if not busy:
            self._views.status.show_speed("")

    # -- the model presenter's signals ------------------------------------------------------------------------------
    @Slot()
    def on_model_shown(self) -> None:
        self.show_busy(self._client.busy)

    @Slot()
    def on_first_ready(self) -> None:
        """The first model (local or remote) is ready: the chat gets its file, and the app reopens where it was."""
        self._client.new_chat(self._library.path_for(self._state.current_id))
        if not self._prefs.models_offer_shown():  # first launch: one line offering the model library
            self._prefs.set_models_offer_shown()
            get_models = ("Get Models…", self._views.menus.get_models_action.trigger)
            self._views.notice.show_message(FIRST_LAUNCH_HINT, error=False, action=get_models, stay=True)
        if (
            self._startup_id and not self._state.pending_files
        ):  # reopen where the user left off, unless a file was asked for
            self.open_conversation(self._startup_id)
        if self._state.pending_files:  # one at a time: each next one opens when the previous is restored
            self.open_file(self._state.pending_files.pop(0))

    # -- the client's signals ---------------------------------------------------------------------------------------
    @Slot()
    def _on_stopping(self) -> None:
        send = self._views.composer.send_button
        send.setText("Stopping…")
        send.setEnabled(False)
        self._views.chat.show_reading("Stopping…")

    @Slot(ReadProgress)
    def _on_reading(self, p: ReadProgress) -> None:
        rate = f" · {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else ""
        left = f" · about {p.seconds_left:,.0f} s left" if p.seconds_left >= 1 else ""
        if p.kind == "prompt":
            self._views.chat.show_reading(f"Reading {p.done:,} of {p.total:,} tokens{rate}{left}")
        elif p.done < p.total:
            self._views.notice.show_message(
                f"Recomputing this conversation's memory: {p.done:,} of {p.total:,} tokens{rate}{left}", error=False
            )

    @Slot(TurnResult)
    def _on_finished(self, result: TurnResult) -> None:
        if self._shut_down:  # Quit cut the reply off: the worker stored it with a note saying so
            return
        self.coalescer.flush()  # text queued before `finished` is shown before the reply is closed
        notes = [FINISH_NOTES.get(result.reason, "")]
        if result.reason == FinishReason.CANCELLED and not result.progress.generated_tokens:
            notes = [
                "Stopped while reading; nothing was written. What was read stays in memory; the rest is read with your next message."
            ]
        if result.recalled_turns_ago:
            n = result.recalled_turns_ago
            notes.append(f"↺ Recalled from {counted(n, 'turn')} ago.")
        note = " ".join(n for n in notes if n)
        chat = self._views.chat
        chat.end_reply(note, result.messages - 1 if result.messages else None)
        if note:  # kept with the conversation, so reopening it (Undo, relaunch) shows it again
            self._library.set_note(self._state.current_id, chat.last_index(), note)

    @Slot(object)
    def _on_consent_needed(self, request: ConsentRequest) -> None:
        """A tool call waits for the user: asked in a dialog (the worker waits; this thread keeps running)."""
        request.answer(self._dialogs.ask_tool_consent(request.call))

    @Slot(str)
    def _on_error(self, message: str) -> None:
        self._views.notice.show_message(message, error=True)
        if self._state.opening is not None:
            self._state.opening = None
            self._views.sidebar.set_current(self._state.current_id)  # the conversation that stays open
        if self._state.pending_files and self._state.model_loaded:
            QTimer.singleShot(0, self._open_next_pending)

    def _open_next_pending(self) -> None:
        self.open_file(self._state.pending_files.pop(0))

    @Slot(list)
    def _on_conversation(self, messages: list[MessageView]) -> None:
        self.coalescer.discard()
        entry = self._library.get(self._state.opening or self._state.current_id)
        self._views.chat.set_messages(messages, dict(entry.notes) if entry else None)
        self._views.inspector.show_transcript(sum(1 for m in messages if m.role == "assistant"))
        self.show_busy(self._client.busy)

    @Slot(StoredConversation)
    def _on_stored(self, stored: StoredConversation) -> None:
        cid = stored.path.stem
        if cid != self._state.current_id and self._library.get(cid) is None:
            return  # deleted (or left) before this store arrived
        self._library.record(cid, list(stored.messages), stored.model, stored.cut_off)
        title = self._state.titles_for_new.pop(cid, None)
        if title:
            self._library.rename(cid, title)
        self._views.sidebar.refresh()
        self._views.inspector.show_stored(f"Stored automatically ({counted(len(stored.messages), 'message')}).")
        self.update_title()

    @Slot(SessionFileEvent)
    def _on_saved(self, event: SessionFileEvent) -> None:
        self._state.file = event.path
        self._views.inspector.session_panel.on_file_event(event)
        self._views.notice.show_message(f"Saved a copy as {event.path.name}.", error=False)

    @Slot(SessionFileEvent)
    def _on_restored(self, event: SessionFileEvent) -> None:
        if self._state.opening:
            self._state.current_id = self._state.opening
            self._state.opening = None
        if self._state.pending_files:
            QTimer.singleShot(0, self._open_next_pending)
        in_library = event.path.parent == self._library.folder
        self._state.file = None if in_library else event.path
        self._views.inspector.session_panel.on_file_event(event)
        notice = self._views.notice
        if not in_library or event.note:
            notice.show_message(
                f"Opened {event.path.name}" + (f" ({event.note})." if event.note else "."),
                error=bool(event.note) and "differs" in event.note,
            )
        elif notice.text().startswith("Recomputing"):
            notice.hide()
        self.on_current_changed()

    @Slot(str, str)
    def _on_foreign_session(self, path: str, reason: str) -> None:
        if self._dialogs.confirm("Different Model", f"{reason}\n\nRestore the transcript only?", "Restore Transcript"):
            store = self._library.path_for(self._state.opening or new_id())
            self._client.restore(Path(path), transcript_only=True, store_path=store)
        else:
            self._state.opening = None

    # -- the commands' signals --------------------------------------------------------------------------------------
    @Slot()
    def on_current_changed(self) -> None:
        self._views.sidebar.set_current(self._state.current_id)
        self.update_title()
        self.current_shown.emit()

    @Slot()
    def clear_chat(self) -> None:
        """An empty conversation: the chat shows its greeting, and the panels forget the previous one."""
        self.coalescer.discard()
        self._views.chat.set_messages([])
        self._views.inspector.reset_conversation()
        self._views.status.show_speed("")
        self.show_busy(self._client.busy)

    @Slot(Notice)
    def show_notice(self, notice: Notice) -> None:
        self._views.notice.show_message(notice.text, error=notice.error, action=notice.action)

    @Slot(str)
    def show_undo(self, label: str) -> None:
        undo = self._views.menus.undo_action
        undo.setEnabled(bool(label))
        undo.setText(f"Undo {label}" if label else "Undo")
