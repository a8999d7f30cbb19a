"""The engine side of the app: a `ConversationWorker` (QObject) living in its own QThread owns one conversation.

The GUI talks to it only through `app.worker.client.ConversationClient`, whose request signals are queued into the
worker's thread and which re-emits the worker's results on the GUI thread. Generation runs inside a worker slot, so
the GUI thread never waits on it; Stop sets a `threading.Event` that the generation loop polls between tokens and
between the layers of a prompt being read (no queue round-trip, so it takes effect even though the worker's event
loop is busy).

Two clients exist in the app: the main chat (which also loads models) and the quick prompt (which attaches to the
loaded engine and opens its own short-lived conversation). The engine's step lock interleaves their forwards.
Everything crossing a thread boundary is plain data (dataclasses, strings) or an engine object handed over whole.

The conversation is an `app.worker.conversation.Conversation`: local (a Session on the loaded engine) or remote (a
server chosen as the model); the worker never asks which. The main chat's worker stores its conversation after every
change (a compact `.spark`, atomically) in the file the GUI's conversation library assigned to it, and reports each
store, so nothing typed or generated is ever only in memory. Its memory is kept too: in RAM for the conversations
left recently (within the hardware policy's budget), and on disk (engine.session.kept) once the worker is idle after
a turn, when it is left, and at quit; opening a conversation reads that back and recomputes only when no kept copy
matches its record. The worker only takes a snapshot of the memory; the kept memory's own thread writes it, so a
switch or a send never waits for the disk, and quit waits for it at most KEEP_QUIT_WAIT_S. A deleted conversation's
memory is forgotten in RAM and on disk (Undo reopens it by recomputing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Literal

from PySide6.QtCore import QObject, QThread, QTimer, Signal, Slot

from app.tools.consent import ConsentGate, ConsentRequest, Decision, PendingCall
from app.tools.mcp_host import McpHost, McpServerSpec
from app.tools.toolbox import Toolbox, ToolRun
from app.worker import session_files, tool_turns
from app.worker.conversation import Conversation, LocalConversation, RemoteConversation, pictures_by_message
from app.worker.engine_factory import load_engine
from app.worker.types import (
    AttachKind,
    AttachProgress,
    LoadedModel,
    MemoryHeld,
    MemoryReport,
    MessageView,
    ModelInfo,
    ReadProgress,
    SessionFileEvent,
    Speculating,
    StoredConversation,
    TurnProgress,
    TurnResult,
)
from engine import (
    RECOMPUTE_KIND,
    TRANSCRIPT_KIND,
    DecodedImage,
    Engine,
    FinishReason,
    GenerationEvent,
    GenerationSettings,
    KeptMemory,
    PrefillProgress,
    RemoteServer,
    Session,
    SparkError,
    Speculation,
    display_name,
    load_session,
)
from engine.hw import HardwarePolicy, PolicyDecision
from engine.tools.calls import ChatEvent, ToolCalls

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.1  # turn stats (tokens/s) at most 10 times a second
MEMORY_INTERVAL_S = 0.25  # tier stats at most 4 times a second: the panels need no more
READ_INTERVAL_S = 0.1  # reading progress at most 10 times a second
# Conversations left recently keep their memory in RAM (switching back, Undo: nothing to read) within this share of
# what the hardware policy's budget leaves beside the weights (the rest is the open conversation's and the episodic
# tier's), or within PARKED_BYTES_UNBOUNDED without a policy. Beyond it the least recently used are dropped: their
# memory is kept on disk (engine.session.kept), so they read it back instead of recomputing.
PARKED_SHARE = 0.5
PARKED_BYTES_UNBOUNDED = 1024**3
KEEP_DELAY_MS = 1500  # after a turn, the memory is kept on disk once the worker has been idle this long
KEEP_QUIT_WAIT_S = 0.4  # quit waits until this long after it began for the kept copies, then abandons them
NO_PROGRESS = TurnProgress(0, 0, 0.0, 0.0)


class ConversationWorker(QObject):
    loading = Signal(str)  # model folder being loaded
    loaded = Signal(LoadedModel)
    load_cancelled = Signal()
    delta = Signal(str)  # one token's text (coalesced by the GUI)
    reasoning = Signal(str)  # the reply's thinking as it comes (engine.generation.reasoning), apart from `delta`
    progress = Signal(TurnProgress)
    memory = Signal(MemoryReport)
    finished = Signal(TurnResult)
    error = Signal(str)  # one user-facing sentence
    conversation_shown = Signal(list)  # list[MessageView]: the transcript after a restore, undo or failed turn
    saved = Signal(SessionFileEvent)
    restored = Signal(SessionFileEvent)
    foreign_session = Signal(str, str)  # path, why only the transcript can be restored
    system_prompt = Signal(str)  # the restored session's system prompt
    policy = Signal(PolicyDecision)
    reading = Signal(ReadProgress)
    stored = Signal(StoredConversation)
    remote_ready = Signal(object)  # RemoteServer: replies now stream from it
    consent_needed = Signal(object)  # ConsentRequest: the GUI asks the user and answers it
    tool_ran = Signal(object)  # ToolRun: a call the model made, and what came of it
    attaching = Signal(AttachProgress)  # a document read through the model the first time
    attach_failed = Signal(str, str)  # path, why in one sentence ("": the user cancelled the reading)

    def __init__(
        self,
        policy: HardwarePolicy | None,
        cache_dir: Path,
        store: bool = False,
        clock: Callable[[], float] = time.monotonic,
        kept: KeptMemory | None = None,
    ) -> None:
        super().__init__()
        self._clock = clock  # paces the progress reports; the tests pass a fake
        self._policy = policy
        self._cache_dir = cache_dir
        self._store_enabled = store  # the main chat stores every change; the quick prompt keeps nothing
        self._store_path: Path | None = None  # this conversation's file in the library
        self._engine: Engine | None = None
        self.conversation: Conversation | None = None  # read by tests on this thread's behalf, never by the GUI
        self._system_text = ""
        self._parked: OrderedDict[Path, Conversation] = OrderedDict()  # store path -> a conversation left recently
        self._kept = kept if store else None  # memories kept on disk for the stored conversations
        self._forgotten: set[Path] = set()  # deleted conversations: nothing of their memory is kept again
        # Keeping on disk waits until the worker has been idle KEEP_DELAY_MS: one timer, restarted by every request
        # that asks for a keep, so timers that fell due during a long turn do not run ahead of the switch queued
        # behind it. What is due: conversations left (path -> conversation) and, when flagged, the open one.
        self._keep_timer = QTimer(self)
        self._keep_timer.setSingleShot(True)
        self._keep_timer.setInterval(KEEP_DELAY_MS)
        self._keep_timer.timeout.connect(self._keep_due)
        self._left_due: dict[Path, Conversation] = {}
        self._current_due = False
        self._read_t0 = 0.0
        self._read_last = 0.0
        self._tool_servers: list[McpServerSpec] = []
        self._toolbox: Toolbox | None = None  # started on the first turn that has servers configured
        self._turn_stop: threading.Event | None = None  # the current turn's Stop (a consent question waits on it too)
        # Decisions arrive on whichever thread made them; a signal carries them to the GUI safely.
        self._unsubscribe = policy.subscribe(self.policy.emit) if policy is not None else None

    @property
    def session(self) -> Session | None:
        """The local conversation's Session (None while a remote server is the model): for tests and checks."""
        return self.conversation.session if isinstance(self.conversation, LocalConversation) else None

    # -- model ---------------------------------------------------------------------------------------------------
    @Slot(str, str, str, object)
    def on_load(self, model_dir: str, backend: str, quantize: str, cancel: threading.Event) -> None:
        self.loading.emit(model_dir)
        try:
            engine = load_engine(
                Path(model_dir) if model_dir else None, backend, self._cache_dir, self._policy, quantize
            )
            if cancel.is_set():  # loading cannot be interrupted midway; a cancelled load is simply dropped
                self.load_cancelled.emit()
                return
            conversation = LocalConversation(engine, self._on_prefill if self._store_enabled else None, self._kept)
        except SparkError as exc:
            self.error.emit(str(exc))
            return
        except Exception as exc:
            log.exception("model load failed")
            self.error.emit(f"The model in {model_dir or 'the app bundle'} could not be loaded ({exc}).")
            return
        had_conversation = bool(self._messages())
        self._close_all()  # their memory belongs to the previous model (or server)
        self._engine = engine
        conversation.system_prompt = self._system_text
        self.conversation = conversation
        b = engine.backend
        info = ModelInfo(
            display_name(engine.model_dir),
            engine.model_dir,
            b.name,
            engine.choice.explain(),
            b.weight_bytes,
            b.kv_bytes_per_token(),
            b.config.max_position_embeddings,
            engine.sampling_defaults,
            engine.vision is not None,
        )
        tokenizer = engine.tokenizer
        self.loaded.emit(LoadedModel(engine, info, lambda text: len(tokenizer.encode(text, add_bos=False))))
        self.memory.emit(self._report(conversation))
        if had_conversation and self._store_path is not None and self._store_path.is_file():
            self._carry_over(self._store_path)

    @Slot(object)
    def on_attach(self, engine: Engine) -> None:
        """Use an engine another worker loaded; the conversation opens lazily on the first prompt."""
        self._engine, self.conversation = engine, None

    @Slot(object)
    def on_use_remote(self, server: RemoteServer) -> None:
        """Chat with `server` from now on; the open conversation goes on there (its transcript is sent with the
        next message). Nothing is contacted until then, so this never waits on the network."""
        remote = RemoteConversation(server)
        images = self.conversation.images() if self.conversation is not None else []
        remote.take_transcript(self._messages(), self._system_text, lambda: False, images)  # pictures included
        self._close_all()  # a local memory would go stale beside the remote transcript: freed
        self.conversation = remote
        self.remote_ready.emit(server)
        self.memory.emit(self._report(remote))

    # -- conversation ----------------------------------------------------------------------------------------------
    @Slot(str, object, object, object)
    def on_send(
        self, text: str, settings: GenerationSettings, images: tuple[DecodedImage, ...], stop: threading.Event
    ) -> None:
        conversation = self._require()
        if conversation is None:
            self._finish_unstarted()
            return
        self._turn(conversation, lambda s: conversation.chat(text, s, stop.is_set, images), settings, stop)

    @Slot(object, object)
    def on_regenerate(self, settings: GenerationSettings, stop: threading.Event) -> None:
        conversation = self._require()
        if conversation is None:
            self._finish_unstarted()
            return
        if not any(role == "user" for role, _ in conversation.messages):
            self.error.emit("There is no prompt to answer again yet; send one first.")
            self._finish_unstarted()
            return
        self._turn(conversation, lambda s: conversation.regenerate(s, stop.is_set), settings, stop)

    def _turn(
        self,
        conversation: Conversation,
        first: Callable[[GenerationSettings], Iterator[ChatEvent]],
        settings: GenerationSettings,
        stop: threading.Event,
    ) -> None:
        """Stream a turn whose reply starts with `first(settings)` (Send or Regenerate): with the configured MCP
        servers' tools on a local model (calls run and the reply continues), else the reply alone."""
        if isinstance(conversation, LocalConversation):
            if self._tool_servers:
                self._stream(conversation, lambda: self._tool_turn(conversation, first, settings, stop), settings)
                return
            conversation.set_tools(None)  # the servers were removed: the model is no longer offered tools
        self._stream(conversation, lambda: first(settings), settings)

    @Slot(str)
    def on_new_chat(self, store_path: str) -> None:
        """Start an empty conversation stored at `store_path` (the previous one is already stored)."""
        left = self._park()  # the GUI cleared its view itself: a late "empty" signal would erase what was typed since
        self._store_path = Path(store_path) if store_path else None
        self.memory.emit(self._report(self.conversation) if self.conversation is not None else MemoryReport((), 0))
        self._keep_left(left)

    @Slot(str, str, int, object)
    def on_branch(self, source: str, store_path: str, upto: int, stop: threading.Event) -> None:
        """A new conversation with the messages of `source` up to index `upto` (inclusive), its memory read anew."""
        conversation = self._require()
        if conversation is None:
            self._finish_unstarted()
            return
        try:
            data = load_session(Path(source))
        except (SparkError, OSError) as exc:
            self.error.emit(f"The conversation could not be branched ({exc}).")
            self._finish_unstarted()
            return
        messages = [(m.role, m.content) for m in data.messages[: upto + 1]]
        pictures = pictures_by_message(messages, data.images)  # those of the messages the branch keeps
        self._park()
        branch = self.conversation = conversation.fresh()
        self._store_path = Path(store_path)
        self._system_text = data.system_prompt or ""
        self.system_prompt.emit(self._system_text)
        self.conversation_shown.emit(
            [MessageView(r, c, images=tuple(p.data for p in ps)) for (r, c), ps in zip(messages, pictures, strict=True)]
        )
        self._start_reading()
        try:
            branch.take_transcript(messages, self._system_text, stop.is_set, [p for ps in pictures for p in ps])
        except Exception as exc:
            log.exception("reading a branch failed")
            self.error.emit(f"The branch's memory could not be read ({exc}); it is read on the next message instead.")
        report = self._report(branch)
        self.memory.emit(report)
        self._store()
        self._keep_soon()
        self.finished.emit(TurnResult(FinishReason.STOP, TurnProgress(report.tokens, 0, 0.0, 0.0), ""))

    # -- attachments -------------------------------------------------------------------------------------------------
    @Slot(str, object, str, object)
    def on_attach_file(self, path: str, kind: AttachKind, title: str, cancel: threading.Event) -> None:
        """`path` (a document, or an earlier conversation's stored file) joins the open conversation's memory; the
        memory report that follows lists it. Reading reports progress and stops at the next chunk once `cancel`
        is set."""
        source = Path(path)
        conversation = self._require()
        if conversation is None:
            self.attach_failed.emit(path, "")
            return
        if kind == AttachKind.CONVERSATION and source == self._store_path:
            self.attach_failed.emit(path, "This is the conversation you are in; recall an earlier one.")
            return
        last = [0.0]

        def on_progress(done: int, total: int) -> None:
            if cancel.is_set():
                raise _ReadingCancelled
            now = self._clock()
            if done >= total or now - last[0] >= READ_INTERVAL_S:
                last[0] = now
                self.attaching.emit(AttachProgress(source, done, total))

        try:
            conversation.attach(source, kind, title, on_progress)
        except _ReadingCancelled:
            self.attach_failed.emit(path, "")
            return
        except SparkError as exc:
            self.attach_failed.emit(path, str(exc))
            return
        except Exception as exc:
            log.exception("attaching failed")
            self.attach_failed.emit(path, f"{source.name} could not be attached ({type(exc).__name__}: {exc}).")
            return
        self.memory.emit(self._report(conversation))

    @Slot(str)
    def on_detach(self, path: str) -> None:
        if self.conversation is not None:
            self.conversation.detach(Path(path))
            self.memory.emit(self._report(self.conversation))

    @Slot(list)
    def on_tool_servers(self, specs: list[McpServerSpec]) -> None:
        """Use these MCP servers as tools from the next turn on (started then; none: no tools)."""
        if specs == self._tool_servers:
            return
        self._close_toolbox()
        self._tool_servers = list(specs)

    def _tool_turn(
        self,
        conversation: LocalConversation,
        first: Callable[[GenerationSettings], Iterator[ChatEvent]],
        settings: GenerationSettings,
        stop: threading.Event,
    ) -> Iterator[GenerationEvent]:
        """The turn as a thin loop over the session's tool calling (app.worker.tool_turns): the session offers the
        toolbox's tools under their grammar and reads the calls back; here the user is asked, the toolbox runs
        them and the results go back."""
        if self._toolbox is None:
            self._toolbox = Toolbox(McpHost(), ConsentGate(self._ask_consent))
            for problem in self._toolbox.start_servers(self._tool_servers):
                self.error.emit(problem)
        spec = tool_turns.tool_spec(self._toolbox.openai_tools())
        conversation.set_tools(spec)
        self._turn_stop = stop
        return tool_turns.with_tools(
            first(settings),
            lambda results: conversation.follow(results, settings, stop.is_set),
            self._toolbox,
            self._on_tool_ran,
            stop.is_set,
        )

    def _on_tool_ran(self, run: ToolRun) -> None:
        # In the reply's stream, after the call it answers: the chat shows the call and its result as one card.
        self.delta.emit(tool_turns.response_block(tool_turns.result_content(run)))
        self.tool_ran.emit(run)

    def _ask_consent(self, call: PendingCall) -> Decision:
        """On this thread: ask the GUI and wait for the answer (Stop, or the app quitting, answers Deny)."""
        request = ConsentRequest(call)
        self.consent_needed.emit(request)
        stop = self._turn_stop
        while not request.answered.wait(0.05):
            if stop is None or stop.is_set():
                return Decision.DENY
        return request.decision

    def _close_toolbox(self) -> None:
        if self._toolbox is not None:
            self._toolbox.close()
            self._toolbox = None

    @Slot()
    def on_release(self) -> None:
        """Drop the conversation (the quick prompt closed): its slot table is freed; the next prompt opens one."""
        self.conversation = None

    @Slot(str)
    def on_system_prompt(self, text: str) -> None:
        self._system_text = text
        if self.conversation is not None:
            self.conversation.system_prompt = text
            self._store()

    # -- session files -----------------------------------------------------------------------------------------------
    @Slot(str, bool)
    def on_save(self, path: str, full_memory: bool) -> None:
        conversation = self._require()  # says why when there is no model
        if conversation is None:
            return
        try:
            conversation.save(Path(path), full_memory)
        except Exception as exc:
            self.error.emit(session_files.save_error(Path(path), exc))
            return
        self.saved.emit(SessionFileEvent("saved", Path(path), time.time()))

    @Slot(str, bool, str)
    def on_restore(self, path: str, transcript_only: bool, store_path: str) -> None:
        """Open `path`; from then on the conversation is stored at `store_path` (its own library file when it
        came from the library, a new one for a file opened from elsewhere)."""
        source = Path(path)
        target = Path(store_path) if store_path else None
        if target is not None:
            self._forgotten.discard(target)  # Undo of a delete: kept again from now on
        parked = self._parked.pop(source, None) if not transcript_only and target == source else None
        if parked is not None:  # left a moment ago: its memory is still there, nothing to recompute
            left = self._park()
            if isinstance(parked, LocalConversation):
                parked.held = MemoryHeld.RAM
            self.conversation, self._store_path = parked, target
            self._opened(source, "")
            self._keep_left(left)
            return
        current = self._require()
        if current is None:
            return
        # A compact file's memory takes a while to recompute: its words are shown at once (they are cheap to read).
        peek = session_files.peek(source)
        kind = peek.memory_meta.get("kind") if peek is not None else None
        # A remote server's conversation holds no memory at all: taking its transcript loses nothing, so no question.
        transcript_only = transcript_only or kind == TRANSCRIPT_KIND
        preview = [MessageView(m.role, m.content) for m in peek.messages] if peek and kind == RECOMPUTE_KIND else []
        if preview:
            self.conversation_shown.emit(preview)
        # Read into a fresh conversation: on any error (or another model's file) the open one is untouched.
        fresh = current.fresh()
        self._start_reading()
        try:
            opened = fresh.open(source, transcript_only, self._restore_progress)
        except Exception as exc:  # the worker must answer every request; the chat stays as it was
            self.error.emit(session_files.read_error(source, exc))
            if preview:
                self.conversation_shown.emit(self._transcript())  # back to the conversation that is still open
            return
        if not opened.applied:  # another model's file: nothing changed until the user accepts transcript-only
            if preview:
                self.conversation_shown.emit(self._transcript())
            self.foreign_session.emit(path, opened.message)
            return
        left = self._park()
        self.conversation, self._store_path = fresh, target
        self._opened(source, opened.note)
        if target is not None and target != source:
            self._store()  # a file opened from elsewhere joins the library as a new conversation
        self._keep_left(left)
        self._keep_soon()  # a recomputed memory is kept, so the next relaunch reads it

    def _carry_over(self, path: Path) -> None:
        """Another model (or precision) was loaded: the open conversation continues on it. Its stored file comes
        back exactly where the model and numerics match, else as a transcript that the next turn re-reads."""
        assert self.conversation is not None
        self._start_reading()
        try:
            opened = self.conversation.open(path, True, self._restore_progress)
        except Exception as exc:  # the file stays; the user can reopen it from the history
            log.exception("carrying the conversation over failed")
            self.error.emit(
                f"The conversation could not be carried over to the new model ({exc}); it is kept in the history."
            )
            self.conversation_shown.emit([])
            return
        note = "the new model re-reads it on the next message" if opened.note.startswith("transcript only") else ""
        self._opened(path, note)

    def _opened(self, path: Path, note: str) -> None:
        conversation = self.conversation
        assert conversation is not None
        self._system_text = conversation.system_prompt
        self.system_prompt.emit(self._system_text)
        self.conversation_shown.emit(self._transcript())
        self.memory.emit(self._report(conversation))
        self.restored.emit(SessionFileEvent("restored", path, time.time(), note))

    @Slot(str)
    def on_forget(self, path: str) -> None:
        """The conversation stored at `path` was deleted: its memory leaves RAM and the disk (a write of it queued or
        in flight included)."""
        store_path = Path(path)
        self._forgotten.add(store_path)
        self._parked.pop(store_path, None)
        self._left_due.pop(store_path, None)
        if self._kept is not None:
            self._kept.discard(store_path)

    @Slot()
    def on_shutdown(self) -> None:
        """Last request before the thread quits: store the conversation (the reply was already stopped)."""
        began = time.monotonic()
        try:
            self._store(verify=False)  # in a hurry: the app is quitting
            self._keep_current()  # usually already kept after the last turn; else now, for the relaunch
            for path, parked in list(self._parked.items()):
                self._keep(path, parked)  # a no-op for those kept when they were left
            if self._kept is not None:
                # Until KEEP_QUIT_WAIT_S after quit began; a write not done by then is abandoned, its temp file removed.
                self._kept.close(max(0.0, KEEP_QUIT_WAIT_S - (time.monotonic() - began)))
            self._close_all()
            self._close_toolbox()
        finally:
            if self._unsubscribe is not None:  # the policy outlives this worker: no decision may reach it after
                self._unsubscribe()
                self._unsubscribe = None
            QThread.currentThread().quit()

    # -- internals -------------------------------------------------------------------------------------------------
    def _require(self) -> Conversation | None:
        if self.conversation is None and self._engine is not None:
            self.conversation = LocalConversation(
                self._engine, self._on_prefill if self._store_enabled else None, self._kept
            )
            self.conversation.system_prompt = self._system_text
        if self.conversation is None:
            self.error.emit("No model is loaded yet; open a model folder first.")
        return self.conversation

    def _park(self) -> tuple[Path, Conversation] | None:
        """Leave the current conversation: keep it (memory ready) among the parked ones and go on with a fresh
        one; an empty conversation is just reset. Returns the one left (for `_keep_left`)."""
        current = self.conversation
        if current is None:
            return None
        if not current.messages or self._store_path is None:
            current.reset()
            return None
        self._parked[self._store_path] = current
        self._parked.move_to_end(self._store_path)
        left = (self._store_path, current)
        # A local conversation opens on first use (`_require`): a new slot table is not allocated for a switch.
        self.conversation = None if isinstance(current, LocalConversation) else current.fresh()
        self._trim_parked()
        return left

    def _parked_budget(self) -> int:
        """Bytes the parked conversations may hold in RAM (see PARKED_SHARE)."""
        if self._policy is None or self._engine is None:
            return PARKED_BYTES_UNBOUNDED
        spare = self._policy.budget_bytes() - self._engine.backend.weight_bytes
        current = self.conversation.resident_bytes() if self.conversation is not None else 0
        return max(0, int(spare * PARKED_SHARE) - current)

    def _trim_parked(self) -> None:
        """Drop the least recently left conversations until the rest fit the budget (their slot tables are freed
        with them), keeping each on disk first unless its kept copy is current."""
        budget = self._parked_budget()
        held = {path: c.resident_bytes() for path, c in self._parked.items()}
        while self._parked and sum(held.values()) > budget:
            path, conversation = self._parked.popitem(last=False)
            held.pop(path)
            if self._kept is not None:
                self._keep(path, conversation)

    def _keep_left(self, left: tuple[Path, Conversation] | None) -> None:
        """Keep the memory of the conversation just left on disk (a no-op when its kept copy is current), once the
        worker has been idle a moment: a request queued now (switching straight back) does not wait for the write."""
        if left is not None and self._kept is not None:
            path, conversation = left
            self._left_due[path] = conversation
            self._keep_timer.start()  # (re)started: the keep waits for a quiet moment after this request

    def _keep_soon(self) -> None:
        """Keep the open conversation's memory on disk once the worker has been idle a moment (after a turn)."""
        if self._kept is not None:
            self._current_due = True
            self._keep_timer.start()

    def _keep_due(self) -> None:
        """The worker has been idle KEEP_DELAY_MS since the last request that asked for a keep: keep what is due."""
        due, self._left_due = self._left_due, {}
        for path, conversation in due.items():
            self._keep(path, conversation)  # a no-op where its copy is current
        if self._current_due:
            self._current_due = False
            self._keep_current()

    def _keep_current(self) -> None:
        conversation, path = self.conversation, self._store_path
        if self._kept is not None and conversation is not None and path is not None and conversation.messages:
            self._keep(path, conversation)
            self.memory.emit(self._report(conversation))

    def _keep(self, path: Path, conversation: Conversation) -> None:
        if path in self._forgotten:
            return
        try:
            conversation.keep(path)
        except Exception:  # an accelerator only: the compact record is stored, a failed copy costs a recompute
            log.exception("keeping the memory on disk failed")

    def _report(self, conversation: Conversation) -> MemoryReport:
        """The conversation's memory figures, with the size of its copy kept on disk."""
        return replace(conversation.memory_report(), kept_bytes=conversation.kept_bytes(self._store_path))

    def _close_all(self) -> None:
        """The model changes: every conversation of the previous one goes (a server's connections are closed)."""
        for conversation in [self.conversation, *self._parked.values()]:
            if isinstance(conversation, RemoteConversation):
                conversation.close()
        self._parked.clear()
        self.conversation = None

    def _start_reading(self) -> None:
        """A file starts being read: its progress is timed from now, and reported at most every READ_INTERVAL_S."""
        self._read_t0 = self._read_last = self._clock()

    def _on_prefill(self, p: PrefillProgress) -> None:
        self._report_reading("prompt", p.done, p.total, p.done - p.reused, p.elapsed_s)

    def _restore_progress(self, done: int, total: int) -> None:
        self._report_reading("restore", done, total, done, self._clock() - self._read_t0)

    def _report_reading(self, kind: str, done: int, total: int, computed: int, elapsed: float) -> None:
        now = self._clock()
        if done < total and now - self._read_last < READ_INTERVAL_S:
            return
        self._read_last = now
        rate = computed / elapsed if elapsed > 0 else 0.0
        left = (total - done) / rate if rate > 0 else 0.0
        self.reading.emit(ReadProgress(kind, done, total, rate, left))

    def _store(self, cut_off: bool = False, verify: bool = True) -> None:
        """Store the conversation now (compact, atomic) when it has any message; errors are shown, never raised.
        `cut_off`: its last reply was stopped before it ended; `verify`: with the memory's hash (a while)."""
        conversation = self.conversation
        if not self._store_enabled or conversation is None or self._store_path is None or not conversation.messages:
            return
        try:
            # A reply cut off (Stop, Quit) is stored at once: no hash of the memory to check a restore by.
            conversation.save(self._store_path, full_memory=False, verify=verify and not cut_off)
        except Exception as exc:
            log.exception("storing the conversation failed")
            self.error.emit(
                f"The conversation could not be stored in the data folder ({exc}); it is still open, and will be stored on the next change."
            )
            return
        self.stored.emit(
            StoredConversation(self._store_path, tuple(conversation.messages), conversation.model_name, cut_off)
        )

    def _finish_unstarted(self) -> None:
        """Every send/regenerate request ends with `finished`, so the GUI always leaves its busy state."""
        self.finished.emit(TurnResult("error", NO_PROGRESS, ""))

    def _messages(self) -> list[tuple[str, str]]:
        return self.conversation.messages if self.conversation is not None else []

    def _transcript(self) -> list[MessageView]:
        cited = self.conversation.cited() if self.conversation is not None else {}
        pictures = self.conversation.pictures() if self.conversation is not None else []
        return [
            MessageView(r, c, cited.get(i, ()), pictures[i] if i < len(pictures) else ())
            for i, (r, c) in enumerate(self._messages())
        ]

    def _stream(
        self, conversation: Conversation, start: Callable[[], Iterator[ChatEvent]], settings: GenerationSettings
    ) -> None:
        # A remote server decodes as it is set up to: the app's setting asks nothing of it.
        asked = settings.speculative != Speculation.OFF and not isinstance(conversation, RemoteConversation)
        reason: FinishReason | Literal["error"] = "error"
        text: list[str] = []
        progress = NO_PROGRESS
        last_progress = last_memory = self._read_t0 = self._clock()
        self._read_last = 0.0  # the first reading report goes out at once
        hits_before = conversation.recall_hits()
        conversation.begin_turn()
        observed = False
        try:
            for ev in start():
                if isinstance(ev, ToolCalls):  # a turn's calls are tool_turns' to run; here only what streams
                    continue
                if not observed:  # the prompt has routed the reply: what it draws on from the attachments
                    observed = True
                    conversation.observe_recalled()
                if ev.reasoning:
                    self.reasoning.emit(ev.reasoning)
                if ev.text:
                    text.append(ev.text)
                    self.delta.emit(ev.text)
                per_forward = (ev.generated_tokens - 1) / ev.forwards if ev.speculating and ev.forwards else 0.0
                speculating = Speculating.ON if ev.speculating else Speculating.UNUSED if asked else Speculating.OFF
                progress = TurnProgress(
                    ev.prompt_tokens, ev.generated_tokens, ev.ttft_s, ev.tokens_per_s, per_forward, speculating
                )
                now = self._clock()
                if now - last_progress >= PROGRESS_INTERVAL_S:
                    last_progress = now
                    self.progress.emit(progress)
                if now - last_memory >= MEMORY_INTERVAL_S:
                    last_memory = now
                    self.memory.emit(self._report(conversation))
                if ev.finish_reason:
                    reason = ev.finish_reason
        except SparkError as exc:
            self.error.emit(str(exc))
            self.conversation_shown.emit(self._transcript())
        except Exception as exc:
            log.exception("generation failed")
            self.error.emit(f"Generation failed ({type(exc).__name__}: {exc}); the conversation is kept, try again.")
            self.conversation_shown.emit(self._transcript())
        self.progress.emit(progress)
        report = self._report(conversation)
        self.memory.emit(report)
        recalled = conversation.recalled_turns_ago(hits_before)
        conversation.end_turn()
        self._store(cut_off=reason == FinishReason.CANCELLED)  # stored before `finished`: never only in memory
        self._keep_soon()
        self.finished.emit(
            TurnResult(
                reason,
                progress,
                "".join(text),
                recalled,
                report.tokens,
                len(conversation.messages),
                conversation.recalled(),
            )
        )


class _ReadingCancelled(Exception):
    """The user cancelled a document's first reading (raised from its progress callback, between chunks)."""
