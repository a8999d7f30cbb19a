"""MLoT Spark engine: model, memory cascade, generation, sessions (no Qt).

The public face the app, scripts and tests use (mlx-lm's shape: `load`, then generate on a session):

    import engine
    eng = engine.load()                       # the default model on the best backend this machine has
    session = eng.new_session()
    for event in session.chat("What is the capital of France?", engine.GenerationSettings()):
        print(event.text, end="")

Packages, each with one concern, importing only those below it (docs/DESIGN.md, "engine/"; tests/import_graph.py
checks the order).

The face is listed once, as the imports under `_deferred()` below: mypy and readers see plain imports, while at run
time each name is only recorded there and imported on its first use (PEP 562), so a process that needs one part of
the engine (the CLI's generate, a benchmark's child, the server) does not load the rest, such as the remote client's
HTTP stack. The first use also sets the process-wide settings the engine runs under (engine.process).
"""

from __future__ import annotations

import builtins
import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine.process import exit_process, prepare_process

_PUBLIC: dict[str, tuple[str, str]] = {}  # name -> (module, name there), recorded from the imports below


class _Where:
    """What an import under `_deferred()` binds at run time: where a name lives, not its value."""

    def __init__(self, module: str, name: str = "") -> None:
        self.module, self.name = module, name

    def __getattr__(self, name: str) -> _Where:
        return _Where(self.module, name)


@contextmanager
def _deferred() -> Iterator[None]:
    """Imports from this module's body inside the block record where each name lives and import nothing."""
    real = builtins.__import__
    here = globals()

    def record(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if globals is not here or level or not fromlist:  # another module's import, on any thread
            return real(name, globals, locals, fromlist, level)
        return _Where(name)

    builtins.__import__ = record
    try:
        yield
    finally:
        builtins.__import__ = real
    for name, value in list(here.items()):
        if isinstance(value, _Where):
            _PUBLIC[name] = (value.module, value.name)
            del here[name]


with _deferred():
    from engine.backends import AUTO_ORDER as AUTO_ORDER
    from engine.backends import QUANTIZE_CHOICES as QUANTIZE_CHOICES
    from engine.documents.attach import Attached as Attached
    from engine.documents.attach import Attachments as Attachments
    from engine.documents.attach import Reattacher as Reattacher
    from engine.documents.extract import DocumentError as DocumentError
    from engine.documents.provenance import Citation as Citation
    from engine.errors import SparkError as SparkError
    from engine.fileio import atomic_write as atomic_write
    from engine.generation.constrained import Grammar as Grammar
    from engine.generation.constrained import GrammarError as GrammarError
    from engine.generation.constrained import json_schema_grammar as json_schema_grammar
    from engine.generation.loop import FinishReason as FinishReason
    from engine.generation.loop import GenerationEvent as GenerationEvent
    from engine.generation.loop import GenerationSettings as GenerationSettings
    from engine.generation.loop import PrefillProgress as PrefillProgress
    from engine.generation.reasoning import ReasoningStyle as ReasoningStyle
    from engine.generation.reasoning import Think as Think
    from engine.generation.sampling import InvalidSamplingSettings as InvalidSamplingSettings
    from engine.generation.sampling import SamplingSettings as SamplingSettings
    from engine.generation.speculative import Speculation as Speculation
    from engine.loading.model_files import DEFAULT_MODEL_NAME as DEFAULT_MODEL_NAME
    from engine.loading.model_files import default_model_path as default_model_path
    from engine.loading.model_files import display_name as display_name
    from engine.loading.sampling_defaults import ModelSampling as ModelSampling
    from engine.loading.validate import validate_gguf as validate_gguf
    from engine.memory.cascade import CascadeStats as CascadeStats
    from engine.memory.cascade import TierStats as TierStats
    from engine.openai.client import RemoteClient as RemoteClient
    from engine.openai.client import RemoteError as RemoteError
    from engine.openai.client import RemoteServer as RemoteServer
    from engine.openai.client import RemoteSession as RemoteSession
    from engine.session.engine import ChatMessage as ChatMessage
    from engine.session.engine import Engine as Engine
    from engine.session.engine import LoadReport as LoadReport
    from engine.session.engine import Session as Session
    from engine.session.engine import load as load
    from engine.session.engine import memory_factory_for as memory_factory_for
    from engine.session.file import RECOMPUTE_KIND as RECOMPUTE_KIND
    from engine.session.file import SESSION_SUFFIX as SESSION_SUFFIX
    from engine.session.file import TRANSCRIPT_KIND as TRANSCRIPT_KIND
    from engine.session.file import SessionData as SessionData
    from engine.session.file import load_session as load_session
    from engine.session.kept import DEFAULT_KEPT_BUDGET_BYTES as DEFAULT_KEPT_BUDGET_BYTES
    from engine.session.kept import KeptMemory as KeptMemory
    from engine.session.kept import KeptUsage as KeptUsage
    from engine.session.types import RecalledRecord as RecalledRecord
    from engine.version import __version__ as __version__
    from engine.vision.idefics3 import IMAGE_TOKEN as IMAGE_TOKEN
    from engine.vision.images import DecodedImage as DecodedImage
    from engine.vision.images import ImageError as ImageError
    from engine.vision.images import decode_bytes as decode_bytes
    from engine.vision.images import decode_file as decode_file
    from engine.vision.images import media_type as media_type

__all__ = ["exit_process", "prepare_process", *_PUBLIC]


def __getattr__(name: str) -> Any:
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    prepare_process()  # the engine starts running here: before the part asked for loads PyTorch
    value = getattr(importlib.import_module(where[0]), where[1])
    globals()[name] = value  # later lookups find it directly
    return value
