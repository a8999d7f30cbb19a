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

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.backends.base import Backend
from engine.documents.capsule import Capsule, load_or_read
from engine.documents.extract import Document, DocumentError, Kind, Segment, read_file
from engine.documents.provenance import Citation, tokenize
from engine.errors import SessionFileError, SparkError
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import Memory
from engine.memory.cascade import CascadeMemory

MAX_ATTACHMENTS = 32


@dataclass(frozen=True)
class Attached:
    capsule: Capsule
    first_id: int  # the episodic id of its block 0


class Attachments:
    """What one conversation (its cascade memory on `backend`) has attached."""

    def __init__(self, memory: Memory, tokenizer: Tokenizer) -> None:
        if not isinstance(memory, CascadeMemory):
            raise SparkError("Attaching needs the memory cascade; this conversation uses another memory.")
        self.memory = memory
        self.tokenizer = tokenizer
        self.items: list[Attached] = []
        self.recalled: list[Citation] = []

    @property
    def document_tokens(self) -> int:
        return sum(a.capsule.tokens for a in self.items)

    @property
    def read_tokens(self) -> int:
        """Tokens the model computed to read the attachments in this process (0 for capsules found on disk)."""
        return sum(a.capsule.read_tokens for a in self.items)

    def attach_file(self, path: Path, on_progress: Callable[[int, int], None] | None = None) -> Attached:
        return self.attach_document(read_file(path), on_progress)

    def attach_document(
        self,
        doc: Document,
        on_progress: Callable[[int, int], None] | None = None,
        what: str = "document",
        reader: Backend | None = None,
    ) -> Attached:
        """`doc` joins the memory; its capsule, when not yet on disk, is read by `reader` (default: the memory's own
        backend; the server's rows pass a reader of their own, since their slot table is shared and a capsule's
        reading must not resize it)."""
        if len(self.items) >= MAX_ATTACHMENTS:
            raise DocumentError(f"A conversation holds at most {MAX_ATTACHMENTS} attachments; {doc.name} is one more.")
        ids, token_map = tokenize(self.tokenizer, doc, f"The {what} {doc.name}:\n")
        store = self.memory.store
        if store is None:
            raise SparkError("Attaching needs the persistent cache; run without --no-prefix-cache.")
        pad = self.tokenizer.encode("\n", add_bos=False)[-1]
        capsule = load_or_read(
            reader or self.memory.backend, store, ids, token_map, self.memory.cfg.block_size, pad, on_progress
        )
        first = self.memory.attach(capsule.kmin, capsule.kmax, capsule.keys, capsule.ids)
        item = Attached(capsule, first)
        self.items.append(item)
        return item

    def recall_session(self, path: Path, on_progress: Callable[[int, int], None] | None = None) -> Attached:
        """An earlier conversation (.spark) joins as a capsule of its transcript, one line per message line."""
        return self.attach_document(transcript_document(path), on_progress, "earlier conversation")

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
            runs: list[list[int]] = []
            for j in blocks:
                if runs and runs[-1][-1] == j - 1:
                    runs[-1].append(j)
                else:
                    runs.append([j])
            for run in runs:
                first, last = item.capsule.cite(run[0], self.tokenizer), item.capsule.cite(run[-1], self.tokenizer)
                text = " ".join(item.capsule.cite(j, self.tokenizer).text for j in run)
                end = last.end if last.page == first.page else first.end
                passages.append(Citation(first.source, first.page, first.start, end, text))
        self.recalled = passages
        return passages


def transcript_document(path: Path) -> Document:
    """A .spark file's messages as a text document ("User: ...", one segment per line of each message)."""
    from engine.session.file import load_session  # only recalling reads session files

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
