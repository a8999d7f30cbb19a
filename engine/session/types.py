"""What a `.spark` session file holds once read: its messages, its data, and what restoring it gave.

The file format is engine.session.container; reading and restoring engine.session.file; writing engine.session.save.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.memory.base import Memory
from engine.vision.images import DecodedImage

RECOMPUTE_KIND = "recompute"  # memory meta of a compact file: no KV stored, rebuilt on open (engine.session.replay)
TRANSCRIPT_KIND = "transcript"  # memory meta of a file with no memory at all (a remote server's conversation)

JSONValue = Any  # None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant" (kept as written; the chat template decides what it accepts)
    content: str
    timestamp: float | None = None  # seconds since the epoch; None when the file's format version did not keep it
    reasoning: str = ""  # an assistant message's think block, apart from its answer ("" when none or not kept)


ATTACHMENT_KINDS = ("document", "conversation")


@dataclass(frozen=True)
class AttachmentRecord:
    """A document or earlier conversation the memory holds as a capsule (engine.documents), as a session file
    records it: by name and content address, never by path. A restore finds the capsule again in the persistent
    store by `digest`; the file never makes the engine read a path."""

    kind: str  # ATTACHMENT_KINDS
    name: str  # what the user attached, as shown (a file name, no folders)
    digest: str  # the capsule's index key in the persistent store (sha256 hex)
    tokens: int  # its tokens
    at: int  # the memory's tokens when it was attached: a compact file's replay attaches it there

    def to_json(self) -> dict[str, JSONValue]:
        return {"kind": self.kind, "name": self.name, "digest": self.digest, "tokens": self.tokens, "at": self.at}


@dataclass(frozen=True)
class RecalledRecord:
    """A passage a reply drew on from the attachments (engine.documents Citation), kept with the conversation so the
    reply shows it again after a reopen: display only, nothing is read from it."""

    message: int  # the reply's index in the messages
    source: str  # how the reply named it
    page: int | None
    start: int  # first line
    end: int  # last line
    text: str

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "message": self.message,
            "source": self.source,
            "page": self.page,
            "start": self.start,
            "end": self.end,
            "text": self.text,
        }


@dataclass
class SessionData:
    """Everything a `.spark` file holds, migrated to the current format version."""

    format_version: int  # the version the file was written in (before migration)
    app_version: str
    fingerprint: str  # the model's (engine.loading.weights.fingerprint)
    tokenizer_hash: str | None
    created: float
    saved: float
    system_prompt: str | None
    messages: list[Message]
    settings: dict[str, JSONValue]
    token_ids: list[int]  # every token fed to the memory, in order
    pending_token: int | None  # sampled last and not yet fed: a continuation feeds it first
    sampler_state: JSONValue  # the sampler's get_state() (RNG), or None
    memory_meta: dict[str, JSONValue]  # Memory.state()[0]: slot table, tier stats
    tensors: dict[str, torch.Tensor]  # Memory.state()[1]: canonical fp16 KV per tier, on the host
    extra: dict[str, JSONValue]
    compression: str
    file_bytes: int
    kv_type: str = "f16"  # what the slot table held keys and values in (engine.model.kv_types)
    images: list[DecodedImage] = field(default_factory=list)  # the transcript's pictures (engine.session.pictures)
    attachments: list[AttachmentRecord] = field(default_factory=list)  # extra["attachments"], checked
    recalled: list[RecalledRecord] = field(default_factory=list)  # extra["recalled"], checked

    @property
    def memory_state(self) -> tuple[dict[str, JSONValue], dict[str, torch.Tensor]]:
        return self.memory_meta, self.tensors


@dataclass
class RestoredSession:
    """A session whose memory was written back into a backend: continue by feeding `pending_token` first."""

    data: SessionData
    memory: Memory


@dataclass
class ForeignModelSession:
    """A sound file made with another model (or tokenizer): its KV must not be applied; the transcript may be
    restored and re-read (re-prefilled) after telling the user `reason`."""

    data: SessionData
    reason: str  # one sentence for the user
