"""One open conversation, wherever its model runs: the protocol the worker speaks, with a local implementation (a
`Session` on the loaded Engine, its memory ours) and a remote one (a transcript streamed through an OpenAI-compatible
server, its memory the server's).

The worker holds one `Conversation` and never asks which kind it is; what differs (memory figures, what a saved file
holds, whether a branch re-reads its memory) differs inside these classes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from app.worker.types import AttachKind, AttachmentView, CitationView, MemoryHeld, MemoryReport, remote_name
from engine import (
    IMAGE_TOKEN,
    Attached,
    Attachments,
    ChatMessage,
    Citation,
    DecodedImage,
    DocumentError,
    Engine,
    GenerationEvent,
    GenerationSettings,
    KeptMemory,
    PrefillProgress,
    Reattacher,
    RecalledRecord,
    RemoteClient,
    RemoteServer,
    RemoteSession,
    SparkError,
    TierStats,
    display_name,
    load_session,
)
from engine.tools.calls import ChatEvent, ToolSpec

StopCheck = Callable[[], bool]


@dataclass(frozen=True)
class Opened:
    """What opening a file into a conversation did."""

    applied: bool  # False: another model's file, nothing changed (the caller may retry as transcript only)
    note: str  # "" or a remark for the user ("transcript only: ...")
    message: str = ""  # why it was not applied


class Conversation(Protocol):
    """The requests a worker makes of its conversation; each runs on the worker's thread."""

    @property
    def messages(self) -> list[tuple[str, str]]:
        """The transcript as (role, content)."""
        ...

    @property
    def system_prompt(self) -> str: ...

    @system_prompt.setter
    def system_prompt(self, text: str) -> None: ...

    @property
    def model_name(self) -> str:
        """How the history names the model that wrote it."""
        ...

    def chat(
        self, text: str, settings: GenerationSettings, stop: StopCheck, images: Sequence[DecodedImage] = ()
    ) -> Iterator[ChatEvent]:
        """The reply's events; a local conversation offered tools (`set_tools`) ends a reply that calls them in a
        ToolCalls event."""
        ...

    def pictures(self) -> list[tuple[bytes, ...]]:
        """Each message's pictures (encoded), index for index with `messages`."""
        ...

    def images(self) -> list[DecodedImage]:
        """The transcript's pictures in the order of its markers (what another conversation takes it over with)."""
        ...

    def regenerate(self, settings: GenerationSettings, stop: StopCheck) -> Iterator[ChatEvent]: ...

    def take_transcript(
        self,
        messages: list[tuple[str, str]],
        system_prompt: str,
        stop: StopCheck,
        images: Sequence[DecodedImage] = (),
    ) -> None:
        """Become these messages (a branch); a local memory reads them (Stop ends that early). `images`: the
        transcript's pictures in the order of its markers."""
        ...

    def open(self, path: Path, transcript_only: bool, on_progress: Callable[[int, int], None]) -> Opened:
        """Read a `.spark` file into this (fresh) conversation; raises SparkError/OSError, leaving it unchanged."""
        ...

    def save(self, path: Path, full_memory: bool, verify: bool = True) -> None:
        """Write the conversation; `verify`: with what a restore needs to check the memory comes back exact (a
        while on a large memory: a save in a hurry goes without)."""
        ...

    def reset(self) -> None: ...

    def keep(self, path: Path) -> bool:
        """Keep the memory on disk for the conversation stored at `path`, unless that copy is already current;
        False when no copy is kept (nothing to keep, over the budget, a remote memory)."""
        ...

    def resident_bytes(self) -> int:
        """Bytes this conversation's memory holds in RAM (its slot table and episodic blocks)."""
        ...

    def kept_bytes(self, path: Path | None) -> int:
        """The size of the current copy of this memory kept on disk for `path` (0: none)."""
        ...

    def computed_tokens(self) -> int:
        """Tokens the model has computed for this conversation so far (replays included)."""
        ...

    def fresh(self) -> Conversation:
        """An empty conversation on the same model."""
        ...

    def memory_report(self) -> MemoryReport: ...

    def begin_turn(self) -> None:
        """A turn starts: remembered, to say later how far back a recall reached."""
        ...

    def recalled_turns_ago(self, hits_before: int) -> int:
        """> 0 when the turn just ended used recalled memory: at least how many turns back it reached."""
        ...

    def recall_hits(self) -> int:
        """Blocks the episodic tier has paged back so far (0 without one)."""
        ...

    def attach(
        self, path: Path, kind: AttachKind, title: str, on_progress: Callable[[int, int], None]
    ) -> AttachmentView:
        """`path` (a document, or an earlier conversation's .spark) joins this conversation's memory, read through
        the model the first time, named `title` in citations ("": its file name); raises SparkError (one
        sentence), the memory left as it was."""
        ...

    def detach(self, path: Path) -> None:
        """The attachment read from `path` leaves the memory (nothing when there is none)."""
        ...

    def attachments(self) -> tuple[AttachmentView, ...]: ...

    def observe_recalled(self) -> None:
        """The reply's first token came: what it draws on from the attachments is noted (see `recalled`)."""
        ...

    def recalled(self) -> tuple[CitationView, ...]:
        """What the last reply drew on from the attachments."""
        ...

    def end_turn(self) -> None:
        """The turn ended: what its reply drew on is kept with that reply (saved with the conversation)."""
        ...

    def cited(self) -> dict[int, tuple[CitationView, ...]]:
        """Message index -> the passages that reply drew on (kept with the conversation: shown after a reopen)."""
        ...


class LocalConversation:
    """A `Session` on the loaded engine: its memory is ours to report, save and restore."""

    def __init__(
        self,
        engine: Engine,
        on_prefill: Callable[[PrefillProgress], None] | None,
        kept: KeptMemory | None = None,
    ) -> None:
        self._engine = engine
        self._on_prefill = on_prefill
        self._kept = kept  # memories kept on disk: opening reads one back instead of recomputing it
        self._kept_as: tuple[Path, int, int | None, int] | None = None  # what the kept copy holds (keep's check)
        self.held = MemoryHeld.NEW
        self.session = engine.new_session()
        self.session.on_prefill = on_prefill
        self._turn_starts: list[int] = []  # memory length when each turn began
        self._attachments: Attachments | None = None  # made on the first attach (it needs the cascade)
        self._attached: list[tuple[AttachmentView, Attached]] = []
        self._recalled: tuple[CitationView, ...] = ()
        self.set_tools(None)

    @property
    def messages(self) -> list[tuple[str, str]]:
        return [(m.role, m.content) for m in self.session.messages]

    @property
    def system_prompt(self) -> str:
        return self.session.system_prompt

    @system_prompt.setter
    def system_prompt(self, text: str) -> None:
        self.session.system_prompt = text

    def set_tools(self, spec: ToolSpec | None) -> None:
        """Offer these tools to the model from the next turn on (None: none; earlier calls still render)."""
        self._tools = self.session.tools = spec

    def follow(self, results: list[str], settings: GenerationSettings, stop: StopCheck) -> Iterator[ChatEvent]:
        """Continue the turn after tool calls: their results (`tool` messages' contents, in the calls' order)."""
        return self.session.tool_results(results, settings, stop)

    @property
    def model_name(self) -> str:
        return display_name(self._engine.model_dir)

    def chat(
        self, text: str, settings: GenerationSettings, stop: StopCheck, images: Sequence[DecodedImage] = ()
    ) -> Iterator[ChatEvent]:
        return self.session.chat(text, settings, stop, tools=self._tools, images=images)

    def pictures(self) -> list[tuple[bytes, ...]]:
        return [tuple(p.data for p in ps) for ps in pictures_by_message(self.messages, self.session.images)]

    def images(self) -> list[DecodedImage]:
        return list(self.session.images)

    def regenerate(self, settings: GenerationSettings, stop: StopCheck) -> Iterator[ChatEvent]:
        """Answer the last user message again: the whole last turn goes, its tool calls and results included."""
        return self.session.regenerate(settings, stop, tools=self._tools)

    def take_transcript(
        self,
        messages: list[tuple[str, str]],
        system_prompt: str,
        stop: StopCheck,
        images: Sequence[DecodedImage] = (),
    ) -> None:
        now = time.time()
        self.session.messages = [ChatMessage(role, content, now) for role, content in messages]
        self.session.system_prompt = system_prompt
        self.session.images = list(images)
        self.session.read_transcript(stop)

    def open(self, path: Path, transcript_only: bool, on_progress: Callable[[int, int], None]) -> Opened:
        found = Reattacher()  # the file's attachments, found again in the cache by digest (it names no path)
        try:
            report = self.session.load(
                path, accept_transcript_only=transcript_only, on_progress=on_progress, kept=self._kept, reattach=found
            )
        except DocumentError:  # an attachment's capsule is gone from the cache: the conversation still opens
            return self._open_without_memory(path)
        if not report.applied:
            return Opened(False, "", report.message)
        self._restored(found.found)
        source = self.session.memory_source
        self.held = {"kept": MemoryHeld.DISK, "recomputed": MemoryHeld.RECOMPUTED}.get(source, MemoryHeld.FILE)
        if source == "kept":
            self._kept_as = (path, *self._signature())  # the copy on disk is this memory: nothing to write
        note = "transcript only: the memory is re-read on the next turn" if report.transcript_only else ""
        if self.session.restore_digest_ok is False:
            note = "its memory was recomputed and differs slightly from the saved one (other numerics)"
        return Opened(True, note)

    def _open_without_memory(self, path: Path) -> Opened:
        """A file whose memory needs an attachment no longer in the cache: its transcript comes back (re-read on the
        next turn), with the attachments still there attached again; the note names the ones to attach again."""
        data = load_session(path)
        session = self.session
        session.reset()
        session.attachments.clear()
        session.messages = [
            ChatMessage(m.role, m.content, m.timestamp or time.time(), m.reasoning) for m in data.messages
        ]
        session.system_prompt = data.system_prompt or ""
        session.recalled = list(data.recalled)
        found, missing = Reattacher(), []
        for record in data.attachments:
            try:
                found(session.memory, record, False)
            except (DocumentError, SparkError):
                missing.append(record.name)
                continue
            session.attachments.append(replace(record, at=0))
        self._restored(found.found)
        self.held = MemoryHeld.RECOMPUTED
        names, one = ", ".join(missing) or "an attachment", len(missing) <= 1
        return Opened(
            True,
            f"{names} {'is' if one else 'are'} no longer in the memory cache: attach {'it' if one else 'them'} again for the model to draw on {'it' if one else 'them'}; the conversation is re-read with the next message",
        )

    def _restored(self, found: list[Attached]) -> None:
        """What a load attached again joins this conversation's attachments, each under its recorded name (a
        session file names no path: the chip's key is the name)."""
        self._attached = []
        self._recalled = ()
        if not found:
            self._attachments = None
            return
        attachments = self._attachments_for_memory()
        attachments.restored(found)
        for record, item in zip(self.session.attachments, found, strict=True):
            kind = AttachKind(record.kind)
            cap = item.capsule
            key, n = Path(record.name), 1
            while any(view.path == key for view, _item in self._attached):
                n += 1
                key = Path(f"{record.name} ({n})")  # two attachments of one name keep two chips
            self._attached.append((AttachmentView(key, cap.name, kind, cap.tokens, cap.disk_bytes, 0), item))

    def _attachments_for_memory(self) -> Attachments:
        """This conversation's attachments on its current memory, recording into its session's records."""
        if self._attachments is None or self._attachments.memory is not self.session.memory:
            self._attachments = Attachments(self.session.memory, self.session.tokenizer, self.session.attachments)
        return self._attachments

    def save(self, path: Path, full_memory: bool, verify: bool = True) -> None:
        self.session.save(path, compact=not full_memory, digest=verify)

    def reset(self) -> None:
        for view, _item in list(self._attached):  # a new chat starts with nothing attached
            self.detach(view.path)
        self.session.reset()
        self._turn_starts = []
        self._recalled = ()
        self.held = MemoryHeld.NEW

    def attach(
        self, path: Path, kind: AttachKind, title: str, on_progress: Callable[[int, int], None]
    ) -> AttachmentView:
        if any(view.path == path for view, _item in self._attached):
            raise SparkError(f"{title or path.name} is already attached to this conversation.")
        attachments = self._attachments_for_memory()
        reader = attachments.attach_file if kind == AttachKind.DOCUMENT else attachments.recall_session
        item = reader(path, on_progress, once=True)  # once: a restored conversation may hold it already
        cap = item.capsule
        view = AttachmentView(path, cap.name, kind, cap.tokens, cap.disk_bytes, cap.read_tokens, title)
        held = [i for i, (_view, it) in enumerate(self._attached) if it is item]
        if held and self._attached[held[0]][0].path.is_absolute():  # the same text from another file: nothing changed
            raise SparkError(f"{title or path.name} is already attached to this conversation (as {cap.name}).")
        if held:  # restored under its recorded name: from now on under the file the user chose
            self._attached[held[0]] = (view, item)
        else:
            self._attached.append((view, item))
        return view

    def detach(self, path: Path) -> None:
        for i, (view, item) in enumerate(self._attached):
            if view.path == path:
                assert self._attachments is not None  # something is attached
                if self._attachments.detach(item):
                    self.session.drop_recipe()  # a removal mid-conversation: files keep the full memory
                del self._attached[i]
                # The ones attached after it joined again under new ids (Attachments.detach): follow them.
                items = {id(a.capsule): a for a in self._attachments.items}
                self._attached = [(v, items.get(id(it.capsule), it)) for v, it in self._attached]
                self._recalled = tuple(c for c in self._recalled if c.source != view.shown)
                return

    def attachments(self) -> tuple[AttachmentView, ...]:
        return tuple(view for view, _item in self._attached)

    def observe_recalled(self) -> None:
        if self._attachments is not None and self._attached:
            titles = {view.name: view.shown for view, _item in self._attached}
            self._recalled = tuple(
                citation_view(c, titles.get(c.source, c.source)) for c in self._attachments.observe()
            )

    def recalled(self) -> tuple[CitationView, ...]:
        return self._recalled

    def end_turn(self) -> None:
        session = self.session
        last = len(session.messages) - 1
        kept = [r for r in session.recalled if r.message < last]
        if last >= 0 and session.messages[last].role == "assistant":
            kept += [RecalledRecord(last, c.source, c.page, c.start, c.end, c.text) for c in self._recalled]
        session.recalled = kept

    def cited(self) -> dict[int, tuple[CitationView, ...]]:
        out: dict[int, list[CitationView]] = {}
        for r in self.session.recalled:
            out.setdefault(r.message, []).append(
                citation_view(Citation(r.source, r.page, r.start, r.end, r.text), r.source)
            )
        return {i: tuple(c) for i, c in out.items()}

    def _signature(self) -> tuple[int, int | None, int]:
        s = self.session
        return len(s.memory.tokens), s.pending_token, s.computed.count

    def keep(self, path: Path) -> bool:
        if self._kept is None:
            return False
        if self._kept_as == (path, *self._signature()):
            return True
        # A snapshot now, written by the kept memory's background writer: this thread never waits for the disk.
        done = self.session.keep(self._kept, path, later=True)
        self._kept_as = (path, *self._signature()) if done else None
        return done

    def kept_bytes(self, path: Path | None) -> int:
        """The size of this conversation's copy on disk, when it is current (0 otherwise)."""
        if self._kept is None or path is None or self._kept_as != (path, *self._signature()):
            return 0
        try:
            return self._kept.entry_path(path).stat().st_size
        except OSError:
            return 0

    def resident_bytes(self) -> int:
        stats = self.session.stats()
        episodic = stats.episodic.bytes if stats is not None else 0
        return self.session.backend.kv_resident_bytes() + episodic

    def computed_tokens(self) -> int:
        return self.session.computed.count

    def fresh(self) -> LocalConversation:
        new = LocalConversation(self._engine, self._on_prefill, self._kept)
        new.set_tools(self._tools)
        new.system_prompt = self.system_prompt
        return new

    def memory_report(self) -> MemoryReport:
        """The tiers of the memory (a memory without tiers is shown as one flat tier)."""
        memory = self.session.memory
        stats = self.session.stats()
        attached = self.attachments()
        if stats is not None:
            tiers = (stats.working, stats.episodic, stats.persistent)
            return MemoryReport(tiers, len(memory.tokens), "", self.held, 0, attached, self._recalled)
        backend = self.session.backend
        per_token = backend.kv_bytes_per_token()
        n = len(memory.tokens)
        row = TierStats("working", n, n * per_token, backend.num_slots * per_token, 0, 0, 0.0, 0)
        return MemoryReport((row,), n, "", self.held, 0, attached, self._recalled)

    def begin_turn(self) -> None:
        self._turn_starts.append(len(self.session.memory.tokens))
        self._recalled = ()

    def recall_hits(self) -> int:
        stats = self.session.stats()
        return stats.episodic.hits if stats is not None else 0

    def recalled_turns_ago(self, hits_before: int) -> int:
        """How many turns back the newest turn lies that has left the exact window (so a recall reached at least
        that far); 1 when none has wholly left it yet; 0 when nothing was recalled this turn."""
        stats = self.session.stats()
        if stats is None or stats.episodic.hits <= hits_before:
            return 0
        evicted = stats.working.evictions
        if not evicted:  # nothing of the conversation left the window: what was paged in is an attachment's
            return 0
        for back in range(1, len(self._turn_starts)):
            if self._turn_starts[-back] <= evicted:  # turn -(back+1) ended where turn -back began: wholly evicted
                return back
        return 1


class RemoteConversation:
    """A transcript answered by a remote server: no memory of ours, so files hold the transcript and its pictures
    only. The pictures go to a server whose model sees them; any other refuses the turn (engine.openai.client)."""

    def __init__(self, server: RemoteServer, client: RemoteClient | None = None) -> None:
        self._client = client or RemoteClient(server)
        self.remote = RemoteSession(self._client)

    @property
    def server(self) -> RemoteServer:
        return self._client.server

    @property
    def messages(self) -> list[tuple[str, str]]:
        return [(m["role"], m["content"]) for m in self.remote.messages]

    @property
    def system_prompt(self) -> str:
        return self.remote.system_prompt

    @system_prompt.setter
    def system_prompt(self, text: str) -> None:
        self.remote.system_prompt = text

    @property
    def model_name(self) -> str:
        return remote_name(self.server)

    def chat(
        self, text: str, settings: GenerationSettings, stop: StopCheck, images: Sequence[DecodedImage] = ()
    ) -> Iterator[GenerationEvent]:
        return self.remote.chat(text, settings, stop, images)

    def pictures(self) -> list[tuple[bytes, ...]]:
        return [tuple(p.data for p in ps) for ps in pictures_by_message(self.messages, self.remote.images)]

    def images(self) -> list[DecodedImage]:
        return list(self.remote.images)

    def regenerate(self, settings: GenerationSettings, stop: StopCheck) -> Iterator[GenerationEvent]:
        return self.remote.regenerate(settings, stop)

    def take_transcript(
        self,
        messages: list[tuple[str, str]],
        system_prompt: str,
        stop: StopCheck,
        images: Sequence[DecodedImage] = (),
    ) -> None:
        self.remote.messages = [{"role": r, "content": c} for r, c in messages]
        self.remote.system_prompt = system_prompt
        self.remote.images = list(images)

    def open(self, path: Path, transcript_only: bool, on_progress: Callable[[int, int], None]) -> Opened:
        """Any conversation opens as its transcript: the server re-reads it with the next message."""
        data = load_session(path)
        messages = [(m.role, m.content) for m in data.messages]
        self.take_transcript(messages, data.system_prompt or "", lambda: False, data.images)
        return Opened(True, "")

    def save(self, path: Path, full_memory: bool, verify: bool = True) -> None:
        self.remote.save(path)  # the server's memory is not ours: the transcript is all there is

    def reset(self) -> None:
        self.remote.reset()

    def keep(self, path: Path) -> bool:
        return False  # the server's memory is not ours to keep

    def resident_bytes(self) -> int:
        return 0

    def kept_bytes(self, path: Path | None) -> int:
        return 0

    def computed_tokens(self) -> int:
        return 0

    def fresh(self) -> RemoteConversation:
        new = RemoteConversation(self.server, self._client)
        new.system_prompt = self.system_prompt
        return new

    def close(self) -> None:
        self._client.close()

    def memory_report(self) -> MemoryReport:
        return MemoryReport((), 0, self.server.url)

    def begin_turn(self) -> None:
        pass  # no memory of ours: nothing is recalled

    def attach(
        self, path: Path, kind: AttachKind, title: str, on_progress: Callable[[int, int], None]
    ) -> AttachmentView:
        raise SparkError(
            f"{title or path.name} was not attached: a remote model reads only the conversation's text; load a local model to attach it."
        )

    def detach(self, path: Path) -> None:
        pass  # nothing can be attached

    def attachments(self) -> tuple[AttachmentView, ...]:
        return ()

    def observe_recalled(self) -> None:
        pass

    def recalled(self) -> tuple[CitationView, ...]:
        return ()

    def end_turn(self) -> None:
        pass  # nothing is attached

    def cited(self) -> dict[int, tuple[CitationView, ...]]:
        return {}

    def recall_hits(self) -> int:
        return 0

    def recalled_turns_ago(self, hits_before: int) -> int:
        return 0


def pictures_by_message(
    messages: Sequence[tuple[str, str]], images: Sequence[DecodedImage]
) -> list[tuple[DecodedImage, ...]]:
    """Each message's pictures: a session keeps them in the order of its transcript's markers, so a user message
    takes as many as its text has."""
    out: list[tuple[DecodedImage, ...]] = []
    held = list(images)
    for role, content in messages:
        n = content.count(IMAGE_TOKEN) if role == "user" else 0
        out.append(tuple(held[:n]))
        held = held[n:]
    return out


def citation_view(c: Citation, shown: str) -> CitationView:
    """`c` as the app shows it, its source named `shown` (an earlier conversation's title, not its file's)."""
    label = Citation(shown, c.page, c.start, c.end, c.text).label()
    return CitationView(shown, c.page, c.start, c.end, c.text, label)
