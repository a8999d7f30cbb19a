"""Where a converted bundle is kept: `<cache dir>/coreml/<cache key>/`, the key covering everything that changes the
bundle's bytes. The converter (coreml.convert.cached_bundle) writes there and the runtime looks there."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from engine.backends.coreml.bundle import FORMAT_VERSION, Bundle
from engine.backends.coreml.errors import PackageError
from engine.backends.coreml.programs import DEFAULT_UNITS, FUNCTIONS, MAX_CHUNK_BYTES


@dataclass(frozen=True)
class Geometry:
    """What a bundle is specialised for besides the weights."""

    slots: int
    functions: tuple[tuple[str, int], ...] = tuple(FUNCTIONS.items())
    max_chunk_bytes: int = MAX_CHUNK_BYTES


def tool_versions() -> dict[str, str]:
    import coremltools as ct
    import torch

    return {"coremltools": ct.__version__, "torch": torch.__version__}


def cache_key(fingerprint: str, geometry: Geometry, quantize: str, units: str = DEFAULT_UNITS) -> str:
    """Everything that changes the bundle's bytes: model, geometry, compression, units, format, tool versions."""
    ident = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "slots": geometry.slots,
        "functions": list(geometry.functions),
        "max_chunk_bytes": geometry.max_chunk_bytes,
        "quantize": quantize,
        "units": units,
        **tool_versions(),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def default_cache_root() -> Path:
    from engine.paths import default_cache_dir

    return default_cache_dir() / "coreml"


def cached(path: Path) -> bool:
    """Whether `path` holds the complete bundle its name keys; an unreadable entry is never trusted (the converter
    rebuilds it, atomically replacing it)."""
    if not path.is_dir():
        return False
    try:
        return Bundle.open(path).provenance.get("cache_key") == path.name
    except PackageError:
        return False


def encoder_cache_key(fingerprint: str, units: str = DEFAULT_UNITS) -> str:
    """The vision encoder's program (engine.backends.coreml.vision_runtime): fp16, no geometry, so only the model,
    the units, the format and the tool versions change its bytes."""
    ident = {"format": FORMAT_VERSION, "program": "vision-encoder", "fingerprint": fingerprint, "units": units}
    return hashlib.sha256(json.dumps({**ident, **tool_versions()}, sort_keys=True).encode()).hexdigest()[:24]
