"""A conversation's attachments: documents and earlier conversations joined to its memory as capsules, and what
each reply recalled from them.

Attaching reads the file (engine.documents.extract), finds or reads its capsule (engine.documents.capsule) in the
conversation memory's own persistent store, and adopts the capsule's blocks into the memory's episodic tier
(CascadeMemory.attach) as pinned stubs: per-layer, query-aware retrieval pages in only the blocks a question
needs, so a document many times the model's context costs a question what the retrieval slots hold.

Recalled: the attached blocks the retrieval groups of at least half the layers hold once the prompt has routed
the reply (the blocks the layers agree on), merged into passages per source, in reading order.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.backends.base import Backend
from engine.documents.capsule import Capsule, capsule_key, checked, load_or_read
from engine.documents.extract import Document, DocumentError, Kind, Segment, read_file
from engine.documents.provenance import Citation, TokenMap, tokenize
from engine.documents.recall import StoredMemoryUnusable, recall_stored
from engine.errors import SessionFileError, SparkError
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import Memory
from engine.memory.cascade import CascadeMemory
from engine.session.file import AttachmentRecord, load_session
from engine.session.schema import MAX_ATTACHMENTS as MAX_ATTACHMENTS  # a conversation holds what its file may record


@dataclass(frozen=True)
class Attached:
    capsule: Capsule
    first_id: int  # the episodic id of its block 0

    def capsule_bounds(self) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """What CascadeMemory.attach takes to adopt it again."""
        return self.capsule.kmin, self.capsule.kmax, self.capsule.keys


class Attachments:
    """What one conversation (its cascade memory on `backend`) has attached."""

    def __init__(self, memory: Memory, tokenizer: Tokenizer, records: list[AttachmentRecord] | None = None) -> None:
        """`records`: where each attachment is recorded for the conversation's session file (its Session's
        `attachments`), when it has one."""
        if not isinstance(memory, CascadeMemory):
            raise SparkError("Attaching needs the memory cascade; this conversation uses another memory.")
        self.memory = memory
        self.tokenizer = tokenizer
        self.records = records
        self.items: list[Attached] = []
        self.recalled: list[Citation] = []
        self.notes: list[str] = []  # why an earlier conversation was read again instead of recalled from its memory

    @property
    def document_tokens(self) -> int:
        return sum(a.capsule.tokens for a in self.items)

    @property
    def read_tokens(self) -> int:
        """Tokens the model computed to read the attachments in this process (0 for capsules found on disk)."""
        return sum(a.capsule.read_tokens for a in self.items)

    def attach_file(
        self, path: Path, on_progress: Callable[[int, int], None] | None = None, once: bool = False
    ) -> Attached:
        return self.attach_document(read_file(path), on_progress, once=once)

    def attach_document(
        self,
        doc: Document,
        on_progress: Callable[[int, int], None] | None = None,
        what: str = "document",
        reader: Backend | None = None,
        once: bool = False,
    ) -> Attached:
        """`doc` joins the memory; its capsule, when not yet on disk, is read by `reader` (default: the memory's own
        backend; the server's rows pass a reader of their own, since their slot table is shared and a capsule's
        reading must not resize it). `once`: when the memory holds that capsule already (a restored conversation
        recorded it), that attachment is returned instead of a second one."""
        if len(self.items) >= MAX_ATTACHMENTS:
            raise DocumentError(f"A conversation holds at most {MAX_ATTACHMENTS} attachments; {doc.name} is one more.")
        ids, token_map = tokenize(self.tokenizer, doc, f"The {what} {doc.name}:\n")
        store = self.memory.store
        if store is None:
            raise SparkError("Attaching needs the persistent cache; run without --no-prefix-cache.")
        pad = self.tokenizer.encode("\n", add_bos=False)[-1]
        b = self.memory.cfg.block_size
        capsule = load_or_read(reader or self.memory.backend, store, ids, token_map, b, pad, on_progress)
        kind = "conversation" if what == "earlier conversation" else "document"
        held = [item for item in self.items if item.capsule.keys == capsule.keys] if once else []
        return held[0] if held else self._adopt(capsule, kind, capsule_key(store, capsule.ids, b, pad))

    def _adopt(self, capsule: Capsule, kind: str, digest: str) -> Attached:
        at = len(self.memory.tokens)
        first = self.memory.attach(capsule.kmin, capsule.kmax, capsule.keys, ids=capsule.ids)
        item = Attached(capsule, first)
        self.items.append(item)
        if self.records is not None:
            self.records.append(AttachmentRecord(kind, capsule.name, digest, capsule.tokens, at))
        return item

    def detach(self, item: Attached) -> bool:
        """`item` leaves the memory (the conversation goes on; its capsule stays on disk for a later attach) and its
        record goes. The ones attached after it leave and join again, so each holds the ids a session file's restore
        gives it from the records that stay (a removal leaves no gap for a restore to guess). True when the memory
        had computed tokens: a compact recipe cannot replay a removal there (retrieval was emptied mid-stream), so
        the caller keeps the full memory in its files from then on (Session.drop_recipe). False: nothing was
        computed yet, and the memory is as if `item` had never joined (its file stays compact)."""
        i = self.items.index(item)
        later = self.items[i + 1 :]
        for other in reversed(later):
            self.memory.detach(other.first_id)
        self.memory.detach(item.first_id)
        self.items = self.items[:i]
        for other in later:
            self.items.append(
                replace(other, first_id=self.memory.attach(*other.capsule_bounds(), ids=other.capsule.ids))
            )
        if self.records is not None and i < len(self.records):
            del self.records[i]
        self.recalled = [c for c in self.recalled if c.source != item.capsule.name]
        if self.memory.tokens:
            return True
        self.memory.reset()  # nothing computed yet: the memory becomes the one a replay of the records builds
        return False

    def restored(self, found: list[Attached]) -> None:
        """What a session file's load attached again (Reattacher.found): cited like the rest."""
        self.items.extend(found)

    def recall_session(
        self, path: Path, on_progress: Callable[[int, int], None] | None = None, once: bool = False
    ) -> Attached:
        """An earlier conversation (.spark) joins: a full file's stored memory as it is (engine.documents.recall:
        nothing read), else a capsule of its transcript, one line per message line, read once. Why a full file's
        memory could not serve is kept in `notes`. `once`: as attach_document's."""
        if len(self.items) >= MAX_ATTACHMENTS:
            raise DocumentError(f"A conversation holds at most {MAX_ATTACHMENTS} attachments; {path.name} is one more.")
        try:
            stored = recall_stored(self.memory, self.tokenizer, path)
        except StoredMemoryUnusable as exc:
            self.notes.append(f"{exc} Reading its transcript instead.")
            stored = None
        except SessionFileError as exc:
            raise DocumentError(str(exc)) from None
        if stored is not None:
            held = [item for item in self.items if item.capsule.keys == stored[0].keys] if once else []
            return held[0] if held else self._adopt(stored[0], "conversation", stored[1])
        return self.attach_document(transcript_document(path), on_progress, "earlier conversation", once=once)

    def observe(self) -> list[Citation]:
        """Call once the prompt has routed the reply (its first token): what the reply recalls, kept in
        `recalled` and returned."""
        groups = self.memory.working.groups
        votes = Counter(b for layer in groups for b in set(layer))
        agreed = {b for b, n in votes.items() if 2 * n >= len(groups)}
        passages: list[Citation] = []
        for item in self.items:
            n = len(item.capsule.keys)
            blocks = sorted(b - item.first_id for b in agreed if 0 <= b - item.first_id < n)
            cites = {j: item.capsule.cite(j, self.tokenizer) for j in blocks}
            runs: list[list[int]] = []
            for j in blocks:  # a passage is consecutive blocks of one page (its label names one page)
                if runs and runs[-1][-1] == j - 1 and cites[runs[-1][-1]].page == cites[j].page:
                    runs[-1].append(j)
                else:
                    runs.append([j])
            for run in runs:
                first, last = cites[run[0]], cites[run[-1]]
                text = self._passage(item.capsule, run)
                passages.append(Citation(first.source, first.page, first.start, last.end, text))
        self.recalled = passages
        return passages

    def _passage(self, capsule: Capsule, run: list[int]) -> str:
        """The text of blocks `run` as the document has it: decoded at once (no seam inside a word), without the
        header the model was told the text with, and ending where the page its first line is on ends."""
        size, where, starts = capsule.block_size, capsule.token_map.where, capsule.token_map.starts
        lo, hi = max(run[0] * size, starts[0]), (run[-1] + 1) * size
        first = bisect.bisect_right(starts, lo) - 1
        page = where[first][0]
        turn = next((starts[i] for i in range(first + 1, len(starts)) if where[i][0] != page), hi)
        return self.tokenizer.decode(capsule.ids[lo : min(hi, turn)]).strip()


class Reattacher:
    """Session.load's `reattach`: a session file's recorded attachments join the memory being restored again, each
    found in the persistent store by its digest (nothing is read from a path the file names: it names none). One
    no longer there fails the load in one sentence naming it; attaching that file again (the user's own action)
    stores the same capsule under the same digest."""

    def __init__(self) -> None:
        self.found: list[Attached] = []

    def __call__(self, memory: Memory, record: AttachmentRecord, present: bool) -> None:
        if not isinstance(memory, CascadeMemory) or memory.store is None:
            raise SparkError("This conversation holds attachments; open it with the memory cascade and its cache.")
        capsule = find_capsule(memory, record)
        if capsule is None:
            how = (
                "attach it again (--attach, /attach)"
                if record.kind == "document"
                else "recall it again (--recall-session, /recall)"
            )
            raise DocumentError(
                f"{record.name}, attached to this conversation, is no longer in the memory cache; {how}, then open the conversation."
            )
        self.found.append(
            Attached(capsule, memory.attach(capsule.kmin, capsule.kmax, capsule.keys, ids=capsule.ids, present=present))
        )


def find_capsule(memory: CascadeMemory, record: AttachmentRecord) -> Capsule | None:
    """The capsule stored under `record.digest` when every part of it holds for this memory, else None."""
    assert memory.store is not None
    got = memory.store.get_state(record.digest)
    if got is None:
        return None
    meta, tensors = got
    ids, b = meta.get("ids"), memory.cfg.block_size
    if not isinstance(ids, list) or len(ids) != record.tokens or any(type(t) is not int for t in ids):
        return None
    return checked(meta, tensors, memory.store, ids, b, memory.backend, TokenMap(record.name, (0,), ((0, 1),)))


def transcript_document(path: Path) -> Document:
    """A .spark file's messages as a text document ("User: ...", one segment per line of each message)."""
    try:
        data = load_session(path)
    except SessionFileError as exc:
        raise DocumentError(str(exc)) from None
    segments: list[Segment] = []
    line = 1
    for m in data.messages:
        for i, text in enumerate(m.content.split("\n")):
            segments.append(Segment(f"{m.role.capitalize()}: {text}" if i == 0 else text, line))
            line += 1
    if not any(s.text.strip() for s in segments):
        raise DocumentError(f"{path.name} holds no messages to recall.")
    return Document(path.name, Kind.TEXT, tuple(segments))
