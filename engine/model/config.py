"""Model configuration read from a Hugging Face `config.json`: the Llama family and its variants (Qwen3's per-head
q/k norms, Gemma 3's sliding-window layers and sandwich norms, Phi-3's fused projections)."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

# architecture name (config.json "architectures"[0] or "model_type") -> family flags
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False},
    "MistralForCausalLM": {"qkv_bias": False},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "Gemma3ForCausalLM": {"qkv_bias": False, "qk_norm": True, "gemma": True},
    "Phi3ForCausalLM": {"qkv_bias": False},
}
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# Vision-language folders whose text model is one of the above (its config under `text_config`, or flat as
# transformers 4 wrote Qwen2.5-VL's; its weights under `model.text_model.`, `language_model.model.` or `model.`);
# engine.vision reads the rest.
VISION_ARCHITECTURES = (
    "Idefics3ForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)
# The text model of a vision folder whose text config names no architecture of its own.
VISION_TEXT_ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM"}
# Those whose picture's tokens attend to each other both ways (transformers' token_type_ids mask).
BIDIRECTIONAL_IMAGES = ("Gemma3ForConditionalGeneration",)
# Gemma 3's published vision folders keep in `text_config` only what differs from transformers' Gemma3TextConfig
# (gemma-3-4b-it's names its width, layers, window and rope scaling): its defaults fill the rest.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}
IMAGE_ID_LIMIT = 2**31 - 1  # pictures' ids lie below it (prefix digests hash ids as int32)
# Gemma 3's sliding-window layers: every layer but each sixth, when config.json predates `layer_types`.
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` of Llama 3.x (`rope_type: llama3`), linear position interpolation, or Phi-3/Phi-4's LongRoPE
    (`longrope`: per-frequency divisors, short or long, and a factor on cos and sin)."""

    rope_type: str  # "llama3" | "linear" | "longrope"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    long_factors: tuple[float, ...] = ()  # longrope: (R/2,) divisors past the original context
    short_factors: tuple[float, ...] = ()  # longrope: (R/2,) divisors within it
    attention_factor: float = 1.0  # longrope: cos and sin are scaled by it (so scores by its square)


# rope types whose frequencies we compute; the others change attention in ways the model does not implement
UNSUPPORTED_ROPE_TYPES = ("yarn", "dynamic", "su", "ntk")


def _f32(x: float) -> float:
    """x rounded to float32: a GGUF stores rope factors so, and a folder's config then equals its GGUF's."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def _longrope(rs: dict[str, Any], d: dict[str, Any]) -> RopeScaling:
    """Phi-3/Phi-4's LongRoPE, as transformers' _compute_longrope_parameters reads it."""
    original = int(rs.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") or 0)
    long_f, short_f = rs.get("long_factor"), rs.get("short_factor")
    if original <= 0 or not isinstance(long_f, list) or not isinstance(short_f, list):
        raise ModelLoadError("config.json's longrope scaling lacks its factors or original context; it looks damaged.")
    factors = [_f32(float(x)) for x in (*long_f, *short_f)]
    if not all(math.isfinite(x) and x > 0 for x in factors):
        raise ModelLoadError("config.json's longrope factors are not all positive numbers; it looks damaged.")
    factor = rs.get("factor")
    factor = float(factor) if factor is not None else int(d.get("max_position_embeddings", original)) / original
    attention = rs.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if not math.isfinite(float(attention)) or float(attention) <= 0:
        raise ModelLoadError("config.json's longrope attention factor is not a positive number; it looks damaged.")
    n = len(long_f)
    return RopeScaling(
        "longrope",
        factor,
        original_max_position_embeddings=original,
        long_factors=tuple(factors[:n]),
        short_factors=tuple(factors[n:]),
        attention_factor=_f32(float(attention)),
    )


def read_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope base, scaling) from a config in either layout: transformers 5 keeps both under `rope_parameters`,
    transformers 4 writes top-level `rope_theta` and `rope_scaling`. The one place a rope configuration is read."""
    params = d.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ModelLoadError(
            "config.json has a rope_parameters entry that is not an object; the model folder looks damaged."
        )
    # transformers 5 may nest per-layer-type parameters ({"full_attention": {...}, "sliding_attention": {...}}):
    # the full-attention layers' are the model's rope; read_local_rope_theta reads the sliding layers' base.
    if params and "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention", next(iter(params.values())))
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
    if rtype == "longrope":
        return theta, _longrope(rs, d)
    if rtype in UNSUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"The model uses {rtype} rope scaling, which MLoT Spark does not run yet (llama3, linear and longrope are supported)."
        )
    raise ModelLoadError(f"The model's rope scaling type {rtype!r} is not supported (llama3, linear and longrope are).")


def read_rotary_dims(d: dict[str, Any], head_dim: int) -> int:
    """The rotated channels per head of a partial-rotary model (`partial_rotary_factor` < 1), else 0 (all)."""
    params = d.get("rope_parameters")
    partial = (params if isinstance(params, dict) else {}).get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial is None or float(partial) == 1.0:
        return 0
    dims = int(head_dim * float(partial))  # as transformers: int(head_dim * partial_rotary_factor)
    if not 0.0 < float(partial) < 1.0 or dims < 2 or dims % 2:
        raise ModelLoadError(
            f"config.json's partial_rotary_factor {partial} does not give an even number of rotated channels."
        )
    return dims


def read_local_rope_theta(d: dict[str, Any]) -> float:
    """Gemma 3's rope base for its sliding-window layers (unscaled), in either config layout."""
    params = d.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    theta = local.get("rope_theta") if isinstance(local, dict) else d.get("rope_local_base_freq")
    theta = float(theta if theta is not None else GEMMA3_LOCAL_ROPE_THETA)
    if not math.isfinite(theta) or theta <= 1.0:
        raise ModelLoadError(f"config.json gives a local rope base of {theta}, which is not a usable rotary base.")
    return theta


def read_layer_windows(d: dict[str, Any], arch: str, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window in tokens (0: the layer attends globally), from `layer_types` or the older keys."""
    window = d.get("sliding_window")
    types = d.get("layer_types")
    if arch == "Gemma3ForCausalLM" and types is None:
        every = d.get("sliding_window_pattern") or GEMMA3_GLOBAL_EVERY
        types = ["full_attention" if (i + 1) % int(every) == 0 else "sliding_attention" for i in range(layers)]
    elif arch == "Phi3ForCausalLM" and types is None and window:
        types = ["sliding_attention"] * layers  # transformers' Phi-3 slides every layer when sliding_window is set
    elif arch != "Gemma3ForCausalLM" and (
        not window or d.get("use_sliding_window") is False or arch in ("LlamaForCausalLM", "Qwen2ForCausalLM")
    ):
        return (0,) * layers  # Qwen2/3 slide only with use_sliding_window; older Mistral windows are ignored
    if types is None:
        return (0,) * layers
    if (
        not isinstance(types, list)
        or len(types) != layers
        or any(t not in ("full_attention", "sliding_attention") for t in types)
    ):
        raise ModelLoadError("config.json has layer_types that do not name each layer's attention; it looks damaged.")
    if "sliding_attention" in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelLoadError(
            f"config.json gives sliding_window = {str(window)[:40]}, which is not a whole number of tokens."
        )
    width = int(window) if isinstance(window, int) else 0
    return tuple(width if t == "sliding_attention" else 0 for t in types)


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
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before the rotation (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and the MLP too, and a pre-MLP norm (Gemma 3)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    query_scale: float | None = None  # attention's score scale when not head_dim**-0.5 (Gemma's query_pre_attn_scalar)
    # Per layer: its sliding window in tokens (a query sees the keys of the last `window` tokens, itself included),
    # or 0 for global attention. Empty: every layer global.
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # the sliding-window layers' own (unscaled) rope base (Gemma 3)
    # Partial rotary (Phi-4-mini: 0.75 of each head): the rotated channels R < head_dim; 0 = all of them. Loading
    # reorders q/k rows so the rotated pairs sit at (i, i + D/2) for i < R/2 (engine.loading.rotary_rows).
    rotary_dims: int = 0
    # A vision-language model's text model: ids from the vocabulary up to IMAGE_ID_LIMIT stand for pictures' tokens
    # (engine.vision.model), so memories hold them and their states may name them.
    image_ids: bool = False
    # A picture's run of ids attends to itself both ways (Gemma 3): a query there sees the run's later tokens in the
    # same forward (engine.model.slots.open_image_runs), so the run is read in one forward (generation.loop).
    images_bidirectional: bool = False
    # Multimodal rotary (Qwen2.5-VL): the rotated pairs of each head in three sections, turned by a token's time,
    # row and column position (engine.model.attention.mrope_turn). Empty: one position turns every pair.
    mrope_section: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def id_limit(self) -> int:
        """One past the largest token id a memory of this model may hold."""
        return IMAGE_ID_LIMIT if self.image_ids else self.vocab_size

    @property
    def rope_dim(self) -> int:
        """The channels of each head that rotate (R)."""
        return self.rotary_dims or self.head_dim

    @property
    def long_rope(self) -> bool:
        """LongRoPE's choice of divisors, as llama.cpp makes it for a context of the trained length: the long
        factors when the trained context exceeds the original one (our positions span up to the trained context)."""
        sc = self.rope_scaling
        return sc is not None and self.max_position_embeddings > sc.original_max_position_embeddings

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_windows) and self.layer_windows[layer] > 0

    @property
    def sliding_window(self) -> int:
        """The sliding layers' window (one size per model in every family we run), 0 when every layer is global."""
        return max(self.layer_windows, default=0)

    @property
    def plain_llama(self) -> bool:
        """Nothing beyond the Llama layer: what the native one-call decoding step and the Core ML graph implement."""
        return (
            not (
                self.qk_norm or self.sandwich_norms or self.scale_embeddings or self.query_scale or self.sliding_window
            )
            and self.hidden_act == "silu"
        )

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
        if arch in VISION_ARCHITECTURES:  # a vision-language folder: this is its text model's config
            text = d.get("text_config", d if arch in VISION_TEXT_ARCHITECTURES else None)
            if not isinstance(text, dict):
                raise ModelLoadError(f"config.json of a {arch} has no text_config object; it looks damaged.")
            if arch == "Gemma3ForConditionalGeneration":
                text = {**GEMMA3_TEXT_DEFAULTS, **text}
            inner = VISION_TEXT_ARCHITECTURES.get(arch)
            if inner is not None:
                text = {k: v for k, v in text.items() if k not in ("text_config", "vision_config", "model_type")}
                text["architectures"] = [inner]
                section = _mrope_section(text)
                text = _without_mrope(text)
                cfg = cls.from_dict(text)
                if sum(section) != cfg.head_dim // 2:
                    raise ModelLoadError(
                        f"config.json's mrope_section {list(section)} does not cover the {cfg.head_dim // 2} rotated "
                        "pairs of a head; it looks damaged."
                    )
                return dataclasses.replace(cfg, image_ids=True, mrope_section=section, raw=dict(d))
            text_config = cls.from_dict(text)
            return dataclasses.replace(text_config, image_ids=True, images_bidirectional=arch in BIDIRECTIONAL_IMAGES)
        if arch not in SUPPORTED_ARCHITECTURES:
            known = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise ModelLoadError(
                f"The model architecture {arch or d.get('model_type')!r} is not supported; "
                f"MLoT Spark runs Llama-family models ({known})."
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        gemma = family.get("gemma", False)
        act = d.get("hidden_activation" if gemma else "hidden_act") or d.get("hidden_act") or "silu"
        act = "silu" if act == "swish" else act
        if act not in ACTIVATIONS or (act == "gelu_pytorch_tanh") != gemma:
            raise ModelLoadError(
                f"The model uses activation {act!r}, which a {arch} does not; config.json looks damaged."
            )
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if d.get(key) is not None:
                raise ModelLoadError(f"The model caps its logits ({key}), which MLoT Spark does not run.")
        if gemma and d.get("use_bidirectional_attention"):
            raise ModelLoadError("The model attends bidirectionally (an embedding model); MLoT Spark runs causal ones.")
        _check_sizes(d)
        try:
            n_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            head_dim = int(d.get("head_dim") or hidden // n_heads)
            rope_theta, scaling = read_rope(d)
            rotary = read_rotary_dims(d, head_dim)
            if scaling is not None and scaling.rope_type == "longrope":
                half = (rotary or head_dim) // 2
                if len(scaling.long_factors) != half or len(scaling.short_factors) != half:
                    raise ModelLoadError(
                        f"config.json's longrope factors are not {half} each (half the rotated channels); it looks damaged."
                    )
            layers = int(d["num_hidden_layers"])
            windows = read_layer_windows(d, arch, layers)
            # A window as long as the trained context hides nothing (positions stay inside it): global attention.
            # Phi-4-mini's config slides every layer over 262,144 tokens of a 131,072-token context.
            max_positions = int(d.get("max_position_embeddings", 2048))
            windows = tuple(0 if w >= max_positions else w for w in windows)
            qpas = d.get("query_pre_attn_scalar")
            query_scale = float(qpas) ** -0.5 if gemma and qpas is not None and float(qpas) != head_dim else None
            return cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=n_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
                head_dim=head_dim,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
                qkv_bias=family["qkv_bias"] or bool(d.get("attention_bias", False)),
                o_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                hidden_act=act,
                qk_norm=family.get("qk_norm", False),
                sandwich_norms=gemma,
                scale_embeddings=gemma,
                query_scale=query_scale,
                layer_windows=windows if any(windows) else (),
                rope_local_theta=read_local_rope_theta(d) if gemma else None,
                rotary_dims=rotary,
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


def _rope_entries(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in (d.get("rope_parameters"), d.get("rope_scaling")) if isinstance(r, dict)]


def _mrope_section(d: dict[str, Any]) -> tuple[int, ...]:
    """Qwen2.5-VL's (t, h, w) section sizes in rotated pairs, from rope_parameters (transformers 5) or rope_scaling
    (transformers 4, `type: mrope`)."""
    for r in _rope_entries(d):
        section = r.get("mrope_section")
        if section is not None:
            if (
                not isinstance(section, list)
                or len(section) != 3
                or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= 512 for s in section)
            ):
                raise ModelLoadError("config.json's mrope_section is not three whole numbers; it looks damaged.")
            return tuple(section)
    raise ModelLoadError("config.json of a Qwen2.5-VL model has no mrope_section; it looks damaged.")


def _without_mrope(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with its rope entries' mrope keys removed (an mrope type read as the default rope it rotates with)."""
    out = dict(d)
    for key in ("rope_parameters", "rope_scaling"):
        r = out.get(key)
        if isinstance(r, dict):
            r = {k: v for k, v in r.items() if k not in ("mrope_section", "mrope_interleaved")}
            if r.get("rope_type", r.get("type")) == "mrope":
                r = {**{k: v for k, v in r.items() if k not in ("type", "rope_type")}, "rope_type": "default"}
            out[key] = r
    return out


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
