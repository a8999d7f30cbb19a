"""A worker's session files: save a copy, open one (its words at once, then its memory), carry one over to a new model.

Runs on the worker's thread, on the worker's state; every outcome is one of the worker's signals, and every
failure one sentence (the open conversation stays as it was).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from app.memory_report import memory_report
from app.worker_types import MessageView, SessionFileEvent
from engine.errors import SparkError
from engine.session.file import RECOMPUTE_KIND, TRANSCRIPT_KIND, SessionData, load_session

if TYPE_CHECKING:
    from app.worker import ConversationWorker

log = logging.getLogger(__name__)


class SessionFiles:
    """Save, open and carry over the conversation of one `ConversationWorker`."""

    def __init__(self, worker: ConversationWorker) -> None:
        self._w = worker

    def carry_over(self, path: Path) -> None:
        """Another model (or precision) was loaded: the open conversation continues on it. Its stored file comes
        back exactly where the model and numerics match, else as a transcript that the next turn re-reads."""
        assert self._w.session is not None
        self._w.start_reading()
        try:
            report = self._w.session.load(path, accept_transcript_only=True, on_progress=self._w.restore_progress)
        except Exception as exc:  # the file stays; the user can reopen it from the history
            log.exception("carrying the conversation over failed")
            self._w.error.emit(
                f"The conversation could not be carried over to the new model ({exc}); it is kept in the history."
            )
            self._w.conversation.emit([])
            return
        note = "the new model re-reads it on the next message" if report.transcript_only else ""
        self.opened(path, note)

    def save(self, path: str, full_memory: bool) -> None:
        if self._w.session is None and self._w.remote is None:
            self._w.error.emit("There is no conversation to save yet; load a model first.")
            return
        try:
            if self._w.remote is not None:  # the server's memory is not ours: the transcript is all there is
                self._w.remote.save(Path(path))
            else:
                assert self._w.session is not None
                self._w.session.save(Path(path), compact=not full_memory)
        except SparkError as exc:
            self._w.error.emit(str(exc))
            return
        except OSError as exc:
            self._w.error.emit(f"The session could not be saved to {path} ({exc.strerror or exc}).")
            return
        except Exception as exc:
            log.exception("save failed")
            self._w.error.emit(f"The session could not be saved ({type(exc).__name__}: {exc}).")
            return
        self._w.saved.emit(SessionFileEvent("saved", Path(path), time.time()))

    def restore(self, path: str, transcript_only: bool, store_path: str) -> None:
        """Open `path`; from then on the conversation is stored at `store_path` (its own library file when it
        came from the library, a new one for a file opened from elsewhere)."""
        if self._w.remote is not None:
            self._restore_remote(Path(path), Path(store_path) if store_path else None)
            return
        if self._w.require_session() is None or self._w.engine is None:
            return
        target = Path(store_path) if store_path else None
        parked = self._w.parked.pop(Path(path), None) if not transcript_only and target == Path(path) else None
        if parked is not None:  # left a moment ago: its memory is still there, nothing to recompute
            self._w.park()
            self._w.session, self._w.turn_starts = parked
            self._w.store_path = target
            self.opened(Path(path), "")
            return
        # A compact file's memory takes a while to recompute: its words are shown at once (they are cheap to read).
        peek = self._peek(Path(path))
        kind = peek.memory_meta.get("kind") if peek is not None else None
        # A remote server's conversation holds no memory at all: taking its transcript loses nothing, so no question.
        transcript_only = transcript_only or kind == TRANSCRIPT_KIND
        preview = (
            [MessageView(m.role, m.content) for m in peek.messages]
            if peek is not None and kind == RECOMPUTE_KIND
            else []
        )
        if preview:
            self._w.conversation.emit(preview)
        # Read into a fresh session: on any error (or another model's file) the open conversation is untouched.
        session = self._w.engine.new_session()
        self._w.prepare(session)
        self._w.start_reading()
        try:
            report = session.load(
                Path(path), accept_transcript_only=transcript_only, on_progress=self._w.restore_progress
            )
        except Exception as exc:  # the worker must answer every request; the chat stays as it was
            if isinstance(exc, SparkError):
                self._w.error.emit(str(exc))
            elif isinstance(exc, OSError):
                self._w.error.emit(f"The session {Path(path).name} could not be read ({exc.strerror or exc}).")
            else:
                log.exception("restore failed")
                self._w.error.emit(
                    f"The session {Path(path).name} could not be restored ({type(exc).__name__}: {exc})."
                )
            if preview:
                self._w.conversation.emit(self._w.transcript())  # back to the conversation that is still open
            return
        if not report.applied:  # another model's file: nothing changed until the user accepts transcript-only
            if preview:
                self._w.conversation.emit(self._w.transcript())
            self._w.foreign_session.emit(path, report.message)
            return
        self._w.park()
        self._w.session, self._w.turn_starts = session, []
        note = "transcript only: the memory is re-read on the next turn" if report.transcript_only else ""
        if session.restore_digest_ok is False:
            note = "its memory was recomputed and differs slightly from the saved one (other numerics)"
        joins = target is not None and target != Path(path)
        self._w.store_path = target
        self.opened(Path(path), note)
        if joins:
            self._w.store()  # a file opened from elsewhere joins the library as a new conversation

    def _peek(self, path: Path) -> SessionData | None:
        """The file's transcript and kind (no memory is touched), or None for one that does not read."""
        try:
            return load_session(path)
        except Exception:  # the real load says what is wrong, in one sentence
            return None

    def _restore_remote(self, path: Path, target: Path | None) -> None:
        """With a remote model any conversation opens as its transcript (the server re-reads it with the next message)."""
        try:
            data = load_session(path)
        except SparkError as exc:
            self._w.error.emit(str(exc))
            return
        except OSError as exc:
            self._w.error.emit(f"The session {path.name} could not be read ({exc.strerror or exc}).")
            return
        joins = target is not None and target != path
        self._w.take_transcript(data, target)
        self._w.restored.emit(SessionFileEvent("restored", path, time.time(), ""))
        if joins:
            self._w.store()

    def opened(self, path: Path, note: str) -> None:
        session = self._w.session
        assert session is not None
        self._w.system_text = session.system_prompt
        self._w.system_prompt.emit(session.system_prompt)
        self._w.conversation.emit(self._w.transcript())
        self._w.memory.emit(memory_report(self._w.session, self._w.remote))
        self._w.restored.emit(SessionFileEvent("restored", path, time.time(), note))
