"""Model ▸ "Get Models…" (the model library's window; app/library.py is the conversation library, another thing).

The window needs three lines: an action that calls `open_get_models(parent, models_root, open_model)`, a model menu
section from `downloaded_models(models_root)`, and the first-launch line `FIRST_LAUNCH_HINT`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtWidgets import QWidget

from engine.library.store import ModelStore

if TYPE_CHECKING:
    from app.models.dialog import GetModelsDialog

FIRST_LAUNCH_HINT = (
    "Want stronger answers? Model ▸ Get Models… downloads Qwen3, Gemma 3, Llama 3.2 or Phi-4 mini; the default model "
    "keeps working offline."
)


def downloaded_models(models_root: Path) -> list[tuple[str, Path]]:
    """(name, GGUF path) of each complete downloaded model, for the model menu (a local read, no network)."""
    return [(m.name, m.path) for m in ModelStore(models_root).models()]


def open_get_models(
    parent: QWidget,
    models_root: Path,
    open_model: Callable[[Path], None],
    measured: tuple[int, float] | None = None,
) -> GetModelsDialog:
    """Show the dialog (modeless); "Chat with It" calls `open_model` with the downloaded GGUF. `measured`: the loaded
    model's weight bytes and decoding tokens/s on this computer, where a reply has measured them."""
    # Imported here: the dialog brings huggingface_hub, which the window's start need not pay for.
    from app.models.dialog import GetModelsDialog
    from app.models.tasks import LibraryTasks
    from engine.library.library import Library
    from engine.library.recommend import Measured, this_machine

    library = Library.from_env(models_root)
    tasks = LibraryTasks(library)
    machine = this_machine(Measured(*measured) if measured is not None else None)
    dialog = GetModelsDialog(tasks, machine, parent=parent)
    tasks.setParent(dialog)
    dialog.model_chosen.connect(open_model)
    dialog.finished.connect(lambda _code: tasks.wait(5.0))  # a running download stops, kept to resume later
    dialog.show()
    return dialog


__all__ = ["FIRST_LAUNCH_HINT", "downloaded_models", "open_get_models"]
