"""What a server of many models serves and how it loads one, shared by `serve` (engine.cli.serve) and the app's
Local Server: the servable list (the default model, the paths given, the library's models) and a loader that loads a
model the way the settings say (backend, weights, KV type, prefix cache, hardware policy)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.hw import HardwarePolicy, this_machine_policy
from engine.model.kv_types import KVType
from engine.openai.metrics import Metrics
from engine.openai.pool import Loader, Servable
from engine.openai.service import ModelService, ServeConfig, served_name
from engine.session.engine import Engine, memory_factory_for


class LibraryModel(Protocol):
    """A downloaded model as the library lists it (engine.library.store.LocalModel): its GGUF file at `path`."""

    @property
    def name(self) -> str: ...
    @property
    def path(self) -> Path: ...
    @property
    def size_bytes(self) -> int: ...


@dataclass(frozen=True)
class LoadSettings:
    """How every model of the server is loaded (the CLI's model flags, the app's Settings)."""

    backend: str = "auto"
    quantize: str = "auto"
    kv_type: KVType = KVType.F16
    cache_dir: Path | None = None  # the persistent (L3) prefix cache's folder (None: the default)
    prefix_cache: bool = True
    policy: HardwarePolicy | None = None  # None: this machine's, asked at each load
    projectors: tuple[tuple[Path, Path], ...] = ()  # (model, its projector file) given with --mmproj


def model_size(path: Path) -> int:
    """Bytes of a model file, or of a folder's files (0 when it cannot be read: only a hint for the pool)."""
    try:
        return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:
        return 0


def servable_models(default: Servable, extra: Iterable[Path], library: Iterable[LibraryModel] = ()) -> list[Servable]:
    """The default model first, then each path given, then the library's models (a name given twice: the first)."""
    out = {default.name: default}
    for path in extra:
        out.setdefault(served_name(path), Servable(served_name(path), path, model_size(path)))
    for m in library:
        out.setdefault(m.name, Servable(m.name, m.path.parent, m.size_bytes))
    return list(out.values())


def loader_for(settings: LoadSettings) -> Loader:
    """Loads a model as `settings` say, refusing one the machine's memory cannot hold (InsufficientMemory: the pool
    gives back an idle model and tries again)."""

    def load(servable: Servable, config: ServeConfig, metrics: Metrics) -> ModelService:
        if servable.path is None:
            raise ValueError(f"{servable.name} has no path to load it from")
        policy = settings.policy if settings.policy is not None else this_machine_policy()
        factory = memory_factory_for(
            servable.path, cache_dir=settings.cache_dir, prefix_cache=settings.prefix_cache, policy=policy
        )
        engine = Engine.load(
            servable.path,
            settings.backend,
            memory_factory=factory,
            policy=policy,
            quantize=settings.quantize,
            kv_type=settings.kv_type,
            mmproj=dict(settings.projectors).get(servable.path),
        )
        return ModelService(
            engine.locked_fork(), engine.tokenizer, engine.memory_factory, config, None, metrics, vision=engine.vision
        )

    return load
