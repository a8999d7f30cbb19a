"""The one place the app decides how an Engine is built: each conversation gets the memory cascade, with its
persistent (L3) tier under the app's cache dir, and the hardware policy checks the model fits, sizes the episodic
tier from the RAM budget and paces generation."""

from __future__ import annotations

from pathlib import Path

from engine import Engine, memory_factory_for
from engine.hw import HardwarePolicy, use_recommended_threads


def load_engine(
    model_dir: Path | None, backend: str, cache_dir: Path, policy: HardwarePolicy | None, quantize: str = "auto"
) -> Engine:
    """Load `model_dir` (a folder or a .gguf; None: the default model) with weights held as `quantize` (the
    Settings' weight precision). Raises SparkError subclasses with one user-facing sentence."""
    use_recommended_threads()  # leave a core to the GUI thread (see engine.hw.chip.recommended_threads)
    memory = memory_factory_for(model_dir, cache_dir=cache_dir / "kv", policy=policy)
    # "auto" weights: as stored for a GGUF, the fastest faithful format on the CPU, native elsewhere.
    return Engine.load(model_dir, backend, memory_factory=memory, policy=policy, quantize=quantize)
