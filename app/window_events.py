"""The main window's side of its worker: each worker signal updates the chat, the status bar, the history and the
inspector."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, QTimer, Slot

from app.library import new_id
from app.models import FIRST_LAUNCH_HINT
from app.worker_types import (
    LoadedModel,
    MessageView,
    ReadProgress,
    SessionFileEvent,
    StoredConversation,
    TurnProgress,
    TurnResult,
    remote_name,
)
from engine.errors import SparkError
from engine.generation.loop import FinishReason
from engine.loading.model_files import default_model_path
from engine.openai.client import RemoteServer

if TYPE_CHECKING:
    from app.main_window import MainWindow

FINISH_NOTES: dict[FinishReason | str, str] = {
    FinishReason.CANCELLED: "Stopped.",
    FinishReason.LENGTH: "Reached the reply length limit; Settings can raise it.",
    "error": "",
}


class WorkerEvents(QObject):
    """Connects the chat worker's signals to the window; its slots are its own."""

    def __init__(self, window: MainWindow) -> None:
        super().__init__(window)
        self._w = window
        w = window.client.worker
        w.loading.connect(self._on_loading)
        w.loaded.connect(self._on_loaded)
        w.load_cancelled.connect(self._on_load_cancelled)
        w.progress.connect(self._on_progress)
        w.finished.connect(self._on_finished)
        w.error.connect(self._on_error)
        w.conversation.connect(self._on_conversation)
        w.saved.connect(self._on_saved)
        w.restored.connect(self._on_restored)
        w.foreign_session.connect(self._on_foreign_session)
        w.system_prompt.connect(self._on_restored_system_prompt)
        w.reading.connect(self._on_reading)
        w.stored.connect(self._on_stored)
        w.remote_ready.connect(self._on_remote_ready)

    @Slot(str)
    def _on_loading(self, model_dir: str) -> None:
        self._w.model_label.setText(f"Loading {Path(model_dir).name if model_dir else 'the default model'}…")
        self._w.load_progress.show()
        self._w.load_cancel.show()

    @Slot(LoadedModel)
    def _on_loaded(self, loaded: LoadedModel) -> None:
        info = loaded.info
        first = not self._w.model_loaded
        self._w.model_loaded = True
        self._w.remote = None
        self._end_loading()
        resume = self._last_remote() if first else None
        self._w.model_path = None if _is_default(info.path) else info.path
        runs = info.backend_detail.partition(" (skipped ")[0]
        self._w.model_label.setText(f"{info.name} · {runs}")
        self._w.model_label.setToolTip(f"{info.path}\n{info.backend_detail}")
        self._w.menus.model_button.setText(f"Model: {info.name}")
        self._w.prefs.set_last_model(self._w.model_path)
        self._w.quick_client.attach(loaded.engine)
        self._w.client.set_system_prompt(self._w.system_prompt.text().strip())
        self._w.inspector._on_model(info)
        self._w.monitor._on_model(info)
        self._w.show_busy(self._w.client.busy)
        if resume is not None:  # the app was left chatting with a server: back to it (queued before the reopening)
            self._w.use_remote(resume)
        else:
            self._w.prefs.set_last_remote(None)
        if first:
            self._first_ready()

    def _last_remote(self) -> RemoteServer | None:
        last = self._w.prefs.last_remote()
        return next((s for s in self._w.remote_servers.all() if (s.url, s.model) == last), None)

    def _first_ready(self) -> None:
        """The first model (local or remote) is ready: the chat gets its file, and the app reopens where it was."""
        self._w.client.new_chat(self._w.library.path_for(self._w.current_id))
        if not self._w.prefs.models_offer_shown():  # first launch: one line offering the model library
            self._w.prefs.set_models_offer_shown()
            get_models = ("Get Models…", self._w.menus.get_models_action.trigger)
            self._w.notice.show_message(FIRST_LAUNCH_HINT, error=False, action=get_models, stay=True)
        if (
            self._w.startup_id and not self._w.pending_files
        ):  # reopen where the user left off, unless a file was asked for
            self._w.open_conversation(self._w.startup_id)
        if self._w.pending_files:  # one at a time: each next one opens when the previous is restored
            self._w.open_file(self._w.pending_files.pop(0))

    @Slot(object)
    def _on_remote_ready(self, server: RemoteServer) -> None:
        first = not self._w.model_loaded
        self._w.model_loaded = True
        self._w.remote = server
        self._w.prefs.set_last_remote(server.url, server.model)
        self._w.model_label.setText(f"{remote_name(server)} · remote server")
        self._w.model_label.setToolTip(server.url)
        self._w.menus.model_button.setText(f"Model: {server.model}")
        self._w.inspector.show_remote(server)
        self._w.show_busy(self._w.client.busy)
        if first:
            self._first_ready()

    @Slot()
    def _on_load_cancelled(self) -> None:
        self._w.opening = None
        self._end_loading()
        self._w.model_label.setText("Model loading cancelled")

    def _end_loading(self) -> None:
        self._w.load_progress.hide()
        self._w.load_cancel.hide()

    @Slot(ReadProgress)
    def _on_reading(self, p: ReadProgress) -> None:
        rate = f" · {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else ""
        left = f" · about {p.seconds_left:,.0f} s left" if p.seconds_left >= 1 else ""
        if p.kind == "prompt":
            self._w.chat.show_reading(f"Reading {p.done:,} of {p.total:,} tokens{rate}{left}")
        elif p.done < p.total:
            self._w.notice.show_message(
                f"Recomputing this conversation's memory: {p.done:,} of {p.total:,} tokens{rate}{left}", error=False
            )

    @Slot(TurnProgress)
    def _on_progress(self, p: TurnProgress) -> None:
        if p.generated_tokens > 1:
            self._w.speed_label.setText(f"{p.tokens_per_s:.1f} tokens/s")

    @Slot(TurnResult)
    def _on_finished(self, result: TurnResult) -> None:
        self._w.coalescer.flush()  # text queued before `finished` is shown before the reply is closed
        notes = [FINISH_NOTES.get(result.reason, "")]
        if result.reason == FinishReason.CANCELLED and not result.progress.generated_tokens:
            notes = ["Stopped while reading; nothing was written."]
        if result.recalled_turns_ago:
            n = result.recalled_turns_ago
            notes.append(f"↺ Recalled from {n} turn{'s' if n != 1 else ''} ago.")
        note = " ".join(n for n in notes if n)
        self._w.chat.end_reply(note)
        if note:  # kept with the conversation, so reopening it (Undo, relaunch) shows it again
            self._w.library.set_note(self._w.current_id, self._w.chat.last_index(), note)

    @Slot(str)
    def _on_error(self, message: str) -> None:
        self._w.notice.show_message(message, error=True)
        if self._w.opening is not None:
            self._w.opening = None
            self._w.sidebar.set_current(self._w.current_id)  # the conversation that stays open
        if self._w.pending_files and self._w.model_loaded:
            QTimer.singleShot(0, lambda: self._w.open_file(self._w.pending_files.pop(0)))
        if not self._w.model_loaded:
            self._end_loading()
            self._w.model_label.setText("No model loaded")

    @Slot(list)
    def _on_conversation(self, messages: list[MessageView]) -> None:
        self._w.coalescer.discard()
        entry = self._w.library.get(self._w.opening or self._w.current_id)
        self._w.chat.set_messages(messages, dict(entry.notes) if entry else None)

    @Slot(StoredConversation)
    def _on_stored(self, stored: StoredConversation) -> None:
        cid = stored.path.stem
        if cid != self._w.current_id and self._w.library.get(cid) is None:
            return  # deleted (or left) before this store arrived
        self._w.library.record(cid, list(stored.messages), stored.model)
        title = self._w.titles_for_new.pop(cid, None)
        if title:
            self._w.library.rename(cid, title)
        self._w.sidebar.refresh()
        self._w.inspector.show_stored(f"Stored automatically ({len(stored.messages)} messages).")
        self._w.update_title()

    @Slot(SessionFileEvent)
    def _on_saved(self, event: SessionFileEvent) -> None:
        self._w.file = event.path
        self._w.inspector.session_panel._on_file_event(event)
        self._w.notice.show_message(f"Saved a copy as {event.path.name}.", error=False)

    @Slot(SessionFileEvent)
    def _on_restored(self, event: SessionFileEvent) -> None:
        if self._w.opening:
            self._w.current_id = self._w.opening
            self._w.opening = None
        if self._w.pending_files:
            QTimer.singleShot(0, lambda: self._w.open_file(self._w.pending_files.pop(0)))
        in_library = event.path.parent == self._w.library.folder
        self._w.file = None if in_library else event.path
        self._w.inspector.session_panel._on_file_event(event)
        if not in_library or event.note:
            self._w.notice.show_message(
                f"Opened {event.path.name}" + (f" ({event.note})." if event.note else "."),
                error=bool(event.note) and "differs" in event.note,
            )
        elif self._w.notice.text().startswith("Recomputing"):
            self._w.notice.hide()
        self._w.sidebar.set_current(self._w.current_id)
        self._w.update_title()

    @Slot(str, str)
    def _on_foreign_session(self, path: str, reason: str) -> None:
        if self._w.dialogs.confirm(
            "Different Model", f"{reason}\n\nRestore the transcript only?", "Restore Transcript"
        ):
            self._w.client.restore(
                Path(path), transcript_only=True, store_path=self._w.library.path_for(self._w.opening or new_id())
            )
        else:
            self._w.opening = None

    @Slot(str)
    def _on_restored_system_prompt(self, text: str) -> None:
        self._w.system_prompt.blockSignals(True)
        self._w.system_prompt.setText(text)
        self._w.system_prompt.blockSignals(False)


def _is_default(path: Path) -> bool:
    try:
        return path.resolve() == default_model_path().resolve()
    except (OSError, SparkError):  # not installed or damaged: nothing is the default
        return False
