"""MLoT Spark engine: model, memory cascade, generation, sessions (no Qt).

The public face the app, scripts and tests use (mlx-lm's shape: `load`, then generate on a session):

    import engine
    eng = engine.load()                       # the default model on the best backend this machine has
    session = eng.new_session()
    for event in session.chat("What is the capital of France?", engine.GenerationSettings()):
        print(event.text, end="")

Packages, each with one concern, importing only those above it in this list (tests/import_graph.py checks it):
`model` (config, network, attention, slot table, block quantization) → `loading` (model paths, safetensors, GGUF,
tokenizer, chat templates) → `backends` (the forward on a device; `native/` holds the CPU kernels) → `hw` (chip,
thermal, memory policy) → `memory` (the memory protocol, full attention, the cascade) → `generation` (the loop,
sampling, batches, the scheduler, the profiler) → `session` (Engine, Session, replay, `.spark` files) → `openai`
(the shared protocol, the client of remote servers, the server) → `library` (the model library: catalog,
recommendation, Hub downloads, the store of models; the app's Get Models… imports it directly) → `bench`, `cli`. `errors`, `fileio` and `paths`
are leaves every package may use.

Importing it sets one process-wide policy before PyTorch loads its OpenMP runtime: OpenMP workers sleep when idle
(OMP_WAIT_POLICY=PASSIVE) instead of spinning. The native kernels' thread pool runs every matrix product; PyTorch's
workers, left spinning after each of its own operations (attention, norms), took the cores the pool's workers and
the GUI thread need (a 2-thread prefill ran slower than a 1-thread one). A user's own setting wins.
"""

import importlib
import os
from typing import TYPE_CHECKING, Any

USER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")  # as the user gave it (bench peers get it back)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The public face, each name imported on its first use (PEP 562): a process that needs one part of the engine (the
# CLI's generate, a benchmark's child, the server) does not load the rest, such as the remote client's HTTP stack.
_PUBLIC: dict[str, tuple[str, str]] = {  # name -> (module, name there)
    "AUTO_ORDER": ("engine.backends", "AUTO_ORDER"),
    "QUANTIZE_CHOICES": ("engine.backends", "QUANTIZE_CHOICES"),
    "SparkError": ("engine.errors", "SparkError"),
    "Grammar": ("engine.generation.constrained", "Grammar"),
    "GrammarError": ("engine.generation.constrained", "GrammarError"),
    "json_schema_grammar": ("engine.generation.constrained", "json_schema_grammar"),
    "FinishReason": ("engine.generation.loop", "FinishReason"),
    "GenerationEvent": ("engine.generation.loop", "GenerationEvent"),
    "GenerationSettings": ("engine.generation.loop", "GenerationSettings"),
    "PrefillProgress": ("engine.generation.loop", "PrefillProgress"),
    "InvalidSamplingSettings": ("engine.generation.sampling", "InvalidSamplingSettings"),
    "SamplingSettings": ("engine.generation.sampling", "SamplingSettings"),
    "Speculation": ("engine.generation.speculative", "Speculation"),
    "DEFAULT_MODEL_NAME": ("engine.loading.model_files", "DEFAULT_MODEL_NAME"),
    "default_model_path": ("engine.loading.model_files", "default_model_path"),
    "display_name": ("engine.loading.model_files", "display_name"),
    "ModelSampling": ("engine.loading.sampling_defaults", "ModelSampling"),
    "validate_gguf": ("engine.loading.validate", "validate_gguf"),
    "CascadeStats": ("engine.memory.cascade", "CascadeStats"),
    "TierStats": ("engine.memory.cascade", "TierStats"),
    "RemoteClient": ("engine.openai.client", "RemoteClient"),
    "RemoteError": ("engine.openai.client", "RemoteError"),
    "RemoteServer": ("engine.openai.client", "RemoteServer"),
    "RemoteSession": ("engine.openai.client", "RemoteSession"),
    "ChatMessage": ("engine.session.engine", "ChatMessage"),
    "Engine": ("engine.session.engine", "Engine"),
    "LoadReport": ("engine.session.engine", "LoadReport"),
    "Session": ("engine.session.engine", "Session"),
    "load": ("engine.session.engine", "load"),
    "memory_factory_for": ("engine.session.engine", "memory_factory_for"),
    "RECOMPUTE_KIND": ("engine.session.file", "RECOMPUTE_KIND"),
    "TRANSCRIPT_KIND": ("engine.session.file", "TRANSCRIPT_KIND"),
    "SessionData": ("engine.session.file", "SessionData"),
    "atomic_write": ("engine.session.file", "atomic_write"),
    "load_session": ("engine.session.file", "load_session"),
    "SESSION_SUFFIX": ("engine.session.file", "SUFFIX"),
    "DEFAULT_KEPT_BUDGET_BYTES": ("engine.session.kept", "DEFAULT_KEPT_BUDGET_BYTES"),
    "KeptMemory": ("engine.session.kept", "KeptMemory"),
    "KeptUsage": ("engine.session.kept", "KeptUsage"),
    "__version__": ("engine.version", "__version__"),
}

if TYPE_CHECKING:
    from engine.backends import AUTO_ORDER, QUANTIZE_CHOICES
    from engine.errors import SparkError
    from engine.generation.constrained import Grammar, GrammarError, json_schema_grammar
    from engine.generation.loop import (
        FinishReason,
        GenerationEvent,
        GenerationSettings,
        PrefillProgress,
    )
    from engine.generation.sampling import InvalidSamplingSettings, SamplingSettings
    from engine.generation.speculative import Speculation
    from engine.loading.model_files import DEFAULT_MODEL_NAME, default_model_path, display_name
    from engine.loading.sampling_defaults import ModelSampling
    from engine.loading.validate import validate_gguf
    from engine.memory.cascade import CascadeStats, TierStats
    from engine.openai.client import RemoteClient, RemoteError, RemoteServer, RemoteSession
    from engine.session.engine import ChatMessage, Engine, LoadReport, Session, load, memory_factory_for
    from engine.session.file import (
        RECOMPUTE_KIND,
        TRANSCRIPT_KIND,
        SessionData,
        atomic_write,
        load_session,
    )
    from engine.session.file import (
        SUFFIX as SESSION_SUFFIX,
    )
    from engine.session.kept import DEFAULT_KEPT_BUDGET_BYTES, KeptMemory, KeptUsage
    from engine.version import __version__


def __getattr__(name: str) -> Any:
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(where[0]), where[1])
    globals()[name] = value  # later lookups find it directly
    return value


__all__ = [
    "AUTO_ORDER",
    "DEFAULT_KEPT_BUDGET_BYTES",
    "DEFAULT_MODEL_NAME",
    "QUANTIZE_CHOICES",
    "RECOMPUTE_KIND",
    "SESSION_SUFFIX",
    "TRANSCRIPT_KIND",
    "USER_OMP_WAIT_POLICY",
    "CascadeStats",
    "ChatMessage",
    "Engine",
    "FinishReason",
    "GenerationEvent",
    "GenerationSettings",
    "Grammar",
    "GrammarError",
    "InvalidSamplingSettings",
    "KeptMemory",
    "KeptUsage",
    "LoadReport",
    "ModelSampling",
    "PrefillProgress",
    "RemoteClient",
    "RemoteError",
    "RemoteServer",
    "RemoteSession",
    "SamplingSettings",
    "Session",
    "SessionData",
    "SparkError",
    "Speculation",
    "TierStats",
    "__version__",
    "atomic_write",
    "default_model_path",
    "display_name",
    "json_schema_grammar",
    "load",
    "load_session",
    "memory_factory_for",
    "validate_gguf",
]
