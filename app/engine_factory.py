"""The one place the app decides how an Engine is built: which memory each conversation gets.

Swapping full attention for the memory cascade is a change to `memory_factory` only.
"""

from __future__ import annotations

from pathlib import Path

from engine.backends.base import Backend
from engine.memory import FullAttentionMemory, Memory
from engine.session import Engine, MemoryFactory

FULL_ATTENTION_SLOTS = 2048


def memory_factory(num_slots: int = FULL_ATTENTION_SLOTS) -> MemoryFactory:
    def make(backend: Backend) -> Memory:
        backend.allocate(1, num_slots)
        return FullAttentionMemory(backend)

    return make


def load_engine(model_dir: Path | None, backend: str = "auto") -> Engine:
    """Load `model_dir` (None: the bundled model). Raises SparkError subclasses with one user-facing sentence."""
    return Engine.load(model_dir, backend, memory_factory=memory_factory())
