"""What the window and its helpers (commands, menus) share: a small state object, read by all, written by the window
and the commands as conversations open, start and go."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app.history.library import new_id
from engine import ModelSampling, RemoteServer


@dataclass
class WindowState:
    current_id: str = field(default_factory=new_id)  # the open conversation's id in the library
    file: Path | None = None  # the file outside the library it was last saved to / opened from
    model_loaded: bool = False
    model_path: Path | None = None  # None: the default model
    model_sampling: ModelSampling | None = None  # the loaded local model's own sampling defaults
    remote: RemoteServer | None = None  # the server replies stream from, when one is the model
    opening: str | None = None  # the conversation id a restore in flight will become
    pending_files: list[Path] = field(default_factory=list)  # opened before the model was ready
    titles_for_new: dict[str, str] = field(default_factory=dict)  # branch titles, applied when first stored


@dataclass(frozen=True)
class Notice:
    """A message for the notice bar, with an optional action button."""

    text: str
    error: bool = False
    action: tuple[str, Callable[[], None]] | None = None
