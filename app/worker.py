"""The engine side of the app: a `ConversationWorker` (QObject) living in its own QThread owns one conversation.

The GUI talks to it only through `ConversationClient`, whose request signals are queued into the worker's thread,
and listens to the worker's typed signals. Generation runs inside a worker slot, so the GUI thread never waits
on it; Stop sets a `threading.Event` that the generate loop polls before every token (no queue round-trip, so it
takes effect within one token even though the worker's event loop is busy).

Two clients exist in the app: the main chat (which also loads models) and the quick prompt (which attaches to the
loaded engine and opens its own short-lived session). The engine's step lock interleaves their forwards.
Everything crossing a thread boundary is plain data (dataclasses, strings) or an engine object handed over whole.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.engine_factory import load_engine
from engine.autosave import Autosaver
from engine.cascade import TierStats
from engine.errors import SparkError
from engine.generate import GenerationEvent, GenerationSettings
from engine.hw import HardwarePolicy, PolicyDecision
from engine.session import ChatMessage, Engine, Session

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.1  # turn stats (tokens/s) at most 10 times a second
MEMORY_INTERVAL_S = 0.25  # tier stats at most 4 times a second: the panels need no more


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    backend: str
    backend_detail: str  # BackendChoice.explain(): the backend and why faster ones were skipped
    weight_bytes: int
    kv_bytes_per_token: int


@dataclass(frozen=True)
class LoadedModel:
    engine: Engine  # handed to the quick prompt's worker; the GUI only reads `info`
    info: ModelInfo


@dataclass(frozen=True)
class TurnProgress:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    tokens_per_s: float


@dataclass(frozen=True)
class MemoryReport:
    tiers: tuple[TierStats, ...]  # the cascade's own snapshot type: plain numbers, no tensors
    tokens: int  # tokens this conversation's memory holds


@dataclass(frozen=True)
class TurnResult:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    progress: TurnProgress
    text: str


@dataclass(frozen=True)
class MessageView:
    role: str
    content: str


@dataclass(frozen=True)
class SessionFileEvent:
    kind: str  # "saved" | "restored"
    path: Path
    when: float  # seconds since the epoch
    note: str = ""  # e.g. "transcript only: memory re-read on the next turn"


class ConversationWorker(QObject):
    loading = Signal(str)  # model folder being loaded
    loaded = Signal(LoadedModel)
    load_cancelled = Signal()
    delta = Signal(str)  # one token's text (coalesced by the GUI)
    progress = Signal(TurnProgress)
    memory = Signal(MemoryReport)
    finished = Signal(TurnResult)
    error = Signal(str)  # one user-facing sentence
    conversation = Signal(list)  # list[MessageView]: the transcript after a restore, undo or failed turn
    saved = Signal(SessionFileEvent)
    restored = Signal(SessionFileEvent)
    foreign_session = Signal(str, str)  # path, why only the transcript can be restored
    system_prompt = Signal(str)  # the restored session's system prompt
    policy = Signal(PolicyDecision)
    shut_down = Signal()

    def __init__(self, policy: HardwarePolicy | None, cache_dir: Path, autosave_path: Path | None = None) -> None:
        super().__init__()
        self._policy = policy
        self._cache_dir = cache_dir
        # Checkpoints between replies (at most once a minute) and on quit; the quick prompt keeps none.
        self._autosaver = Autosaver(autosave_path, self._autosave) if autosave_path else None
        self._engine: Engine | None = None
        self._session: Session | None = None
        self._system_prompt = ""
        self._undo: list[MessageView] | None = None  # the transcript a New Chat dropped, until the next turn
        if policy is not None:
            # Decisions arrive on whichever thread made them; a signal carries them to the GUI safely.
            self._unsubscribe = policy.subscribe(self.policy.emit)

    # -- model ---------------------------------------------------------------------------------------------------
    @Slot(str, str, object)
    def _on_load(self, model_dir: str, backend: str, cancel: threading.Event) -> None:
        self.loading.emit(model_dir)
        try:
            engine = load_engine(Path(model_dir) if model_dir else None, backend, self._cache_dir, self._policy)
            if cancel.is_set():  # loading cannot be interrupted midway; a cancelled load is simply dropped
                self.load_cancelled.emit()
                return
            session = engine.new_session()
        except SparkError as exc:
            self.error.emit(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a broken model must not take the worker down
            log.exception("model load failed")
            self.error.emit(f"The model in {model_dir or 'the app bundle'} could not be loaded ({exc}).")
            return
        self._engine, self._session = engine, session
        session.system_prompt = self._system_prompt
        b = engine.backend
        info = ModelInfo(engine.model_dir.name, engine.model_dir, b.name, engine.choice.explain(), b.weight_bytes, b.kv_bytes_per_token())
        self.loaded.emit(LoadedModel(engine, info))
        self.memory.emit(self._memory_report())

    @Slot(object)
    def _on_attach(self, engine: Engine) -> None:
        """Use an engine another worker loaded; the session opens lazily on the first prompt."""
        self._engine, self._session = engine, None

    # -- conversation ----------------------------------------------------------------------------------------------
    @Slot(str, object, object)
    def _on_send(self, text: str, settings: GenerationSettings, stop: threading.Event) -> None:
        session = self._require_session()
        if session is None:
            self._finish_unstarted()
            return
        self._undo = None
        self._stream(lambda: session.chat(text, settings, stop.is_set))

    @Slot(object, object)
    def _on_regenerate(self, settings: GenerationSettings, stop: threading.Event) -> None:
        session = self._require_session()
        if session is None:
            self._finish_unstarted()
            return
        if not any(m.role == "user" for m in session.messages):
            self.error.emit("There is no prompt to answer again yet; send one first.")
            self._finish_unstarted()
            return
        self._undo = None
        self._stream(lambda: session.regenerate(settings, stop.is_set))

    @Slot()
    def _on_new_chat(self) -> None:
        if self._session is None:
            return
        if self._session.messages:
            self._undo = self._transcript()
        self._session.reset()
        self.conversation.emit([])
        self.memory.emit(self._memory_report())
        self._changed()

    @Slot()
    def _on_undo_new_chat(self) -> None:
        if self._session is None or self._undo is None:
            return
        # Memory stays empty: the next turn finds no known prefix and re-reads the restored transcript.
        self._session.reset()
        self._session.messages = [ChatMessage(m.role, m.content) for m in self._undo]
        self._undo = None
        self.conversation.emit(self._transcript())
        self._changed()

    @Slot()
    def _on_release(self) -> None:
        """Drop the session (the quick prompt closed): its slot table is freed; the next prompt opens a new one."""
        self._session = None

    @Slot(str)
    def _on_system_prompt(self, text: str) -> None:
        self._system_prompt = text
        if self._session is not None:
            self._session.system_prompt = text

    # -- session files ---------------------------------------------------------------------------------------------
    @Slot(str)
    def _on_save(self, path: str) -> None:
        if self._session is None:
            self.error.emit("There is no conversation to save yet; load a model first.")
            return
        try:
            self._session.save(Path(path))
        except SparkError as exc:
            self.error.emit(str(exc))
            return
        except OSError as exc:
            self.error.emit(f"The session could not be saved to {path} ({exc.strerror or exc}).")
            return
        except Exception as exc:  # noqa: BLE001 - the worker must answer every request
            log.exception("save failed")
            self.error.emit(f"The session could not be saved ({type(exc).__name__}: {exc}).")
            return
        self.saved.emit(SessionFileEvent("saved", Path(path), time.time()))

    @Slot(str, bool)
    def _on_restore(self, path: str, transcript_only: bool) -> None:
        session = self._require_session()
        if session is None:
            return
        try:
            report = session.load(Path(path), accept_transcript_only=transcript_only)
        except SparkError as exc:
            self.error.emit(str(exc))
            return
        except OSError as exc:
            self.error.emit(f"The session {Path(path).name} could not be read ({exc.strerror or exc}).")
            return
        except Exception as exc:  # noqa: BLE001 - the worker must answer every request; the chat stays as it was
            log.exception("restore failed")
            self.error.emit(f"The session {Path(path).name} could not be restored ({type(exc).__name__}: {exc}).")
            return
        if not report.applied:  # another model's file: nothing changed until the user accepts transcript-only
            self.foreign_session.emit(path, report.message)
            return
        self._undo = None
        self._system_prompt = session.system_prompt
        self.system_prompt.emit(session.system_prompt)
        note = "transcript only: the memory is re-read on the next turn" if report.transcript_only else ""
        self.conversation.emit(self._transcript())
        self.memory.emit(self._memory_report())
        self.restored.emit(SessionFileEvent("restored", Path(path), time.time(), note))

    @Slot()
    def _on_shutdown(self) -> None:
        """Last request before the thread quits: checkpoint the conversation (the reply was already stopped)."""
        try:
            if self._autosaver is not None and not self._autosaver.flush():
                log.error("autosave on quit failed: %s", self._autosaver.last_error)
        except Exception:  # noqa: BLE001 - quitting must never hang on a failed checkpoint
            log.exception("autosave on quit failed")
        finally:
            QThread.currentThread().quit()

    # -- internals -------------------------------------------------------------------------------------------------
    def _require_session(self) -> Session | None:
        if self._session is None and self._engine is not None:
            self._session = self._engine.new_session()
            self._session.system_prompt = self._system_prompt
        if self._session is None:
            self.error.emit("No model is loaded yet; open a model folder first.")
        return self._session

    def _autosave(self, path: Path) -> None:
        if self._session is not None and self._session.messages:  # an empty new chat must not replace the last one
            self._session.save(path)

    def _changed(self) -> None:
        if self._autosaver is None:
            return
        self._autosaver.changed()
        try:
            self._autosaver.tick()
        except Exception:  # noqa: BLE001 - a failed checkpoint is retried later; the chat goes on
            log.exception("autosave failed")

    def _finish_unstarted(self) -> None:
        """Every send/regenerate request ends with `finished`, so the GUI always leaves its busy state."""
        self.finished.emit(TurnResult("error", TurnProgress(0, 0, 0.0, 0.0), ""))

    def _transcript(self) -> list[MessageView]:
        assert self._session is not None
        return [MessageView(m.role, m.content) for m in self._session.messages]

    def _stream(self, start: Callable[[], Iterator[GenerationEvent]]) -> None:
        reason, text = "error", []
        progress = TurnProgress(0, 0, 0.0, 0.0)
        last_progress = last_memory = time.monotonic()
        try:
            for ev in start():
                if ev.text:
                    text.append(ev.text)
                    self.delta.emit(ev.text)
                progress = TurnProgress(ev.prompt_tokens, ev.generated_tokens, ev.ttft_s, ev.tokens_per_s)
                now = time.monotonic()
                if now - last_progress >= PROGRESS_INTERVAL_S:
                    last_progress = now
                    self.progress.emit(progress)
                if now - last_memory >= MEMORY_INTERVAL_S:
                    last_memory = now
                    self.memory.emit(self._memory_report())
                if ev.finish_reason:
                    reason = ev.finish_reason
        except SparkError as exc:
            self.error.emit(str(exc))
            self.conversation.emit(self._transcript())
        except Exception as exc:  # noqa: BLE001 - a failing backend must leave the worker usable
            log.exception("generation failed")
            self.error.emit(f"Generation failed ({type(exc).__name__}: {exc}); the conversation is kept, try again.")
            self.conversation.emit(self._transcript())
        self.progress.emit(progress)
        self.memory.emit(self._memory_report())
        self.finished.emit(TurnResult(reason, progress, "".join(text)))
        self._changed()

    def _memory_report(self) -> MemoryReport:
        if self._session is None:
            return MemoryReport((), 0)
        memory = self._session.memory
        stats = self._session.stats()  # the cascade's tiers; a memory without tiers is shown as one flat tier
        if stats is not None:
            return MemoryReport((stats.working, stats.episodic, stats.persistent), len(memory.tokens))
        backend = self._session.backend
        per_token = backend.kv_bytes_per_token()
        n = len(memory.tokens)
        row = TierStats("working", n, n * per_token, backend.num_slots * per_token, 0, 0, 0.0, 0)
        return MemoryReport((row,), n)


class ConversationClient(QObject):
    """GUI-side handle: owns the worker's thread, turns method calls into queued requests, re-emits results."""

    _load = Signal(str, str, object)
    _attach = Signal(object)
    _send = Signal(str, object, object)
    _regenerate = Signal(object, object)
    _new_chat = Signal()
    _undo_new_chat = Signal()
    _release = Signal()
    _set_system_prompt = Signal(str)
    _save = Signal(str)
    _restore = Signal(str, bool)
    _shutdown = Signal()

    busy_changed = Signal(bool)  # a reply is being generated

    def __init__(
        self, name: str, policy: HardwarePolicy | None, cache_dir: Path, autosave_path: Path | None = None, parent: QObject | None = None
    ) -> None:
        super().__init__(parent)
        self._thread = QThread(self)
        self._thread.setObjectName(name)
        self.worker = ConversationWorker(policy, cache_dir, autosave_path)
        self.worker.moveToThread(self._thread)
        self._thread.finished.connect(self.worker.deleteLater)
        for request, slot in (
            (self._load, self.worker._on_load),
            (self._attach, self.worker._on_attach),
            (self._send, self.worker._on_send),
            (self._regenerate, self.worker._on_regenerate),
            (self._new_chat, self.worker._on_new_chat),
            (self._undo_new_chat, self.worker._on_undo_new_chat),
            (self._release, self.worker._on_release),
            (self._set_system_prompt, self.worker._on_system_prompt),
            (self._save, self.worker._on_save),
            (self._restore, self.worker._on_restore),
            (self._shutdown, self.worker._on_shutdown),
        ):
            request.connect(slot)  # auto connection: queued, since the worker lives in another thread
        self.worker.finished.connect(self._on_finished)
        self._stop: threading.Event | None = None
        self._cancel_load: threading.Event | None = None
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._stop is not None

    # -- requests ----------------------------------------------------------------------------------------------------
    def load(self, model_dir: Path | None, backend: str = "auto") -> None:
        self._cancel_load = threading.Event()
        self._load.emit(str(model_dir) if model_dir else "", backend, self._cancel_load)

    def cancel_load(self) -> None:
        if self._cancel_load is not None:
            self._cancel_load.set()

    def attach(self, engine: Engine) -> None:
        self._attach.emit(engine)

    def send(self, text: str, settings: GenerationSettings) -> None:
        self._send.emit(text, settings, self._begin())

    def regenerate(self, settings: GenerationSettings) -> None:
        self._regenerate.emit(settings, self._begin())

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def new_chat(self) -> None:
        self._new_chat.emit()

    def undo_new_chat(self) -> None:
        self._undo_new_chat.emit()

    def release(self) -> None:
        self.stop()
        self._release.emit()

    def set_system_prompt(self, text: str) -> None:
        self._set_system_prompt.emit(text)

    def save(self, path: Path) -> None:
        self._save.emit(str(path))

    def restore(self, path: Path, transcript_only: bool = False) -> None:
        self._restore.emit(str(path), transcript_only)

    def shutdown(self, timeout_ms: int = 30_000) -> bool:
        """Stop any reply, autosave, end the thread. Blocks the GUI only for the at-most-one-token stop + save."""
        self.stop()
        self.cancel_load()
        self._shutdown.emit()
        return self._thread.wait(timeout_ms)

    # -- internals -------------------------------------------------------------------------------------------------
    def _begin(self) -> threading.Event:
        # A fresh event per request: a Stop pressed before the worker picks the request up still applies to it.
        self._stop = threading.Event()
        self.busy_changed.emit(True)
        return self._stop

    @Slot(TurnResult)
    def _on_finished(self, result: TurnResult) -> None:
        self._stop = None
        self.busy_changed.emit(False)
