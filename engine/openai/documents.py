"""Uploaded files (engine.openai.files) joined to one request's row memory as capsules (engine.documents.attach).

A chat message's `{"type": "file", "file": {"file_id": ...}}` parts name documents; each of the request's rows
attaches them at admission (the scheduler's `attach` hook, on its thread: the first read of a document runs the
model, later ones find its capsule in the persistent store and read nothing), records what the reply recalled once
the prompt has routed its first token, and detaches them when the request is over, so the row's next request sees
none of them.
"""

from __future__ import annotations

from engine.backends.base import Backend
from engine.documents.attach import Attachments
from engine.documents.extract import Document
from engine.documents.provenance import Citation
from engine.errors import SparkError
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import Memory
from engine.memory.cascade import CascadeMemory
from engine.openai.errors import bad_request


def check_attachable(memory: Memory | None) -> None:
    """400 unless `memory` (a row's, as the service's factory makes them) can hold attachments."""
    if not isinstance(memory, CascadeMemory) or memory.store is None or not memory.cfg.retrieval_blocks:
        raise bad_request(
            "This model is served without the memory cascade's retrieval and persistent cache, so it cannot attach "
            "files; serve it with the cascade (no --no-prefix-cache) or send the text in the message.",
            "messages",
        )


class RowDocuments:
    """One request's documents on one row: the scheduler's Attacher (call it with the row's memory) and the
    RowAttachment it returns."""

    def __init__(self, documents: list[Document], tokenizer: Tokenizer, reader: Backend) -> None:
        self.documents = documents
        self.tokenizer = tokenizer
        self.reader = reader  # reads a capsule on a slot table of its own (its fork), not the row's
        self.attachments: Attachments | None = None
        self.recalled: list[Citation] = []
        self.read_tokens = 0  # tokens the model computed to read them (0 when every capsule was found)
        self.document_tokens = 0

    def __call__(self, memory: Memory) -> RowDocuments:
        attachments = Attachments(memory, self.tokenizer)
        self.attachments = attachments
        try:
            for doc in self.documents:
                attachments.attach_document(doc, reader=self.reader)
        except SparkError as exc:  # the request's files, not the server, are the problem
            self.detach()
            raise bad_request(str(exc), "messages") from None
        self.read_tokens = attachments.read_tokens
        self.document_tokens = attachments.document_tokens
        return self

    def observe(self) -> None:
        if self.attachments is not None:
            self.recalled = self.attachments.observe()

    def detach(self) -> None:
        if self.attachments is not None:
            self.attachments.memory.attachments.clear()  # the next reset adopts none of them again
