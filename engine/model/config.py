"""Model configuration read from a Hugging Face `config.json` (Llama family)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

# architecture name (config.json "architectures"[0] or "model_type") -> family flags
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False},
    "MistralForCausalLM": {"qkv_bias": False},
    "Qwen2ForCausalLM": {"qkv_bias": True},
}
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` of Llama 3.x (`rope_type: llama3`) or linear position interpolation."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


# rope types whose frequencies we compute; the others change attention in ways the model does not implement
UNSUPPORTED_ROPE_TYPES = ("yarn", "dynamic", "longrope", "su", "ntk")


def read_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope base, scaling) from a config in either layout: transformers 5 keeps both under `rope_parameters`,
    transformers 4 writes top-level `rope_theta` and `rope_scaling`. The one place a rope configuration is read."""
    params = d.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ModelLoadError(
            "config.json has a rope_parameters entry that is not an object; the model folder looks damaged."
        )
    # transformers 5 may nest per-layer-type parameters ({"full_attention": {...}}); Llama-family models have one.
    if params and "rope_theta" not in params and len(params) == 1 and isinstance(next(iter(params.values())), dict):
        params = next(iter(params.values()))
    params = params or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    if not math.isfinite(theta) or theta <= 1.0:
        raise ModelLoadError(
            f"config.json gives rope_theta {theta}, which is not a usable rotary base (it must be above 1)."
        )
    rs = params if params.get("rope_type", params.get("type")) not in (None, "default") else d.get("rope_scaling")
    if not rs:
        return theta, None
    if not isinstance(rs, dict):
        raise ModelLoadError(
            "config.json has a rope_scaling entry that is not an object; the model folder looks damaged."
        )
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype in (None, "default"):
        return theta, None
    if rtype == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs.get("low_freq_factor", 1.0)),
            float(rs.get("high_freq_factor", 4.0)),
            int(rs.get("original_max_position_embeddings", 8192)),
        )
    if rtype == "linear":
        return theta, RopeScaling("linear", float(rs["factor"]))
    if rtype in UNSUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"The model uses {rtype} rope scaling, which MLoT Spark does not run yet (llama3 and linear are supported)."
        )
    raise ModelLoadError(f"The model's rope scaling type {rtype!r} is not supported (llama3 and linear are).")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors (D/2,) as a GGUF stores Llama 3 scaling (its `rope_freqs` tensor); None elsewhere.
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def with_rope_freq_factors(self, factors: tuple[float, ...]) -> ModelConfig:
        return dataclasses.replace(
            self, rope_freq_factors=factors, raw={**self.raw, "rope_freq_factors": list(factors)}
        )

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        arch = (d.get("architectures") or [None])[0] or MODEL_TYPES.get(str(d.get("model_type")), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            known = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise ModelLoadError(
                f"The model architecture {arch or d.get('model_type')!r} is not supported; "
                f"MLoT Spark runs Llama-family models ({known})."
            )
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelLoadError(
                f"The model uses activation {act!r}; only SwiGLU (silu) Llama-family models are supported."
            )
        _check_sizes(d)
        try:
            n_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            rope_theta, scaling = read_rope(d)
            return cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=n_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
                head_dim=int(d.get("head_dim") or hidden // n_heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=SUPPORTED_ARCHITECTURES[arch]["qkv_bias"] or bool(d.get("attention_bias", False)),
                o_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                raw=dict(d),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(
                f"config.json is missing or has a bad value for {exc}; the model folder looks incomplete."
            ) from None

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            if Path(path).stat().st_size > MAX_CONFIG_BYTES:
                raise ModelLoadError(f"{path} is larger than any model config; the model folder looks damaged.")
            data = json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=_no_constant)
        except FileNotFoundError:
            raise ModelLoadError(f"{path.parent} has no config.json; choose a Hugging Face model folder.") from None
        except RecursionError:
            raise ModelLoadError(
                f"{path} is nested too deeply to be a model config; the model folder looks damaged."
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(
                f"{path} is not valid JSON ({exc.__class__.__name__}); the download may be incomplete."
            ) from None
        if not isinstance(data, dict):
            raise ModelLoadError(f"{path} does not hold a JSON object; it is not a model config.")
        return cls.from_dict(data)


MAX_CONFIG_BYTES = 16 * 1024 * 1024
# config.json's sizes: (key, smallest, largest). Bounds far beyond any Llama-family model, so that a damaged or
# hostile file is refused in one sentence instead of dividing by zero or sizing a huge table (the rotary table
# has max_position_embeddings rows).
SIZE_LIMITS: tuple[tuple[str, int, int], ...] = (
    ("vocab_size", 1, 1 << 24),
    ("hidden_size", 1, 1 << 16),
    ("intermediate_size", 1, 1 << 20),
    ("num_hidden_layers", 1, 1024),
    ("num_attention_heads", 1, 1024),
    ("num_key_value_heads", 1, 1024),
    ("head_dim", 1, 1024),
    ("max_position_embeddings", 1, 1 << 20),
)


def _no_constant(name: str) -> None:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


def _check_sizes(d: dict[str, Any]) -> None:
    """Every size in range and a whole number (no bool, list, string, NaN or Infinity); heads divide evenly."""
    for key, lo, hi in SIZE_LIMITS:
        value = d.get(key)
        if value is None and key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            continue  # optional: derived or defaulted
        whole = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and math.isfinite(value) and value.is_integer()
        )
        if not whole or not lo <= float(value) <= hi:  # type: ignore[arg-type]  # whole: an int or integral float
            raise ModelLoadError(
                f"config.json gives {key} = {str(value)[:40]}, which is not a whole number from {lo} to {hi}; the model folder looks damaged."
            )
    heads, kv = int(d["num_attention_heads"]), int(d.get("num_key_value_heads") or d["num_attention_heads"])
    if heads % kv:
        raise ModelLoadError(
            f"config.json gives {heads} attention heads for {kv} key/value heads, which do not divide evenly."
        )
    eps = d.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ModelLoadError(f"config.json gives rms_norm_eps = {str(eps)[:40]}, which is not a small positive number.")


# generation_config.json key -> SamplingSettings field (the model author's defaults; CLI flags and the UI override)
GENERATION_KEYS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def generation_defaults(model_dir: Path) -> dict[str, Any]:
    """Sampling defaults from the model's generation_config.json ({} when absent or unreadable: it is optional)."""
    try:
        data = json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict):
        return {}
    out: dict[str, Any] = {
        field: data[key] for key, field in GENERATION_KEYS.items() if isinstance(data.get(key), (int, float))
    }
    if data.get("do_sample") is False:
        out["greedy"] = True
    if isinstance(data.get("max_new_tokens"), int):
        out["max_tokens"] = data["max_new_tokens"]
    return out
