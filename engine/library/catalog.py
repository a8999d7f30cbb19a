"""The curated catalog of models worth downloading (resources/models/catalog.json): what each is, where its GGUF
files live on the Hub, how much memory it needs, its licence and its recommended sampling.

Sizes and memory figures are estimates from the architecture (`estimate_parameters`, `memory_needed`) wherever the
exact file size was not known when the catalog was written (`size_approximate`); the exact size and sha256 come from
the Hub's metadata when a file is downloaded. `tests/engine/library/test_catalog.py` recomputes every estimate, so
the file cannot drift from the formulas here.

The catalog is read like any other input: one sentence for a malformed entry, never a traceback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import SparkError
from engine.paths import resources_dir

CATALOG_FORMAT = 1
KV_BYTES_PER_VALUE = 2  # the cascade keeps K and V in fp16
# What a running chat needs besides weights and KV: the Python runtime, PyTorch, the native kernels, the tokenizer
# and scratch buffers. Measured: a fresh chat on the default model (8 tokens, CPU backend, Linux) held 1,883 MiB of
# RSS with a 93 MiB file, so about 1.75 GiB beyond the weights (its KV included; conservative for larger models).
RUNTIME_BYTES = 1792 << 20

# Bits per weight of llama.cpp's quantizations, averaged over a whole file (K-quant mixes keep some tensors at a
# higher type), as llama.cpp's quantize tool reports them for Llama-family models: estimates for small models,
# whose embeddings are a larger share of the weights.
BITS_PER_WEIGHT: dict[str, float] = {
    "Q4_0": 4.5,
    "Q4_1": 5.0,
    "Q4_K_M": 4.85,
    "Q5_K_M": 5.7,
    "Q6_K": 6.56,
    "Q8_0": 8.5,
    "F16": 16.0,
}


class CatalogError(SparkError):
    """The model catalog is missing or malformed."""


@dataclass(frozen=True)
class Architecture:
    """The shapes that set a model's size and its KV cache per token."""

    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    context_length: int  # trained context, tokens
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k
    sliding_window: int = 0  # tokens a sliding-window layer sees (0: every layer is global)
    global_every: int = 0  # with sliding_window: every n-th layer is global (Gemma 3: 6)

    def global_layers(self) -> int:
        if not self.sliding_window or not self.global_every:
            return self.layers
        return self.layers // self.global_every

    def kv_bytes(self, tokens: int) -> int:
        """KV cache bytes for `tokens` of conversation, at most the trained context (the cascade keeps the rest in
        its bounded tiers); a sliding-window layer holds its window only."""
        tokens = min(tokens, self.context_length)
        per_token_layer = 2 * self.kv_heads * self.head_dim * KV_BYTES_PER_VALUE  # K and V
        global_layers = self.global_layers()
        local_layers = self.layers - global_layers
        local_tokens = min(tokens, self.sliding_window) if local_layers else 0
        return per_token_layer * (global_layers * tokens + local_layers * local_tokens)


@dataclass(frozen=True)
class RecommendedSampling:
    """The sampling the model's authors recommend (plain numbers the settings layer reads)."""

    temperature: float  # 0: greedy
    top_p: float  # 1.0: off
    top_k: int  # 0: off
    min_p: float  # 0.0: off
    repeat_penalty: float  # 1.0: off
    source: str  # where the numbers come from (model card, generation_config.json)


@dataclass(frozen=True)
class CatalogFile:
    quantization: str  # Q4_K_M, Q8_0...
    file: str  # the file's name in the repo
    size_bytes: int
    size_approximate: bool  # True: estimated from parameters x bits per weight; the Hub's size replaces it
    memory_4k_bytes: int  # memory_needed(size_bytes, architecture, 4096)
    memory_32k_bytes: int  # memory_needed(size_bytes, architecture, 32768)


@dataclass(frozen=True)
class CatalogModel:
    id: str  # short and stable: qwen3-4b
    name: str  # for people: Qwen3 4B
    family: str  # the loader's architecture family: qwen3, gemma3, llama, phi3
    parameters: int
    repo: str  # the Hub repo holding the GGUF files
    license: str
    description: str
    architecture: Architecture
    files: tuple[CatalogFile, ...]
    default_quantization: str
    sampling: RecommendedSampling
    bundled: bool = False  # the default model ships with the app (nothing to download)
    vision: bool = False  # takes pictures as well as text (engine.vision): the catalog's "sees images" mark
    mmproj: str | None = None  # a vision model's llama.cpp projector file in the same repo, downloaded beside it

    def file(self, quantization: str | None = None) -> CatalogFile:
        wanted = quantization or self.default_quantization
        for f in self.files:
            if f.quantization == wanted or f.file == wanted:
                return f
        known = ", ".join(f.quantization for f in self.files)
        raise CatalogError(f"{self.name} comes as {known}, not {wanted}.")


@dataclass(frozen=True)
class Catalog:
    models: tuple[CatalogModel, ...]

    def by_id(self, model_id: str) -> CatalogModel | None:
        return next((m for m in self.models if m.id == model_id), None)

    def by_repo(self, repo: str) -> CatalogModel | None:
        return next((m for m in self.models if m.repo.lower() == repo.lower()), None)

    def by_file(self, file_name: str) -> CatalogModel | None:
        """The model one of whose files is called `file_name` (a downloaded or bundled GGUF's name)."""
        return next((m for m in self.models if any(f.file == file_name for f in m.files)), None)


def estimate_parameters(arch: Architecture) -> int:
    """Parameter count of a Llama-family decoder (q/k/v/o, gated MLP, RMSNorms; tied or separate output)."""
    h = arch.hidden_size
    q = arch.heads * arch.head_dim
    kv = arch.kv_heads * arch.head_dim
    attention = h * q + 2 * h * kv + q * h
    mlp = 3 * h * arch.intermediate_size
    norms = 2 * h + (2 * arch.head_dim if arch.qk_norm else 0)
    embeddings = arch.vocab_size * h
    output = 0 if arch.tied_embeddings else arch.vocab_size * h
    return embeddings + arch.layers * (attention + mlp + norms) + h + output


def approximate_file_size(parameters: int, quantization: str) -> int:
    if quantization not in BITS_PER_WEIGHT:
        raise CatalogError(f"No size estimate for the {quantization} quantization.")
    return round(parameters * BITS_PER_WEIGHT[quantization] / 8)


def memory_needed(weight_bytes: int, arch: Architecture, tokens: int) -> int:
    """Bytes a chat of `tokens` needs: the weights as stored, the KV cache and the runtime."""
    return weight_bytes + arch.kv_bytes(tokens) + RUNTIME_BYTES


# -- reading the file ------------------------------------------------------------------------------------------


def default_catalog_path() -> Path:
    return resources_dir() / "models" / "catalog.json"


def load_catalog(path: Path | None = None) -> Catalog:
    path = path or default_catalog_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CatalogError(
            f"The model catalog {path.name} cannot be read ({exc.strerror}); reinstall MLoT Spark."
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CatalogError(f"The model catalog {path.name} is not valid JSON; reinstall MLoT Spark.") from None
    if not isinstance(data, dict) or data.get("format") != CATALOG_FORMAT or not isinstance(data.get("models"), list):
        raise CatalogError(f"The model catalog {path.name} is not in format {CATALOG_FORMAT}; reinstall MLoT Spark.")
    models = []
    for i, entry in enumerate(data["models"]):
        try:
            models.append(_model(entry))
        except (KeyError, TypeError, ValueError) as exc:
            raise CatalogError(f"Entry {i} of the model catalog is malformed ({exc}); reinstall MLoT Spark.") from None
    return Catalog(tuple(models))


def _typed(entry: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value: Any = entry.get(key, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{key} must be a {kind.__name__}")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        raise ValueError(f"{key} must not be negative")
    return value


def _model(entry: Any) -> CatalogModel:
    if not isinstance(entry, dict):
        raise TypeError("an entry must be an object")
    a = entry["architecture"]
    if not isinstance(a, dict):
        raise TypeError("architecture must be an object")
    arch = Architecture(
        hidden_size=_typed(a, "hidden_size", int),
        layers=_typed(a, "layers", int),
        heads=_typed(a, "heads", int),
        kv_heads=_typed(a, "kv_heads", int),
        head_dim=_typed(a, "head_dim", int),
        intermediate_size=_typed(a, "intermediate_size", int),
        vocab_size=_typed(a, "vocab_size", int),
        tied_embeddings=_typed(a, "tied_embeddings", bool),
        context_length=_typed(a, "context_length", int),
        qk_norm=_typed(a, "qk_norm", bool, False),
        sliding_window=_typed(a, "sliding_window", int, 0),
        global_every=_typed(a, "global_every", int, 0),
    )
    s = entry["sampling"]
    if not isinstance(s, dict):
        raise TypeError("sampling must be an object")
    sampling = RecommendedSampling(
        temperature=_typed(s, "temperature", float),
        top_p=_typed(s, "top_p", float),
        top_k=_typed(s, "top_k", int),
        min_p=_typed(s, "min_p", float),
        repeat_penalty=_typed(s, "repeat_penalty", float),
        source=_typed(s, "source", str),
    )
    if not 0.0 < sampling.top_p <= 1.0 or not 0.0 <= sampling.min_p <= 1.0 or sampling.repeat_penalty <= 0.0:
        raise ValueError("sampling values out of range")
    files = []
    for f in entry["files"]:
        if not isinstance(f, dict):
            raise TypeError("files must be objects")
        name = _typed(f, "file", str)
        if "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"{name!r} is not a plain file name")
        files.append(
            CatalogFile(
                quantization=_typed(f, "quantization", str),
                file=name,
                size_bytes=_typed(f, "size_bytes", int),
                size_approximate=_typed(f, "size_approximate", bool),
                memory_4k_bytes=_typed(f, "memory_4k_bytes", int),
                memory_32k_bytes=_typed(f, "memory_32k_bytes", int),
            )
        )
    if not files:
        raise ValueError("a model needs at least one file")
    mmproj = entry.get("mmproj")
    if mmproj is not None:
        if not isinstance(mmproj, str) or "/" in mmproj or "\\" in mmproj or not mmproj.startswith("mmproj"):
            raise ValueError(f"mmproj {str(mmproj)[:40]!r} is not a plain mmproj*.gguf file name")
        if not mmproj.lower().endswith(".gguf"):
            raise ValueError(f"mmproj {mmproj[:40]!r} is not a .gguf file")
    model = CatalogModel(
        id=_typed(entry, "id", str),
        name=_typed(entry, "name", str),
        family=_typed(entry, "family", str),
        parameters=_typed(entry, "parameters", int),
        repo=_typed(entry, "repo", str),
        license=_typed(entry, "license", str),
        description=_typed(entry, "description", str),
        architecture=arch,
        files=tuple(files),
        default_quantization=_typed(entry, "default_quantization", str),
        sampling=sampling,
        bundled=_typed(entry, "bundled", bool, False),
        vision=_typed(entry, "vision", bool, False),
        mmproj=mmproj,
    )
    model.file()  # the default quantization must be one of the files
    if model.vision != (model.mmproj is not None) and not model.bundled:
        raise ValueError("a vision model's GGUF comes with its mmproj, and only a vision model's")
    return model


def catalog_entry_json(model: CatalogModel, quantization: str) -> dict[str, Any]:
    """One catalog file as `models recommend --json` and the app show it."""
    f = model.file(quantization)
    return {
        "id": model.id,
        "name": model.name,
        "family": model.family,
        "parameters": model.parameters,
        "repo": model.repo,
        "file": f.file,
        "quantization": f.quantization,
        "size_bytes": f.size_bytes,
        "size_approximate": f.size_approximate,
        "memory_4k_bytes": f.memory_4k_bytes,
        "memory_32k_bytes": f.memory_32k_bytes,
        "license": model.license,
        "bundled": model.bundled,
        "vision": model.vision,
        "mmproj": model.mmproj,
        "sampling": {
            "temperature": model.sampling.temperature,
            "top_p": model.sampling.top_p,
            "top_k": model.sampling.top_k,
            "min_p": model.sampling.min_p,
            "repeat_penalty": model.sampling.repeat_penalty,
        },
    }
