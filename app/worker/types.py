"""What crosses the worker's thread boundary: plain frozen dataclasses the worker emits and the GUI reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from engine import Engine, FinishReason, ModelSampling, RemoteServer, TierStats


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    backend: str
    backend_detail: str  # BackendChoice.explain(): the backend, its weight precision and why faster ones were skipped
    weight_bytes: int
    kv_bytes_per_token: int
    context_tokens: int = 0  # the model's trained context
    sampling: ModelSampling | None = None  # the model's own sampling defaults (Settings shows them)
    sees_images: bool = False  # the folder has a vision tower: pictures may go with a message


@dataclass(frozen=True)
class LoadedModel:
    engine: Engine  # handed to the quick prompt's worker; the GUI reads `info` and counts with `count_tokens`
    info: ModelInfo
    count_tokens: Callable[[str], int]  # a prompt's length in the model's tokens (thread-safe: the GUI calls it)


class Speculating(Enum):
    """Whether a reply speculates (engine.generation.speculative)."""

    OFF = "off"  # the settings turn speculation off
    UNUSED = "unused"  # the settings ask for it where it pays, and this reply decodes plainly (it would not pay)
    ON = "on"


@dataclass(frozen=True)
class TurnProgress:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    tokens_per_s: float
    tokens_per_forward: float = 0.0  # speculating: tokens each decode forward gave (0: none yet)
    speculating: Speculating = Speculating.OFF


class MemoryHeld(Enum):
    """How the open conversation's memory came to be there (the inspector says it in words)."""

    NEW = "new"  # read as the conversation was written
    RAM = "ram"  # handed back from RAM: it stayed resident while the user looked elsewhere
    DISK = "disk"  # read back from the kept memory on disk (engine.session.kept)
    RECOMPUTED = "recomputed"  # recomputed from the conversation's compact record
    FILE = "file"  # restored from a file that holds its memory


class AttachKind(Enum):
    """What joins a conversation's memory: a file the user attached, or an earlier conversation recalled."""

    DOCUMENT = "document"
    CONVERSATION = "conversation"


@dataclass(frozen=True)
class AttachmentView:
    """One thing a conversation has attached, as the composer's chips and the inspector show it."""

    path: Path  # the file as the user chose it (an earlier conversation: its stored .spark)
    name: str  # how citations name it
    kind: AttachKind
    tokens: int  # what it holds, in the model's tokens
    disk_bytes: int  # what its memory takes in the cache folder
    read_tokens: int  # tokens the model computed to read it now (0: read before, found on disk)
    title: str = ""  # how the app names it (an earlier conversation: its title), else `name`

    @property
    def shown(self) -> str:
        return self.title or self.name


@dataclass(frozen=True)
class CitationView:
    """A passage a reply drew on: where it is (file, page, lines) and its text as the model read it."""

    source: str
    page: int | None
    start: int
    end: int
    text: str
    label: str  # "notes.md, l. 12-20", "paper.pdf, p. 3, l. 4"


@dataclass(frozen=True)
class AttachProgress:
    """A document being read through the model the first time: tokens done of total."""

    path: Path
    done: int
    total: int


@dataclass(frozen=True)
class MemoryReport:
    tiers: tuple[TierStats, ...]  # the cascade's own snapshot type: plain numbers, no tensors
    tokens: int  # tokens this conversation's memory holds
    remote: str = ""  # a remote server's URL: its memory is the server's, none of these numbers apply
    held: MemoryHeld = MemoryHeld.NEW
    kept_bytes: int = 0  # the copy of this memory kept on disk (0: none yet)
    attachments: tuple[AttachmentView, ...] = ()  # documents and earlier conversations joined to it
    recalled: tuple[CitationView, ...] = ()  # what the last reply drew on from them


@dataclass(frozen=True)
class TurnResult:
    reason: FinishReason | Literal["error"]
    progress: TurnProgress
    text: str
    recalled_turns_ago: int = 0  # > 0: the reply used recalled (episodic) memory holding turns at least this old
    memory_tokens: int = 0  # tokens the conversation's memory holds after the turn (a Stop while reading: part of it)
    messages: int = 0  # messages the conversation holds after the turn (one turn that called tools adds several)
    recalled: tuple[CitationView, ...] = ()  # passages of the attachments the reply drew on


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
    cut_off: bool = False  # the last reply was stopped (Stop, Quit) before it ended


@dataclass(frozen=True)
class MessageView:
    role: str
    content: str
    recalled: tuple[CitationView, ...] = ()  # a reply's: the passages it drew on (kept with the conversation)
    images: tuple[bytes, ...] = ()  # a user message's pictures, encoded as they were given (the bubble's thumbnails)


@dataclass(frozen=True)
class SessionFileEvent:
    kind: str  # "saved" | "restored"
    path: Path
    when: float  # seconds since the epoch
    note: str = ""  # e.g. "transcript only: memory re-read on the next turn"


def remote_name(server: RemoteServer) -> str:
    """How a remote model is named in the window and the history: its name and the server's host."""
    return f"{server.model} on {urlsplit(server.url).netloc}"
