"""Each model's own sampling defaults: what its authors recommend, in the order the model itself says it.

Per setting, the first source that gives it wins:
  1. a GGUF's `general.sampling.*` keys (llama.cpp's converter writes them from the model's generation config);
  2. a Hugging Face folder's `generation_config.json`;
  3. the model catalog (resources/models/catalog.json, the library's curated list: a file of that name, or a folder
     whose config names the catalog's repo);
  4. our generic defaults (temperature 0.7, everything else off).
A small model (under LOOP_GUARD_PARAMETERS) that no source gives a repetition penalty above 1 gets LOOP_GUARD: such
models fall into loops ("la femme, la femme, les femmes…", "a leaf's beauty, a leaf's beauty…" from SmolLM2-135M
at its recommended temperature 0.2, top-p 0.9), and an explicit 1.0 in a catalog or a converted file is the neutral
value written by default, not a finding that the model needs none.

Every source is optional and possibly hostile: a value of the wrong type or out of range is left out (the next
source, or the generic default, gives that setting); nothing here raises.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import SparkError
from engine.loading.model_files import gguf_model, is_gguf_model, read_config
from engine.model.config import ModelConfig
from engine.paths import resources_dir

GENERIC: dict[str, float | int | bool] = {
    "temperature": 0.7,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "repetition_window": 64,
    "greedy": False,
}
# The loop guard: llama.cpp's classic repeat penalty (1.1 over the last 64 tokens), for models under 1B parameters.
LOOP_GUARD = {"repetition_penalty": 1.1, "repetition_window": 64}
LOOP_GUARD_PARAMETERS = 1_000_000_000
MAX_CATALOG_BYTES = 4 << 20

# GGUF key (after "general.sampling.") -> setting
GGUF_KEYS = {
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
    "penalty_last_n": "repetition_window",
}
# generation_config.json / catalog key -> setting
CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "repeat_penalty": "repetition_penalty",
}
SOURCES = {
    "gguf": "the GGUF's sampling keys",
    "generation_config": "generation_config.json",
    "catalog": "the model catalog",
    "loop_guard": "a loop guard for small models",
}


@dataclass(frozen=True)
class ModelSampling:
    """A model's recommended sampling (plain numbers; engine.generation.sampling.SamplingSettings.from_model makes
    settings of them) and where each came from, for the app's "the model's defaults"."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    repetition_window: int
    greedy: bool
    sources: tuple[str, ...]  # SOURCES keys that gave at least one setting, in order; () = the generic defaults
    max_tokens: int | None = None  # generation_config.json's max_new_tokens, when it gives one

    @property
    def described(self) -> str:
        """Where these come from, in words ("generation_config.json and a loop guard for small models")."""
        if not self.sources:
            return "MLoT Spark's generic defaults"
        return " and ".join(SOURCES[s] for s in self.sources)


def _valid(setting: str, value: Any) -> float | int | bool | None:
    """The value if it is a usable `setting`, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if setting in ("top_k", "repetition_window"):
        return int(value) if float(value).is_integer() and 0 <= value <= 1 << 20 else None
    ok = {
        "temperature": 0.0 <= value <= 100.0,
        "top_p": 0.0 < value <= 1.0,
        "min_p": 0.0 <= value <= 1.0,
        "repetition_penalty": 0.0 < value <= 100.0,
    }[setting]
    return float(value) if ok else None


def _pick(data: Any, keys: dict[str, str]) -> dict[str, float | int | bool]:
    if not isinstance(data, dict):
        return {}
    out: dict[str, float | int | bool] = {}
    for key, setting in keys.items():
        value = _valid(setting, data.get(key))
        if value is not None and setting not in out:
            out[setting] = value
    return out


def _read_json(path: Path) -> Any:
    try:
        if path.stat().st_size > MAX_CATALOG_BYTES:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


def gguf_sampling(metadata: dict[str, Any]) -> dict[str, float | int | bool]:
    """The settings a GGUF's `general.sampling.*` keys give."""
    return _pick({k.removeprefix("general.sampling."): v for k, v in metadata.items()}, GGUF_KEYS)


def generation_config_sampling(model_dir: Path) -> dict[str, float | int | bool]:
    """The settings a folder's generation_config.json gives (do_sample false: greedy)."""
    data = _read_json(model_dir / "generation_config.json")
    out = _pick(data, CONFIG_KEYS)
    if isinstance(data, dict) and data.get("do_sample") is False:
        out["greedy"] = True
    return out


def catalog_sampling(model_path: Path, config: ModelConfig | None, catalog: Path) -> dict[str, float | int | bool]:
    """The catalog's recommended sampling for this model: the entry listing a file of this name, or (a folder)
    whose repo config.json's `_name_or_path` names. {} without a catalog or a match."""
    data = _read_json(catalog)
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list):
        return {}
    name = model_path.name
    repo = config.raw.get("_name_or_path") if config is not None else None
    for entry in models:
        if not isinstance(entry, dict):
            continue
        files = entry.get("files")
        names = {f.get("file") for f in files if isinstance(f, dict)} if isinstance(files, list) else set()
        if name in names or (isinstance(repo, str) and repo and repo == entry.get("repo")):
            return _pick(entry.get("sampling"), CONFIG_KEYS)
    return {}


def parameter_count(c: ModelConfig) -> int:
    """Weights the config implies (embeddings once when tied): enough to tell a small model from a large one."""
    attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_hidden_layers * (attn + mlp) + embed


def model_sampling(model_path: Path, catalog: Path | None = None) -> ModelSampling:
    """The model's own sampling defaults (module doc); `catalog` defaults to the bundled resources' catalog."""
    model_path = Path(model_path)
    try:
        config: ModelConfig | None = read_config(model_path)
    except SparkError:  # not loadable: loading says why; its defaults are then only what its files say
        config = None
    if is_gguf_model(model_path) and config is not None:
        found = [("gguf", gguf_sampling(gguf_model(model_path).metadata))]
        file = gguf_model(model_path).path
    else:
        found = [("generation_config", generation_config_sampling(model_path))]
        file = model_path
    catalog = catalog if catalog is not None else resources_dir() / "models" / "catalog.json"
    found.append(("catalog", catalog_sampling(file, config, catalog)))
    values: dict[str, float | int | bool] = {}
    sources: list[str] = []
    for source, given in found:
        new = {k: v for k, v in given.items() if k not in values}
        if new:
            values.update(new)
            sources.append(source)
    small = config is not None and parameter_count(config) < LOOP_GUARD_PARAMETERS
    if small and float(values.get("repetition_penalty", 1.0)) <= 1.0:
        values.update(LOOP_GUARD)
        sources.append("loop_guard")
    v = {**GENERIC, **values}
    return ModelSampling(
        temperature=float(v["temperature"]),
        top_p=float(v["top_p"]),
        top_k=int(v["top_k"]),
        min_p=float(v["min_p"]),
        repetition_penalty=float(v["repetition_penalty"]),
        repetition_window=int(v["repetition_window"]),
        greedy=bool(v["greedy"]),
        sources=tuple(sources),
        max_tokens=_max_tokens(model_path),
    )


def _max_tokens(model_dir: Path) -> int | None:
    data = _read_json(model_dir / "generation_config.json") if model_dir.is_dir() else None
    n = data.get("max_new_tokens") if isinstance(data, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
