"""The engine side of the app: a `ConversationWorker` (QObject) living in its own QThread owns one conversation.

The GUI talks to it only through `app.client.ConversationClient`, whose request signals are queued into the worker's thread,
and listens to the worker's typed signals. Generation runs inside a worker slot, so the GUI thread never waits
on it; Stop sets a `threading.Event` that the generate loop polls before every token (no queue round-trip, so it
takes effect within one token even though the worker's event loop is busy).

Two clients exist in the app: the main chat (which also loads models) and the quick prompt (which attaches to the
loaded engine and opens its own short-lived session). The engine's step lock interleaves their forwards.
Everything crossing a thread boundary is plain data (dataclasses, strings) or an engine object handed over whole.

The main chat's worker stores its conversation after every change (a compact `.spark`, atomically) in the file the
GUI's conversation library assigned to it, and reports each store, so nothing typed or generated is ever only in
memory. A remote server chosen as the model (`use_remote`) takes the local session's place: the same requests
stream from `engine.openai.client.RemoteSession`, whose memory is the server's, so the conversation is stored as its
transcript only.
Its state (session, remote, store path, parked sessions) is public to its helpers on its own thread: the session
files (`app.session_files`) and the memory figures (`app.memory_report`); the GUI never reads it, it listens.
(Just over 400 lines: one worker owns every request about its conversation, and they share that state.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.engine_factory import load_engine
from app.memory_report import episodic_hits, memory_report, turns_ago
from app.session_files import SessionFiles
from app.worker_types import (
    LoadedModel,
    MemoryReport,
    MessageView,
    ModelInfo,
    ReadProgress,
    SessionFileEvent,
    StoredConversation,
    TurnProgress,
    TurnResult,
    remote_name,
)
from engine.errors import SparkError
from engine.generation.loop import FinishReason, GenerationEvent, GenerationSettings, PrefillProgress
from engine.hw import HardwarePolicy, PolicyDecision
from engine.openai.client import RemoteClient, RemoteServer, RemoteSession
from engine.session.engine import ChatMessage, Engine, Session
from engine.session.file import (
    SessionData,
    load_session,
)

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.1  # turn stats (tokens/s) at most 10 times a second
MEMORY_INTERVAL_S = 0.25  # tier stats at most 4 times a second: the panels need no more
READ_INTERVAL_S = 0.1  # reading progress at most 10 times a second
PARKED_CONVERSATIONS = 3  # conversations left recently whose memory stays ready (Undo, switching back: no recompute)


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
    reading = Signal(ReadProgress)
    stored = Signal(StoredConversation)
    remote_ready = Signal(object)  # RemoteServer: replies now stream from it
    shut_down = Signal()

    def __init__(
        self,
        policy: HardwarePolicy | None,
        cache_dir: Path,
        store: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._clock = clock  # paces the progress reports; the tests pass a fake
        self._policy = policy
        self._cache_dir = cache_dir
        self._store_enabled = store  # the main chat stores every change; the quick prompt keeps nothing
        self.store_path: Path | None = None  # this conversation's file in the library
        self.engine: Engine | None = None
        self.session: Session | None = None
        self.remote: RemoteSession | None = None  # set while a remote server is the model
        self.system_text = ""
        self.turn_starts: list[int] = []  # memory length when each turn began (for "recalled from N turns ago")
        self.parked: OrderedDict[Path, tuple[Session, list[int]]] = OrderedDict()  # store path -> session, turns
        self._read_t0 = 0.0
        self._read_last = 0.0
        self._files = SessionFiles(self)
        # Decisions arrive on whichever thread made them; a signal carries them to the GUI safely.
        self._unsubscribe = policy.subscribe(self.policy.emit) if policy is not None else None

    # -- model ---------------------------------------------------------------------------------------------------
    @Slot(str, str, str, object)
    def _on_load(self, model_dir: str, backend: str, quantize: str, cancel: threading.Event) -> None:
        self.loading.emit(model_dir)
        try:
            engine = load_engine(
                Path(model_dir) if model_dir else None, backend, self._cache_dir, self._policy, quantize
            )
            if cancel.is_set():  # loading cannot be interrupted midway; a cancelled load is simply dropped
                self.load_cancelled.emit()
                return
            session = engine.new_session()
        except SparkError as exc:
            self.error.emit(str(exc))
            return
        except Exception as exc:
            log.exception("model load failed")
            self.error.emit(f"The model in {model_dir or 'the app bundle'} could not be loaded ({exc}).")
            return
        had_conversation = self._active_messages() > 0
        self._drop_remote()
        self.engine, self.session = engine, session
        self.parked.clear()  # their memory belongs to the previous model
        self.prepare(session)
        b = engine.backend
        info = ModelInfo(
            engine.model_dir.name,
            engine.model_dir,
            b.name,
            engine.choice.explain(),
            b.weight_bytes,
            b.kv_bytes_per_token(),
        )
        self.loaded.emit(LoadedModel(engine, info))
        self.memory.emit(memory_report(self.session, self.remote))
        if had_conversation and self.store_path is not None and self.store_path.is_file():
            self._files.carry_over(self.store_path)

    @Slot(object)
    def _on_attach(self, engine: Engine) -> None:
        """Use an engine another worker loaded; the session opens lazily on the first prompt."""
        self.engine, self.session = engine, None

    @Slot(object)
    def _on_use_remote(self, server: RemoteServer) -> None:
        """Chat with `server` from now on; the open conversation goes on there (its transcript is sent with the
        next message). Nothing is contacted until then, so this never waits on the network."""
        messages = self._messages()
        self._drop_remote()
        self.remote = RemoteSession(
            RemoteClient(server), [{"role": r, "content": c} for r, c in messages], self.system_text
        )
        if self.session is not None:  # the local memory would go stale beside the remote transcript: freed
            self.session.reset()
        self.parked.clear()
        self.turn_starts = []
        self.remote_ready.emit(server)
        self.memory.emit(memory_report(self.session, self.remote))

    # -- conversation ----------------------------------------------------------------------------------------------
    @Slot(str, object, object)
    def _on_send(self, text: str, settings: GenerationSettings, stop: threading.Event) -> None:
        remote = self.remote
        if remote is not None:
            self._stream(lambda: remote.chat(text, settings, stop.is_set))
            return
        session = self.require_session()
        if session is None:
            self._finish_unstarted()
            return
        self._stream(lambda: session.chat(text, settings, stop.is_set))

    @Slot(object, object)
    def _on_regenerate(self, settings: GenerationSettings, stop: threading.Event) -> None:
        remote = self.remote
        session = self.require_session() if remote is None else None
        if remote is None and session is None:
            self._finish_unstarted()
            return
        if not any(role == "user" for role, _ in self._messages()):
            self.error.emit("There is no prompt to answer again yet; send one first.")
            self._finish_unstarted()
            return
        if remote is not None:
            self._stream(lambda: remote.regenerate(settings, stop.is_set))
        else:
            assert session is not None
            self._stream(lambda: session.regenerate(settings, stop.is_set))

    @Slot(str)
    def _on_new_chat(self, store_path: str) -> None:
        """Start an empty conversation stored at `store_path` (the previous one is already stored)."""
        if self.remote is not None:
            self.remote.reset()
            self.store_path = Path(store_path) if store_path else None
            self.memory.emit(memory_report(self.session, self.remote))
            return
        if self.session is None:
            self.store_path = Path(store_path) if store_path else None
            return
        self.park()  # the GUI cleared its view itself: a late "empty" signal would erase what was typed since
        self.store_path = Path(store_path) if store_path else None
        self.memory.emit(memory_report(self.session, self.remote))

    @Slot(str, str, int, object)
    def _on_branch(self, source: str, store_path: str, upto: int, stop: threading.Event) -> None:
        """A new conversation with the messages of `source` up to index `upto` (inclusive), its memory read anew."""
        if self.remote is not None:
            self._branch_remote(Path(source), Path(store_path), upto)
            return
        if self.require_session() is None:
            self._finish_unstarted()
            return
        try:
            data = load_session(Path(source))
        except (SparkError, OSError) as exc:
            self.error.emit(f"The conversation could not be branched ({exc}).")
            self._finish_unstarted()
            return
        self.park()
        session = self.session
        assert session is not None
        self.store_path = Path(store_path)
        session.messages = [
            ChatMessage(m.role, m.content, m.timestamp or time.time()) for m in data.messages[: upto + 1]
        ]
        self.system_text = session.system_prompt = data.system_prompt or ""
        self.system_prompt.emit(session.system_prompt)
        self.conversation.emit(self.transcript())
        self.start_reading()
        try:
            session.read_transcript(stop.is_set)
        except Exception as exc:
            log.exception("reading a branch failed")
            self.error.emit(f"The branch's memory could not be read ({exc}); it is read on the next message instead.")
        self.memory.emit(memory_report(self.session, self.remote))
        self.store()
        self.finished.emit(TurnResult(FinishReason.STOP, TurnProgress(len(session.memory.tokens), 0, 0.0, 0.0), ""))

    def _branch_remote(self, source: Path, store_path: Path, upto: int) -> None:
        """A remote conversation has no memory to read: the branch is its transcript up to `upto`."""
        assert self.remote is not None
        try:
            data = load_session(source)
        except (SparkError, OSError) as exc:
            self.error.emit(f"The conversation could not be branched ({exc}).")
            self._finish_unstarted()
            return
        self.take_transcript(data, store_path, upto + 1)
        self.store()
        self.finished.emit(TurnResult(FinishReason.STOP, TurnProgress(0, 0, 0.0, 0.0), ""))

    def take_transcript(self, data: SessionData, store_path: Path | None, upto: int | None = None) -> None:
        assert self.remote is not None
        self.remote.messages = [{"role": m.role, "content": m.content} for m in data.messages[:upto]]
        self.system_text = self.remote.system_prompt = data.system_prompt or ""
        self.store_path = store_path
        self.system_prompt.emit(self.system_text)
        self.conversation.emit(self.transcript())
        self.memory.emit(memory_report(self.session, self.remote))

    @Slot()
    def _on_release(self) -> None:
        """Drop the session (the quick prompt closed): its slot table is freed; the next prompt opens a new one."""
        self.session = None

    @Slot(str)
    def _on_system_prompt(self, text: str) -> None:
        self.system_text = text
        if self.remote is not None:
            self.remote.system_prompt = text
            self.store()
        elif self.session is not None:
            self.session.system_prompt = text
            self.store()

    def park(self) -> None:
        """Leave the current conversation: keep its session (memory ready) among the parked ones and go on with a
        fresh one; an empty conversation is just reset."""
        if self.session is None or self.engine is None or self.remote is not None:
            return
        if not self.session.messages or self.store_path is None:
            self.session.reset()
            self.turn_starts = []
            return
        self.parked[self.store_path] = (self.session, self.turn_starts)
        self.parked.move_to_end(self.store_path)
        while len(self.parked) > PARKED_CONVERSATIONS:
            self.parked.popitem(last=False)  # its slot table is freed with it
        self.session = self.engine.new_session()
        self.prepare(self.session)
        self.turn_starts = []

    # -- session files (app.session_files) ---------------------------------------------------------------------------
    @Slot(str, bool)
    def _on_save(self, path: str, full_memory: bool) -> None:
        self._files.save(path, full_memory)

    @Slot(str, bool, str)
    def _on_restore(self, path: str, transcript_only: bool, store_path: str) -> None:
        self._files.restore(path, transcript_only, store_path)

    @Slot()
    def _on_shutdown(self) -> None:
        """Last request before the thread quits: store the conversation (the reply was already stopped)."""
        try:
            self.store()
            self._drop_remote()
        finally:
            if self._unsubscribe is not None:  # the policy outlives this worker: no decision may reach it after
                self._unsubscribe()
                self._unsubscribe = None
            QThread.currentThread().quit()

    # -- internals -------------------------------------------------------------------------------------------------
    def require_session(self) -> Session | None:
        if self.session is None and self.engine is not None:
            self.session = self.engine.new_session()
            self.prepare(self.session)
        if self.session is None:
            self.error.emit("No model is loaded yet; open a model folder first.")
        return self.session

    def prepare(self, session: Session) -> None:
        session.system_prompt = self.system_text
        if self._store_enabled:
            session.on_prefill = self._on_prefill

    def start_reading(self) -> None:
        """A file starts being read: its progress is timed from now, and reported at most every READ_INTERVAL_S."""
        self._read_t0 = self._read_last = self._clock()

    def _on_prefill(self, p: PrefillProgress) -> None:
        self._report_reading("prompt", p.done, p.total, p.done - p.reused, p.elapsed_s)

    def restore_progress(self, done: int, total: int) -> None:
        self._report_reading("restore", done, total, done, self._clock() - self._read_t0)

    def _report_reading(self, kind: str, done: int, total: int, computed: int, elapsed: float) -> None:
        now = self._clock()
        if done < total and now - self._read_last < READ_INTERVAL_S:
            return
        self._read_last = now
        rate = computed / elapsed if elapsed > 0 else 0.0
        left = (total - done) / rate if rate > 0 else 0.0
        self.reading.emit(ReadProgress(kind, done, total, rate, left))

    def store(self) -> None:
        """Store the conversation now (compact, atomic) when it has any message; errors are shown, never raised."""
        session = self.remote or self.session
        if not self._store_enabled or session is None or self.store_path is None or not self._active_messages():
            return
        try:
            if isinstance(session, RemoteSession):
                session.save(self.store_path)  # transcript only: the memory is the server's
            else:
                session.save(self.store_path, compact=True)
        except Exception as exc:
            log.exception("storing the conversation failed")
            self.error.emit(
                f"The conversation could not be stored in the data folder ({exc}); it is still open, and will be stored on the next change."
            )
            return
        model = (
            remote_name(self.remote.client.server)
            if self.remote is not None
            else self.engine.model_dir.name
            if self.engine is not None
            else ""
        )
        messages = tuple(self._messages())
        self.stored.emit(StoredConversation(self.store_path, messages, model))

    def _finish_unstarted(self) -> None:
        """Every send/regenerate request ends with `finished`, so the GUI always leaves its busy state."""
        self.finished.emit(TurnResult("error", TurnProgress(0, 0, 0.0, 0.0), ""))

    def _messages(self) -> list[tuple[str, str]]:
        """The open conversation as (role, content), whichever backend holds it."""
        if self.remote is not None:
            return [(m["role"], m["content"]) for m in self.remote.messages]
        return [(m.role, m.content) for m in self.session.messages] if self.session is not None else []

    def _active_messages(self) -> int:
        return (
            len(self.remote.messages)
            if self.remote is not None
            else len(self.session.messages)
            if self.session is not None
            else 0
        )

    def _drop_remote(self) -> None:
        if self.remote is not None:
            self.remote.client.close()
            self.remote = None

    def transcript(self) -> list[MessageView]:
        return [MessageView(r, c) for r, c in self._messages()]

    def _stream(self, start: Callable[[], Iterator[GenerationEvent]]) -> None:
        reason: FinishReason | Literal["error"] = "error"
        text: list[str] = []
        progress = TurnProgress(0, 0, 0.0, 0.0)
        last_progress = last_memory = self._read_t0 = self._clock()
        self._read_last = 0.0  # the first reading report goes out at once
        hits_before = self._episodic_hits()
        if self.session is not None and self.remote is None:
            self.turn_starts.append(len(self.session.memory.tokens))
        try:
            for ev in start():
                if ev.text:
                    text.append(ev.text)
                    self.delta.emit(ev.text)
                progress = TurnProgress(ev.prompt_tokens, ev.generated_tokens, ev.ttft_s, ev.tokens_per_s)
                now = self._clock()
                if now - last_progress >= PROGRESS_INTERVAL_S:
                    last_progress = now
                    self.progress.emit(progress)
                if now - last_memory >= MEMORY_INTERVAL_S:
                    last_memory = now
                    self.memory.emit(memory_report(self.session, self.remote))
                if ev.finish_reason:
                    reason = ev.finish_reason
        except SparkError as exc:
            self.error.emit(str(exc))
            self.conversation.emit(self.transcript())
        except Exception as exc:
            log.exception("generation failed")
            self.error.emit(f"Generation failed ({type(exc).__name__}: {exc}); the conversation is kept, try again.")
            self.conversation.emit(self.transcript())
        self.progress.emit(progress)
        self.memory.emit(memory_report(self.session, self.remote))
        recalled = turns_ago(self.session, self.turn_starts) if self._episodic_hits() > hits_before else 0
        self.store()  # stored before `finished`: a finished turn is never only in memory
        self.finished.emit(TurnResult(reason, progress, "".join(text), recalled))

    def _episodic_hits(self) -> int:
        return episodic_hits(self.session if self.remote is None else None)
