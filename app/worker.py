"""The engine side of the app: a `ConversationWorker` (QObject) living in its own QThread owns one conversation.

The GUI talks to it only through `ConversationClient`, whose request signals are queued into the worker's thread,
and listens to the worker's typed signals. Generation runs inside a worker slot, so the GUI thread never waits
on it; Stop sets a `threading.Event` that the generate loop polls before every token (no queue round-trip, so it
takes effect within one token even though the worker's event loop is busy).

Two clients exist in the app: the main chat (which also loads models) and the quick prompt (which attaches to the
loaded engine and opens its own short-lived session). The engine's step lock interleaves their forwards.
Everything crossing a thread boundary is plain data (dataclasses, strings) or an engine object handed over whole.

The main chat's worker stores its conversation after every change (a compact `.spark`, atomically) in the file the
GUI's conversation library assigned to it, and reports each store, so nothing typed or generated is ever only in
memory. A remote server chosen as the model (`use_remote`) takes the local session's place: the same requests
stream from `engine.remote.RemoteSession`, whose memory is the server's, so the conversation is stored as its
transcript only. (Over 400 lines: one worker owns every request about its conversation; splitting it would share its state.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.engine_factory import load_engine
from engine.cascade import TierStats
from engine.errors import SparkError
from engine.generate import FinishReason, GenerationEvent, GenerationSettings, PrefillProgress
from engine.hw import HardwarePolicy, PolicyDecision
from engine.remote import RemoteClient, RemoteServer, RemoteSession
from engine.session import ChatMessage, Engine, Session
from engine.session_file import (
    RECOMPUTE_KIND,
    TRANSCRIPT_KIND,
    SessionData,
    load_session,
)

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.1  # turn stats (tokens/s) at most 10 times a second
MEMORY_INTERVAL_S = 0.25  # tier stats at most 4 times a second: the panels need no more


READ_INTERVAL_S = 0.1  # reading progress at most 10 times a second
PARKED_CONVERSATIONS = 3  # conversations left recently whose memory stays ready (Undo, switching back: no recompute)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    backend: str
    backend_detail: str  # BackendChoice.explain(): the backend, its weight precision and why faster ones were skipped
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
    remote: str = ""  # a remote server's URL: its memory is the server's, none of these numbers apply


@dataclass(frozen=True)
class TurnResult:
    reason: FinishReason | Literal["error"]
    progress: TurnProgress
    text: str
    recalled_turns_ago: int = 0  # > 0: the reply used recalled (episodic) memory holding turns at least this old


@dataclass(frozen=True)
class ReadProgress:
    """A prompt (or a restored conversation's memory) being read: tokens done of total, rate, time left."""

    kind: str  # "prompt" | "restore"
    done: int
    total: int
    tokens_per_s: float
    seconds_left: float


@dataclass(frozen=True)
class StoredConversation:
    """The worker wrote its conversation to `path` (the library's file for it)."""

    path: Path
    messages: tuple[tuple[str, str], ...]  # (role, content)
    model: str


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


def remote_name(server: RemoteServer) -> str:
    """How a remote model is named in the window and the history: its name and the server's host."""
    return f"{server.model} on {urlsplit(server.url).netloc}"


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

    def __init__(self, policy: HardwarePolicy | None, cache_dir: Path, store: bool = False) -> None:
        super().__init__()
        self._policy = policy
        self._cache_dir = cache_dir
        self._store_enabled = store  # the main chat stores every change; the quick prompt keeps nothing
        self._store_path: Path | None = None  # this conversation's file in the library
        self._engine: Engine | None = None
        self._session: Session | None = None
        self._remote: RemoteSession | None = None  # set while a remote server is the model
        self._system_prompt = ""
        self._turn_starts: list[int] = []  # memory length when each turn began (for "recalled from N turns ago")
        self._parked: OrderedDict[Path, tuple[Session, list[int]]] = OrderedDict()  # store path -> session, turns
        self._read_t0 = 0.0
        self._read_last = 0.0
        if policy is not None:
            # Decisions arrive on whichever thread made them; a signal carries them to the GUI safely.
            self._unsubscribe = policy.subscribe(self.policy.emit)

    # -- model ---------------------------------------------------------------------------------------------------
    @Slot(str, str, str, object)
    def _on_load(self, model_dir: str, backend: str, quantize: str, cancel: threading.Event) -> None:
        self.loading.emit(model_dir)
        try:
            engine = load_engine(Path(model_dir) if model_dir else None, backend, self._cache_dir, self._policy, quantize)
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
        self._engine, self._session = engine, session
        self._parked.clear()  # their memory belongs to the previous model
        self._prepare(session)
        b = engine.backend
        info = ModelInfo(engine.model_dir.name, engine.model_dir, b.name, engine.choice.explain(), b.weight_bytes, b.kv_bytes_per_token())
        self.loaded.emit(LoadedModel(engine, info))
        self.memory.emit(self._memory_report())
        if had_conversation and self._store_path is not None and self._store_path.is_file():
            self._carry_over(self._store_path)

    def _carry_over(self, path: Path) -> None:
        """Another model (or precision) was loaded: the open conversation continues on it. Its stored file comes
        back exactly where the model and numerics match, else as a transcript that the next turn re-reads."""
        assert self._session is not None
        self._read_t0 = self._read_last = time.monotonic()
        try:
            report = self._session.load(path, accept_transcript_only=True, on_progress=self._on_restore_progress)
        except Exception as exc:  # noqa: BLE001 - the file stays; the user can reopen it from the history
            log.exception("carrying the conversation over failed")
            self.error.emit(f"The conversation could not be carried over to the new model ({exc}); it is kept in the history.")
            self.conversation.emit([])
            return
        note = "the new model re-reads it on the next message" if report.transcript_only else ""
        self._opened(path, note)

    @Slot(object)
    def _on_attach(self, engine: Engine) -> None:
        """Use an engine another worker loaded; the session opens lazily on the first prompt."""
        self._engine, self._session = engine, None

    @Slot(object)
    def _on_use_remote(self, server: RemoteServer) -> None:
        """Chat with `server` from now on; the open conversation goes on there (its transcript is sent with the
        next message). Nothing is contacted until then, so this never waits on the network."""
        messages = self._messages()
        self._drop_remote()
        self._remote = RemoteSession(RemoteClient(server), [{"role": r, "content": c} for r, c in messages], self._system_prompt)
        if self._session is not None:  # the local memory would go stale beside the remote transcript: freed
            self._session.reset()
        self._parked.clear()
        self._turn_starts = []
        self.remote_ready.emit(server)
        self.memory.emit(self._memory_report())

    # -- conversation ----------------------------------------------------------------------------------------------
    @Slot(str, object, object)
    def _on_send(self, text: str, settings: GenerationSettings, stop: threading.Event) -> None:
        remote = self._remote
        if remote is not None:
            self._stream(lambda: remote.chat(text, settings, stop.is_set))
            return
        session = self._require_session()
        if session is None:
            self._finish_unstarted()
            return
        self._stream(lambda: session.chat(text, settings, stop.is_set))

    @Slot(object, object)
    def _on_regenerate(self, settings: GenerationSettings, stop: threading.Event) -> None:
        remote = self._remote
        session = self._require_session() if remote is None else None
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
        if self._remote is not None:
            self._remote.reset()
            self._store_path = Path(store_path) if store_path else None
            self.memory.emit(self._memory_report())
            return
        if self._session is None:
            self._store_path = Path(store_path) if store_path else None
            return
        self._park()  # the GUI cleared its view itself: a late "empty" signal would erase what was typed since
        self._store_path = Path(store_path) if store_path else None
        self.memory.emit(self._memory_report())

    @Slot(str, str, int, object)
    def _on_branch(self, source: str, store_path: str, upto: int, stop: threading.Event) -> None:
        """A new conversation with the messages of `source` up to index `upto` (inclusive), its memory read anew."""
        if self._remote is not None:
            self._branch_remote(Path(source), Path(store_path), upto)
            return
        if self._require_session() is None:
            self._finish_unstarted()
            return
        try:
            data = load_session(Path(source))
        except (SparkError, OSError) as exc:
            self.error.emit(f"The conversation could not be branched ({exc}).")
            self._finish_unstarted()
            return
        self._park()
        session = self._session
        assert session is not None
        self._store_path = Path(store_path)
        session.messages = [ChatMessage(m.role, m.content, m.timestamp or time.time()) for m in data.messages[: upto + 1]]
        self._system_prompt = session.system_prompt = data.system_prompt or ""
        self.system_prompt.emit(session.system_prompt)
        self.conversation.emit(self._transcript())
        self._read_t0 = self._read_last = time.monotonic()
        try:
            session.read_transcript(stop.is_set)
        except Exception as exc:
            log.exception("reading a branch failed")
            self.error.emit(f"The branch's memory could not be read ({exc}); it is read on the next message instead.")
        self.memory.emit(self._memory_report())
        self._changed()
        self.finished.emit(TurnResult(FinishReason.STOP, TurnProgress(len(session.memory.tokens), 0, 0.0, 0.0), ""))

    def _branch_remote(self, source: Path, store_path: Path, upto: int) -> None:
        """A remote conversation has no memory to read: the branch is its transcript up to `upto`."""
        assert self._remote is not None
        try:
            data = load_session(source)
        except (SparkError, OSError) as exc:
            self.error.emit(f"The conversation could not be branched ({exc}).")
            self._finish_unstarted()
            return
        self._take_transcript(data, store_path, upto + 1)
        self._changed()
        self.finished.emit(TurnResult(FinishReason.STOP, TurnProgress(0, 0, 0.0, 0.0), ""))

    def _take_transcript(self, data: SessionData, store_path: Path | None, upto: int | None = None) -> None:
        assert self._remote is not None
        self._remote.messages = [{"role": m.role, "content": m.content} for m in data.messages[:upto]]
        self._system_prompt = self._remote.system_prompt = data.system_prompt or ""
        self._store_path = store_path
        self.system_prompt.emit(self._system_prompt)
        self.conversation.emit(self._transcript())
        self.memory.emit(self._memory_report())

    @Slot()
    def _on_release(self) -> None:
        """Drop the session (the quick prompt closed): its slot table is freed; the next prompt opens a new one."""
        self._session = None

    @Slot(str)
    def _on_system_prompt(self, text: str) -> None:
        self._system_prompt = text
        if self._remote is not None:
            self._remote.system_prompt = text
            self._changed()
        elif self._session is not None:
            self._session.system_prompt = text
            self._changed()

    # -- session files ---------------------------------------------------------------------------------------------
    @Slot(str, bool)
    def _on_save(self, path: str, full_memory: bool) -> None:
        if self._session is None and self._remote is None:
            self.error.emit("There is no conversation to save yet; load a model first.")
            return
        try:
            if self._remote is not None:  # the server's memory is not ours: the transcript is all there is
                self._remote.save(Path(path))
            else:
                assert self._session is not None
                self._session.save(Path(path), compact=not full_memory)
        except SparkError as exc:
            self.error.emit(str(exc))
            return
        except OSError as exc:
            self.error.emit(f"The session could not be saved to {path} ({exc.strerror or exc}).")
            return
        except Exception as exc:
            log.exception("save failed")
            self.error.emit(f"The session could not be saved ({type(exc).__name__}: {exc}).")
            return
        self.saved.emit(SessionFileEvent("saved", Path(path), time.time()))

    @Slot(str, bool, str)
    def _on_restore(self, path: str, transcript_only: bool, store_path: str) -> None:
        """Open `path`; from then on the conversation is stored at `store_path` (its own library file when it
        came from the library, a new one for a file opened from elsewhere)."""
        if self._remote is not None:
            self._restore_remote(Path(path), Path(store_path) if store_path else None)
            return
        if self._require_session() is None or self._engine is None:
            return
        target = Path(store_path) if store_path else None
        parked = self._parked.pop(Path(path), None) if not transcript_only and target == Path(path) else None
        if parked is not None:  # left a moment ago: its memory is still there, nothing to recompute
            self._park()
            self._session, self._turn_starts = parked
            self._store_path = target
            self._opened(Path(path), "")
            return
        # A compact file's memory takes a while to recompute: its words are shown at once (they are cheap to read).
        peek = self._peek(Path(path))
        kind = peek.memory_meta.get("kind") if peek is not None else None
        # A remote server's conversation holds no memory at all: taking its transcript loses nothing, so no question.
        transcript_only = transcript_only or kind == TRANSCRIPT_KIND
        preview = [MessageView(m.role, m.content) for m in peek.messages] if peek is not None and kind == RECOMPUTE_KIND else []
        if preview:
            self.conversation.emit(preview)
        # Read into a fresh session: on any error (or another model's file) the open conversation is untouched.
        session = self._engine.new_session()
        self._prepare(session)
        self._read_t0 = self._read_last = time.monotonic()
        try:
            report = session.load(Path(path), accept_transcript_only=transcript_only, on_progress=self._on_restore_progress)
        except Exception as exc:  # noqa: BLE001 - the worker must answer every request; the chat stays as it was
            if isinstance(exc, SparkError):
                self.error.emit(str(exc))
            elif isinstance(exc, OSError):
                self.error.emit(f"The session {Path(path).name} could not be read ({exc.strerror or exc}).")
            else:
                log.exception("restore failed")
                self.error.emit(f"The session {Path(path).name} could not be restored ({type(exc).__name__}: {exc}).")
            if preview:
                self.conversation.emit(self._transcript())  # back to the conversation that is still open
            return
        if not report.applied:  # another model's file: nothing changed until the user accepts transcript-only
            if preview:
                self.conversation.emit(self._transcript())
            self.foreign_session.emit(path, report.message)
            return
        self._park()
        self._session, self._turn_starts = session, []
        note = "transcript only: the memory is re-read on the next turn" if report.transcript_only else ""
        if session.restore_digest_ok is False:
            note = "its memory was recomputed and differs slightly from the saved one (other numerics)"
        joins = target is not None and target != Path(path)
        self._store_path = target
        self._opened(Path(path), note)
        if joins:
            self._changed()  # a file opened from elsewhere joins the library as a new conversation

    def _peek(self, path: Path) -> SessionData | None:
        """The file's transcript and kind (no memory is touched), or None for one that does not read."""
        try:
            return load_session(path)
        except Exception:  # noqa: BLE001 - the real load says what is wrong, in one sentence
            return None

    def _restore_remote(self, path: Path, target: Path | None) -> None:
        """With a remote model any conversation opens as its transcript (the server re-reads it with the next message)."""
        try:
            data = load_session(path)
        except SparkError as exc:
            self.error.emit(str(exc))
            return
        except OSError as exc:
            self.error.emit(f"The session {path.name} could not be read ({exc.strerror or exc}).")
            return
        joins = target is not None and target != path
        self._take_transcript(data, target)
        self.restored.emit(SessionFileEvent("restored", path, time.time(), ""))
        if joins:
            self._changed()

    def _opened(self, path: Path, note: str) -> None:
        session = self._session
        assert session is not None
        self._system_prompt = session.system_prompt
        self.system_prompt.emit(session.system_prompt)
        self.conversation.emit(self._transcript())
        self.memory.emit(self._memory_report())
        self.restored.emit(SessionFileEvent("restored", path, time.time(), note))

    def _park(self) -> None:
        """Leave the current conversation: keep its session (memory ready) among the parked ones and go on with a
        fresh one; an empty conversation is just reset."""
        if self._session is None or self._engine is None or self._remote is not None:
            return
        if not self._session.messages or self._store_path is None:
            self._session.reset()
            self._turn_starts = []
            return
        self._parked[self._store_path] = (self._session, self._turn_starts)
        self._parked.move_to_end(self._store_path)
        while len(self._parked) > PARKED_CONVERSATIONS:
            self._parked.popitem(last=False)  # its slot table is freed with it
        self._session = self._engine.new_session()
        self._prepare(self._session)
        self._turn_starts = []

    @Slot()
    def _on_shutdown(self) -> None:
        """Last request before the thread quits: store the conversation (the reply was already stopped)."""
        try:
            self._changed()
            self._drop_remote()
        finally:
            QThread.currentThread().quit()

    # -- internals -------------------------------------------------------------------------------------------------
    def _require_session(self) -> Session | None:
        if self._session is None and self._engine is not None:
            self._session = self._engine.new_session()
            self._prepare(self._session)
        if self._session is None:
            self.error.emit("No model is loaded yet; open a model folder first.")
        return self._session

    def _prepare(self, session: Session) -> None:
        session.system_prompt = self._system_prompt
        if self._store_enabled:
            session.on_prefill = self._on_prefill

    def _on_prefill(self, p: PrefillProgress) -> None:
        self._report_reading("prompt", p.done, p.total, p.done - p.reused, p.elapsed_s)

    def _on_restore_progress(self, done: int, total: int) -> None:
        self._report_reading("restore", done, total, done, time.monotonic() - self._read_t0)

    def _report_reading(self, kind: str, done: int, total: int, computed: int, elapsed: float) -> None:
        now = time.monotonic()
        if done < total and now - self._read_last < READ_INTERVAL_S:
            return
        self._read_last = now
        rate = computed / elapsed if elapsed > 0 else 0.0
        left = (total - done) / rate if rate > 0 else 0.0
        self.reading.emit(ReadProgress(kind, done, total, rate, left))

    def _changed(self) -> None:
        """Store the conversation now (compact, atomic) when it has any message; errors are shown, never raised."""
        session = self._remote or self._session
        if not self._store_enabled or session is None or self._store_path is None or not self._active_messages():
            return
        try:
            if isinstance(session, RemoteSession):
                session.save(self._store_path)  # transcript only: the memory is the server's
            else:
                session.save(self._store_path, compact=True)
        except Exception as exc:
            log.exception("storing the conversation failed")
            self.error.emit(f"The conversation could not be stored in the data folder ({exc}); it is still open, and will be stored on the next change.")
            return
        model = remote_name(self._remote.client.server) if self._remote is not None else self._engine.model_dir.name if self._engine is not None else ""
        messages = tuple(self._messages())
        self.stored.emit(StoredConversation(self._store_path, messages, model))

    def _finish_unstarted(self) -> None:
        """Every send/regenerate request ends with `finished`, so the GUI always leaves its busy state."""
        self.finished.emit(TurnResult("error", TurnProgress(0, 0, 0.0, 0.0), ""))

    def _messages(self) -> list[tuple[str, str]]:
        """The open conversation as (role, content), whichever backend holds it."""
        if self._remote is not None:
            return [(m["role"], m["content"]) for m in self._remote.messages]
        return [(m.role, m.content) for m in self._session.messages] if self._session is not None else []

    def _active_messages(self) -> int:
        return len(self._remote.messages) if self._remote is not None else len(self._session.messages) if self._session is not None else 0

    def _drop_remote(self) -> None:
        if self._remote is not None:
            self._remote.client.close()
            self._remote = None

    def _transcript(self) -> list[MessageView]:
        return [MessageView(r, c) for r, c in self._messages()]

    def _stream(self, start: Callable[[], Iterator[GenerationEvent]]) -> None:
        reason: FinishReason | Literal["error"] = "error"
        text: list[str] = []
        progress = TurnProgress(0, 0, 0.0, 0.0)
        last_progress = last_memory = self._read_t0 = time.monotonic()
        self._read_last = 0.0  # the first reading report goes out at once
        hits_before = self._episodic_hits()
        if self._session is not None and self._remote is None:
            self._turn_starts.append(len(self._session.memory.tokens))
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
        except Exception as exc:
            log.exception("generation failed")
            self.error.emit(f"Generation failed ({type(exc).__name__}: {exc}); the conversation is kept, try again.")
            self.conversation.emit(self._transcript())
        self.progress.emit(progress)
        self.memory.emit(self._memory_report())
        recalled = self._turns_ago() if self._episodic_hits() > hits_before else 0
        self._changed()  # stored before `finished`: a finished turn is never only in memory
        self.finished.emit(TurnResult(reason, progress, "".join(text), recalled))

    def _episodic_hits(self) -> int:
        stats = self._session.stats() if self._session is not None and self._remote is None else None
        return stats.episodic.hits if stats is not None else 0

    def _turns_ago(self) -> int:
        """How many turns back the newest turn lies that has left the exact window (so a recall reached at least
        that far); 1 when none has wholly left it yet."""
        stats = self._session.stats() if self._session is not None else None
        evicted = stats.working.evictions if stats is not None else 0
        starts = self._turn_starts
        for back in range(1, len(starts)):
            if starts[-back] <= evicted:  # turn -(back+1) ended where turn -back began: wholly evicted
                return back
        return 1

    def _memory_report(self) -> MemoryReport:
        if self._remote is not None:
            return MemoryReport((), 0, self._remote.client.server.url)
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

    _load = Signal(str, str, str, object)
    _attach = Signal(object)
    _use_remote = Signal(object)
    _send = Signal(str, object, object)
    _regenerate = Signal(object, object)
    _new_chat = Signal(str)
    _branch = Signal(str, str, int, object)
    _release = Signal()
    _set_system_prompt = Signal(str)
    _save = Signal(str, bool)
    _restore = Signal(str, bool, str)
    _shutdown = Signal()

    busy_changed = Signal(bool)  # a reply is being generated

    def __init__(
        self, name: str, policy: HardwarePolicy | None, cache_dir: Path, store: bool = False, parent: QObject | None = None
    ) -> None:
        super().__init__(parent)
        self._thread = QThread(self)
        self._thread.setObjectName(name)
        self.worker = ConversationWorker(policy, cache_dir, store)
        self.worker.moveToThread(self._thread)
        self._thread.finished.connect(self.worker.deleteLater)
        for request, slot in (
            (self._load, self.worker._on_load),
            (self._attach, self.worker._on_attach),
            (self._use_remote, self.worker._on_use_remote),
            (self._send, self.worker._on_send),
            (self._regenerate, self.worker._on_regenerate),
            (self._new_chat, self.worker._on_new_chat),
            (self._branch, self.worker._on_branch),
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
    def load(self, model_dir: Path | None, backend: str = "auto", quantize: str = "auto") -> None:
        self._cancel_load = threading.Event()
        self._load.emit(str(model_dir) if model_dir else "", backend, quantize, self._cancel_load)

    def cancel_load(self) -> None:
        if self._cancel_load is not None:
            self._cancel_load.set()

    def attach(self, engine: Engine) -> None:
        self._attach.emit(engine)

    def use_remote(self, server: RemoteServer) -> None:
        """Chat with a remote server from now on (until a local model is loaded); `remote_ready` says when."""
        self._use_remote.emit(server)

    def send(self, text: str, settings: GenerationSettings) -> None:
        self._send.emit(text, settings, self._begin())

    def regenerate(self, settings: GenerationSettings) -> None:
        self._regenerate.emit(settings, self._begin())

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def new_chat(self, store_path: Path | None = None) -> None:
        self._new_chat.emit(str(store_path) if store_path else "")

    def branch(self, source: Path, store_path: Path, upto: int) -> None:
        """Busy until the branch's memory is read (Stop ends the reading early)."""
        self._branch.emit(str(source), str(store_path), upto, self._begin())

    def release(self) -> None:
        self.stop()
        self._release.emit()

    def set_system_prompt(self, text: str) -> None:
        self._set_system_prompt.emit(text)

    def save(self, path: Path, full_memory: bool = False) -> None:
        self._save.emit(str(path), full_memory)

    def restore(self, path: Path, transcript_only: bool = False, store_path: Path | None = None) -> None:
        self._restore.emit(str(path), transcript_only, str(store_path) if store_path else "")

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
