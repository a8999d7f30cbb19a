"""A converted model on disk: a folder of Core ML programs in pieces, plus a JSON manifest.

    BUNDLE/bundle.json            provenance and layout (validated by one schema before anything is opened)
    BUNDLE/chunk_<i>.mlpackage    decoder layers [first, last) of chunk i (multifunction: prefill/prefill_8/decode)
    BUNDLE/head.mlpackage         final norm + LM head split ≤ 16384 classes (same functions)
    BUNDLE/embed.bin              the input embedding, raw fp16 (V, C), only when it is not tied to the LM head
    BUNDLE/<name>.mlmodelc        compiled programs, made once on a Mac (runtime) or shipped by `make app`

File names are fixed: nothing read from bundle.json becomes a path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.backends.coreml.errors import PackageError
from engine.backends.coreml.package import Package
from engine.model.config import ModelConfig

MANIFEST = "bundle.json"
HEAD = "head"
EMBED_FILE = "embed.bin"
FORMAT_VERSION = "2"  # bump when the programs' inputs, outputs or state layout change: invalidates the cache
REQUIRED = (
    "format",
    "fingerprint",
    "architecture",
    "config",
    "slots",
    "functions",
    "chunks",
    "vocab_pieces",
    "quantize",
    "units",
    "tied",
    "coremltools",
    "torch",
    "cache_key",
)
MAX_CHUNKS = 1024


def chunk_name(i: int) -> str:
    return f"chunk_{i}"


@dataclass(frozen=True)
class Bundle:
    path: Path
    provenance: dict[str, Any]
    config: ModelConfig
    chunks: tuple[tuple[int, int], ...]  # [first, last) layers per chunk
    functions: dict[str, int]
    vocab_pieces: tuple[tuple[int, int], ...]
    slots: int

    @classmethod
    def open(cls, path: str | Path) -> Bundle:
        path = Path(path).expanduser()
        manifest = path / MANIFEST
        if not manifest.is_file():
            raise PackageError(
                f"{path} is not an MLoT Spark Core ML bundle (no {MANIFEST}); convert it with `python -m coreml convert`."
            )
        try:
            prov = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raise PackageError(f"The {MANIFEST} of {path.name} is unreadable; convert the model again.") from None
        return cls(path, *_validate(prov, path.name))

    def package_path(self, name: str) -> Path:
        return self.path / f"{name}.mlpackage"

    def compiled_path(self, name: str) -> Path:
        return self.path / f"{name}.mlmodelc"

    @property
    def program_names(self) -> list[str]:
        return [chunk_name(i) for i in range(len(self.chunks))] + [HEAD]

    def package(self, name: str) -> Package:
        return Package.open(self.package_path(name))

    @property
    def tied(self) -> bool:
        return bool(self.provenance["tied"])

    @property
    def quantize(self) -> str:
        return str(self.provenance["quantize"])

    @property
    def units(self) -> str:
        return str(self.provenance["units"])

    def total_bytes(self) -> int:
        """Every byte of the bundle except compiled programs (what a conversion writes)."""
        return sum(
            f.stat().st_size
            for f in self.path.rglob("*")
            if f.is_file() and not any(p.endswith(".mlmodelc") for p in f.relative_to(self.path).parts)
        )

    def weight_bytes(self) -> int:
        """The weight files: each program's weights/weight.bin and the host embedding."""
        files = [self.package(n).weights_path for n in self.program_names] + [self.path / EMBED_FILE]
        return sum(f.stat().st_size for f in files if f.is_file())


Ranges = tuple[tuple[int, int], ...]


def _validate(prov: object, name: str) -> tuple[dict[str, Any], ModelConfig, Ranges, dict[str, int], Ranges, int]:
    def bad(what: str) -> PackageError:
        return PackageError(f"The {MANIFEST} of {name} {what}; convert the model again.")

    if not isinstance(prov, dict):
        raise bad("is not a JSON object")
    missing = [k for k in REQUIRED if k not in prov]
    if missing:
        raise bad(f"lacks {missing[0]!r}")
    if prov["format"] != FORMAT_VERSION:
        raise bad(f"has format {prov['format']!r}, not {FORMAT_VERSION}")
    if not isinstance(prov["config"], dict):
        raise bad("has no model config")
    config = ModelConfig.from_dict(prov["config"])
    L, V = config.num_hidden_layers, config.vocab_size
    slots = prov["slots"]
    if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= 1 << 20:
        raise bad("has an invalid slot count")
    fns = prov["functions"]
    if (
        not isinstance(fns, dict)
        or not fns
        or not all(isinstance(k, str) and isinstance(v, int) and 1 <= v <= 4096 for k, v in fns.items())
    ):
        raise bad("has invalid functions")
    chunks = prov["chunks"]
    if not isinstance(chunks, list) or not 1 <= len(chunks) <= MAX_CHUNKS:
        raise bad("has an invalid chunk list")
    at = 0
    for c in chunks:
        if not (
            isinstance(c, list) and len(c) == 2 and all(isinstance(x, int) for x in c) and c[0] == at and c[1] > at
        ):
            raise bad("has chunks that do not cover the layers in order")
        at = c[1]
    if at != L:
        raise bad(f"covers {at} layers, the model has {L}")
    pieces = prov["vocab_pieces"]
    at = 0
    if not isinstance(pieces, list) or not pieces:
        raise bad("has no vocabulary pieces")
    for p in pieces:
        if not (
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p) and p[0] == at and p[1] > at
        ):
            raise bad("has vocabulary pieces that do not cover the vocabulary in order")
        at = p[1]
    if at != V:
        raise bad(f"covers {at} classes, the model has {V}")
    return prov, config, tuple((c[0], c[1]) for c in chunks), dict(fns), tuple((p[0], p[1]) for p in pieces), slots
