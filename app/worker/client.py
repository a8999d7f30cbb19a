"""The GUI's handle on a `ConversationWorker`, both ways: it owns the worker's thread, turns method calls into
requests queued into that thread, and re-emits the worker's results as its own signals on the GUI thread. The
GUI connects to these, never to the worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.tools.mcp_host import McpServerSpec
from app.worker.types import (
    AttachKind,
    AttachProgress,
    LoadedModel,
    MemoryReport,
    ReadProgress,
    SessionFileEvent,
    StoredConversation,
    TurnProgress,
    TurnResult,
)
from app.worker.worker import ConversationWorker
from engine import DecodedImage, Engine, GenerationSettings, KeptMemory, RemoteServer
from engine.hw import HardwarePolicy, PolicyDecision


class ConversationClient(QObject):
    """GUI-side handle: owns the worker's thread, turns method calls into queued requests, re-emits results."""

    _load = Signal(str, str, str, object)
    _attach = Signal(object)
    _use_remote = Signal(object)
    _send = Signal(str, object, object, object)
    _regenerate = Signal(object, object)
    _new_chat = Signal(str)
    _branch = Signal(str, str, int, object)
    _release = Signal()
    _set_system_prompt = Signal(str)
    _save = Signal(str, bool)
    _restore = Signal(str, bool, str)
    _forget = Signal(str)
    _shutdown = Signal()
    _tool_servers = Signal(list)
    _attach_file = Signal(str, object, str, object)
    _detach = Signal(str)

    # Results, on the GUI thread (the worker's signals of the same names, see app.worker.worker).
    loading = Signal(str)
    loaded = Signal(LoadedModel)
    load_cancelled = Signal()
    delta = Signal(str)
    reasoning = Signal(str)
    progress = Signal(TurnProgress)
    memory = Signal(MemoryReport)
    finished = Signal(TurnResult)
    error = Signal(str)
    conversation_shown = Signal(list)
    saved = Signal(SessionFileEvent)
    restored = Signal(SessionFileEvent)
    foreign_session = Signal(str, str)
    system_prompt = Signal(str)
    policy = Signal(PolicyDecision)
    reading = Signal(ReadProgress)
    stored = Signal(StoredConversation)
    remote_ready = Signal(object)
    consent_needed = Signal(object)  # ConsentRequest: answer it (the worker waits, the GUI does not)
    tool_ran = Signal(object)  # ToolRun
    attaching = Signal(AttachProgress)
    attach_failed = Signal(str, str)  # path, why ("": cancelled)
    busy_changed = Signal(bool)  # a reply is being generated
    stopping = Signal()  # Stop was asked while a reply was being generated (it ends with `finished`)

    def __init__(
        self,
        name: str,
        policy: HardwarePolicy | None,
        cache_dir: Path,
        store: bool = False,
        parent: QObject | None = None,
        clock: Callable[[], float] = time.monotonic,
        kept: KeptMemory | None = None,
    ) -> None:
        super().__init__(parent)
        self._thread = QThread(self)
        self._thread.setObjectName(name)
        self.worker = ConversationWorker(policy, cache_dir, store, clock, kept)
        self.worker.moveToThread(self._thread)
        self._thread.finished.connect(self.worker.deleteLater)
        w = self.worker
        for request, slot in (
            (self._load, w.on_load),
            (self._attach, w.on_attach),
            (self._use_remote, w.on_use_remote),
            (self._send, w.on_send),
            (self._regenerate, w.on_regenerate),
            (self._new_chat, w.on_new_chat),
            (self._branch, w.on_branch),
            (self._release, w.on_release),
            (self._set_system_prompt, w.on_system_prompt),
            (self._save, w.on_save),
            (self._restore, w.on_restore),
            (self._forget, w.on_forget),
            (self._shutdown, w.on_shutdown),
            (self._tool_servers, w.on_tool_servers),
            (self._attach_file, w.on_attach_file),
            (self._detach, w.on_detach),
        ):
            request.connect(slot)  # auto connection: queued, since the worker lives in another thread
        for result, own in (
            (w.loading, self.loading),
            (w.loaded, self.loaded),
            (w.load_cancelled, self.load_cancelled),
            (w.delta, self.delta),
            (w.reasoning, self.reasoning),
            (w.progress, self.progress),
            (w.memory, self.memory),
            (w.error, self.error),
            (w.conversation_shown, self.conversation_shown),
            (w.saved, self.saved),
            (w.restored, self.restored),
            (w.foreign_session, self.foreign_session),
            (w.system_prompt, self.system_prompt),
            (w.policy, self.policy),
            (w.reading, self.reading),
            (w.stored, self.stored),
            (w.remote_ready, self.remote_ready),
            (w.consent_needed, self.consent_needed),
            (w.tool_ran, self.tool_ran),
            (w.attaching, self.attaching),
            (w.attach_failed, self.attach_failed),
            (w.attach_failed, self._on_attach_failed),
        ):
            result.connect(own)  # queued into the GUI thread: the client lives there
        w.finished.connect(self._on_finished)
        self._stop: threading.Event | None = None
        self._cancel_load: threading.Event | None = None
        self._cancel_reading: dict[str, threading.Event] = {}  # path -> its first reading's cancel
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

    def send(self, text: str, settings: GenerationSettings, images: Sequence[DecodedImage] = ()) -> None:
        """`images`: pictures that go with the message (a model that sees images places them before its text)."""
        self._send.emit(text, settings, tuple(images), self._begin())

    def regenerate(self, settings: GenerationSettings) -> None:
        self._regenerate.emit(settings, self._begin())

    def stop(self) -> None:
        if self._stop is not None and not self._stop.is_set():
            self._stop.set()
            self.stopping.emit()

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

    def set_tool_servers(self, specs: list[McpServerSpec]) -> None:
        """MCP servers whose tools the model may call (after the user's consent) from the next turn on."""
        self._tool_servers.emit(list(specs))

    def save(self, path: Path, full_memory: bool = False) -> None:
        self._save.emit(str(path), full_memory)

    def restore(self, path: Path, transcript_only: bool = False, store_path: Path | None = None) -> None:
        self._restore.emit(str(path), transcript_only, str(store_path) if store_path else "")

    def forget(self, store_path: Path) -> None:
        """The conversation stored at `store_path` was deleted: its memory is kept no more (RAM and disk)."""
        self._forget.emit(str(store_path))

    def attach_file(self, path: Path, kind: AttachKind = AttachKind.DOCUMENT, title: str = "") -> None:
        """`path` joins the open conversation's memory (`memory` lists it when done, `attach_failed` says why not);
        `cancel_attach(path)` stops its first reading."""
        cancel = self._cancel_reading[str(path)] = threading.Event()
        self._attach_file.emit(str(path), kind, title, cancel)

    def cancel_attach(self, path: Path) -> None:
        cancel = self._cancel_reading.pop(str(path), None)
        if cancel is not None:
            cancel.set()

    def detach(self, path: Path) -> None:
        self.cancel_attach(path)  # still being read: it stops; else a no-op
        self._detach.emit(str(path))

    def shutdown(self, timeout_ms: int = 30_000) -> bool:
        """Stop any reply, store the conversation, end the thread; False when it is still busy after `timeout_ms`."""
        self.begin_shutdown()
        return self.wait_shut_down(timeout_ms)

    def begin_shutdown(self) -> None:
        """Stop any reply (or loading) and ask the worker to store its conversation and end (its last request)."""
        self.stop()
        self.cancel_load()
        for cancel in self._cancel_reading.values():  # a document being read stops at its next chunk
            cancel.set()
        self._shutdown.emit()

    def wait_shut_down(self, timeout_ms: int) -> bool:
        """Block until the worker's thread ended (at most `timeout_ms`): the at-most-one-step stop + the store."""
        return self._thread.wait(timeout_ms)

    # -- internals -------------------------------------------------------------------------------------------------
    def _begin(self) -> threading.Event:
        # A fresh event per request: a Stop pressed before the worker picks the request up still applies to it.
        self._stop = threading.Event()
        self.busy_changed.emit(True)
        return self._stop

    @Slot(str, str)
    def _on_attach_failed(self, path: str, _why: str) -> None:
        self._cancel_reading.pop(path, None)

    @Slot(TurnResult)
    def _on_finished(self, result: TurnResult) -> None:
        self._stop = None
        self.busy_changed.emit(False)
        self.finished.emit(result)
