"""Read a GGUF model file (llama.cpp's format) as a `ModelConfig`, a state dict and the raw quantized blocks.

The file is memory-mapped through the `gguf` package. Its metadata becomes a Hugging Face-style config (so one
validator, `ModelConfig.from_dict`, checks both kinds of model); its tensors are renamed to Hugging Face names and
q/k rows are put back in Hugging Face's rotary order, undoing the permutation llama.cpp's converter applies.

Block-quantized tensors are kept as `StoredTensor`s (views of the mapping, rows in Hugging Face order) for backends
that run them as stored; `dequantized_state` turns each into fp32 one tensor at a time, so at most one fp32 copy of
the weights exists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import re
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import ModelLoadError
from engine.loading.gguf_header import TensorInfo, read_header, tensor_view
from engine.loading.gguf_validate import check_metadata, check_tensors
from engine.loading.rotary_rows import reorder_rows
from engine.model.config import ModelConfig
from engine.model.quant import BlockType, StoredTensor, check_stored, scales_finite

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"

# general.architecture -> Hugging Face architecture, and whether llama.cpp's converter permuted q/k rows for it
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen2vl": ("Qwen2ForCausalLM", False),  # Qwen2.5-VL's text model: Qwen2 with multimodal rotary sections
    "qwen3": ("Qwen3ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
    "phi3": ("Phi3ForCausalLM", False),
}
# llama.cpp's Gemma 3 constants, which its GGUFs do not store: every sixth layer global, the others sliding with
# this rope base; the 62-layer (27B) model scales queries by (hidden / heads)**-0.5 instead of head_dim**-0.5.
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62
# llama.cpp's multimodal rotary sections (`qwen2vl.rope.dimension_sections`): rotated pairs turned by the token's
# (t, h, w) positions and a fourth section Qwen2-VL and Qwen2.5-VL leave empty.
MROPE_SECTIONS = 4

# Tensor types we read: float types as is, block types dequantized here (or run as stored by a backend that can).
FLOAT_TYPES = ("F32", "F16", "BF16")
# The tokenizer's per-token arrays: GGUFModel.tokenizer_metadata hands them over instead of keeping them.
VOCABULARY_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
)
BLOCK_TYPES = (
    *("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
    *("IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0"),
)

_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORM_NAMES: dict[str, str] = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Per architecture, names that differ from Llama's (Gemma's four norms keep their Hugging Face meanings; its GGUF
# norms already hold the 1 + w they scale by, as engine.loading.weights.hf_family_state makes them).
_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    "qwen3": _QK_NORM_NAMES,
    "gemma3": {
        **_QK_NORM_NAMES,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
# Fused GGUF tensors (Phi-3) -> the Hugging Face tensors their rows hold, in order (split by _split_rows).
_FUSED: dict[str, dict[str, tuple[str, ...]]] = {
    "phi3": {
        "attn_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "ffn_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    },
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# Tensors a converter may add that the network does not use (rope_freqs is read into the config instead).
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class _Tensor:
    hf_name: str
    gguf_name: str
    qtype: str
    shape: tuple[int, ...]  # torch order
    data: np.ndarray  # memory-mapped: float types in their dtype, block types as (rows, bytes) uint8
    heads: int  # > 0: rows to un-permute (q/k of a permuted architecture), per this many heads


def is_gguf_file(path: Path) -> bool:
    """A file whose first four bytes are GGUF's magic (the suffix alone is not trusted)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows (n_head*D, ...) from llama.cpp's interleaved rotary order back to Hugging Face's half-split order.

    Works on float rows and on rows of quantization blocks alike: it only reorders whole rows."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFModel:
    """One opened GGUF file: metadata, config and tensors (nothing is read until used)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        # Every count, length and offset checked against the file before anything is allocated for them.
        self.header = read_header(self.path)
        try:
            # copy-on-write: tensors are writable views that never write back
            with self.path.open("rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{self.path.name} cannot be mapped ({exc.__class__.__name__}).") from None
        self._mapping: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8)
        self.metadata: dict[str, Any] = dict(self.header.metadata)
        self.architecture = str(self.metadata.get("general.architecture", ""))
        self.config = self._config()
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and len(tokens) > self.config.vocab_size:
            raise ModelLoadError(
                f"{self.path.name} has {len(tokens):,} tokens in tokenizer.ggml.tokens but embeds only {self.config.vocab_size:,}."
            )
        check_tensors(
            self.path.name, ((t.gguf_name, t.hf_name, t.shape) for t in self._tensors()), self.config, self.architecture
        )
        # The vocabulary's arrays leave the kept metadata (tokenizer_metadata): about 14 MB of Python objects on a
        # 49k vocabulary, which nothing reads once the tokenizer is built.
        self._vocabulary: dict[str, Any] | None = {
            key: self.metadata.pop(key) for key in VOCABULARY_KEYS if key in self.metadata
        }
        for key in VOCABULARY_KEYS:
            self.header.metadata.pop(key, None)

    def tokenizer_metadata(self) -> dict[str, Any]:
        """Every `tokenizer.*` key of the file, the vocabulary's arrays included (for building its tokenizer). The
        first call hands over the arrays read when the file was opened; later ones read the header again, held to
        the vocabulary the opened file embeds."""
        vocabulary, self._vocabulary = self._vocabulary, None
        if vocabulary is None:
            again = read_header(self.path).metadata
            vocabulary = {key: again[key] for key in VOCABULARY_KEYS if key in again}
            tokens = vocabulary.get("tokenizer.ggml.tokens")
            if isinstance(tokens, list) and len(tokens) > self.config.vocab_size:
                raise ModelLoadError(f"{self.path.name} changed on disk while open; open it again.")
        return {**{k: v for k, v in self.metadata.items() if k.startswith("tokenizer.")}, **vocabulary}

    def release_pages(self) -> None:
        """Give back the pages of the file this process has read, once a backend holds its own copy of the weights:
        without this the weights count twice in the resident set, once as the backend's copy and once as the
        mapping's pages. Views stay valid; a later read faults its pages back in from the file.

        Only the ranges of tensors that are never used in place: all but F32 matrices, which may be model
        parameters viewing the mapping (dropping a page of this copy-on-write mapping would drop a write to it);
        the loader copies the rest (dequantized_state) or the backend does."""
        ranges: list[list[int]] = []
        for t in sorted(self.header.tensors, key=lambda t: t.offset):
            start, end = self.header.data_offset + t.offset, self.header.data_offset + t.offset + t.nbytes
            if t.type_name == "F32" and len(t.dims) > 1:
                continue
            if ranges and ranges[-1][1] == start:  # adjacent: one range (tensors align to 32 bytes, not pages)
                ranges[-1][1] = end
            else:
                ranges.append([start, end])
        for start, end in ranges:
            self._release(start, end)

    def _release(self, start: int, end: int) -> None:
        """Drop the whole pages of the mapping inside bytes [start, end) from this process's resident set."""
        advice = getattr(mmap, "MADV_DONTNEED", None)  # Linux drops them; Darwin deactivates them
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, end // page * page
        if advice is not None and last > first:
            with contextlib.suppress(OSError):
                self._mmap.madvise(advice, first, last - first)

    def _releaser(self, view: np.ndarray) -> Callable[[int, int], None] | None:
        """For a block tensor's bytes viewed in place (not a reordered copy): what gives the pages of its bytes
        [lo, hi) back."""
        if not view.flags.c_contiguous or not np.shares_memory(view, self._mapping):
            return None
        start = view.ctypes.data - self._mapping.ctypes.data
        return lambda lo, hi: self._release(start + lo, start + hi)

    # -- metadata ----------------------------------------------------------------------------------------------
    def _key(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def _config(self) -> ModelConfig:
        arch = self.architecture
        if arch not in ARCHITECTURES:
            if not arch and not self.header.tensors:
                raise ModelLoadError(
                    f"{self.path.name} holds no model (it is a vocabulary-only GGUF); choose a GGUF with weights."
                )
            known = ", ".join(ARCHITECTURES)
            raise ModelLoadError(
                f"{self.path.name} is a {arch[:40] or 'unknown'!r} model; MLoT Spark runs GGUF models of the {known} families."
            )
        if not self.header.tensors:
            raise ModelLoadError(
                f"{self.path.name} holds no tensors (a vocabulary-only GGUF); choose a GGUF with weights."
            )
        names = {t.name for t in self.header.tensors}
        check_metadata(self.path.name, self.metadata, arch)
        try:
            hidden = int(self._key("embedding_length"))
            heads = int(self._key("attention.head_count"))
            head_dim = int(self._key("attention.key_length", hidden // max(heads, 1)))
            tokens = self.metadata.get("tokenizer.ggml.tokens")
            vocab = int(self._key("vocab_size", len(tokens) if isinstance(tokens, list) else 0))
            d: dict[str, Any] = {
                "architectures": [ARCHITECTURES[arch][0]],
                "vocab_size": vocab,
                "hidden_size": hidden,
                "intermediate_size": int(self._key("feed_forward_length")),
                "num_hidden_layers": int(self._key("block_count")),
                "num_attention_heads": heads,
                "num_key_value_heads": int(self._key("attention.head_count_kv", heads)),
                "head_dim": head_dim,
                "max_position_embeddings": int(self._key("context_length")),
                "rms_norm_eps": float(self._key("attention.layer_norm_rms_epsilon", 1e-5)),
                "rope_parameters": {"rope_theta": float(self._key("rope.freq_base", 10000.0)), **self._rope_scaling()},
                "tie_word_embeddings": "output.weight" not in names,
                "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
                "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
                **self._family_keys(hidden, heads, head_dim),
            }
        except (TypeError, ValueError):
            raise ModelLoadError(
                f"{self.path.name} lacks or garbles {arch} metadata (sizes, heads, context); the file is incomplete."
            ) from None
        rope_dims = self._key("rope.dimension_count", head_dim)
        if not isinstance(rope_dims, int) or not 0 < rope_dims <= head_dim:
            raise ModelLoadError(
                f"{self.path.name} rotates {rope_dims} of {head_dim} channels per head; the file is damaged."
            )
        if rope_dims != head_dim:  # partial rotary (Phi-4-mini)
            d["rope_parameters"]["partial_rotary_factor"] = rope_dims / head_dim
        config = ModelConfig.from_dict(d)
        if arch == "qwen2vl":
            section = self._mrope_section(config.head_dim)
            config = dataclasses.replace(
                config, mrope_section=section, raw={**config.raw, "mrope_section": list(section)}
            )
        factors = self._rope_freq_factors(config)
        if factors is not None:
            config = config.with_rope_freq_factors(factors)
        return config

    def _family_keys(self, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
        """config.json keys of the architectures beyond Llama's (sliding windows, Gemma's activation and scale)."""
        window = self._key("attention.sliding_window")
        keys: dict[str, Any] = {}
        if window is not None:
            keys["sliding_window"] = int(window)
        if self.architecture == "gemma3":
            layers = int(self._key("block_count"))
            keys |= {
                "hidden_activation": "gelu_pytorch_tanh",
                "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
                "sliding_window_pattern": GEMMA3_GLOBAL_EVERY,
                "query_pre_attn_scalar": hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim,
            }
        elif self.architecture == "qwen3" and window is not None:
            keys["use_sliding_window"] = False  # as transformers' Qwen3 by default: the window is not used
        if self.architecture == "phi3" and any(
            t.name in ("rope_factors_long.weight", "rope_factors_short.weight") for t in self.header.tensors
        ):
            keys["rope_parameters"] = self._longrope()
        return keys

    def _longrope(self) -> dict[str, Any]:
        """Phi-3/Phi-4's LongRoPE as llama.cpp's converter stores it: the short and long divisors as F32 tensors,
        the original context and the attention factor as keys; in config.json's words (ModelConfig checks them)."""
        factors: dict[str, list[float]] = {}
        for t in self.header.tensors:
            if t.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
                if t.type_name != "F32" or len(t.dims) != 1 or not 0 < t.dims[0] <= 1 << 16:
                    raise ModelLoadError(
                        f"{self.path.name} stores {t.name} in a shape or type it cannot have; the file is damaged."
                    )
                values = np.asarray(tensor_view(self._mapping, self.header, t), dtype=np.float32).reshape(-1)
                factors[t.name.split(".")[0].removeprefix("rope_factors_")] = [float(v) for v in values]
        original = self._key("rope.scaling.original_context_length")
        if set(factors) != {"long", "short"} or not isinstance(original, int):
            raise ModelLoadError(
                f"{self.path.name} has LongRoPE factors without both sets or its original context; the file is incomplete."
            )
        params: dict[str, Any] = {
            "rope_type": "longrope",
            "rope_theta": float(self._key("rope.freq_base", 10000.0)),
            "long_factor": factors["long"],
            "short_factor": factors["short"],
            "original_max_position_embeddings": original,
        }
        attn = self._key("rope.scaling.attn_factor")
        if attn is not None:
            params["attention_factor"] = float(attn)
        return params

    def _mrope_section(self, head_dim: int) -> tuple[int, ...]:
        """transformers' mrope_section (t, h, w) from llama.cpp's four sections, which count rotated pairs too."""
        key = f"{self.architecture}.rope.dimension_sections"
        sections = self.metadata.get(key)
        if (
            not isinstance(sections, list)
            or len(sections) != MROPE_SECTIONS
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= head_dim for s in sections)
        ):
            raise ModelLoadError(f"{self.path.name} lacks {key} as four whole numbers; the file is incomplete.")
        if sections[3] or sum(sections) != head_dim // 2:
            raise ModelLoadError(
                f"{self.path.name}'s {key} {sections} do not split the {head_dim // 2} rotated pairs of a head into "
                "time, height and width; the file is damaged."
            )
        return tuple(sections[:3])

    def _rope_scaling(self) -> dict[str, Any]:
        kind = self._key("rope.scaling.type", "none")
        if kind in ("none", None):
            return {}
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self._key("rope.scaling.factor", 1.0))}
        return {"rope_type": str(kind)}  # yarn and others: ModelConfig refuses them in one sentence

    def _rope_freq_factors(self, config: ModelConfig) -> tuple[float, ...] | None:
        """Llama 3's rope scaling, which llama.cpp's converter stores as a (D/2,) `rope_freqs` tensor."""
        for t in self.header.tensors:
            if t.name == "rope_freqs.weight":
                if t.type_name != "F32":
                    raise ModelLoadError(
                        f"{self.path.name} stores rope_freqs as {t.type_name}, not F32; the file is damaged."
                    )
                values = np.asarray(tensor_view(self._mapping, self.header, t), dtype=np.float32).reshape(-1)
                if values.shape[0] != config.head_dim // 2 or not np.all(np.isfinite(values)) or np.any(values <= 0):
                    raise ModelLoadError(
                        f"{self.path.name} has a rope_freqs tensor that does not fit the model; the file is damaged."
                    )
                return tuple(float(v) for v in values)
        return None

    # -- tensors -----------------------------------------------------------------------------------------------
    def _tensors(self) -> Iterator[_Tensor]:
        permuted = ARCHITECTURES[self.architecture][1]
        cfg = self.config
        layer_names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(self.architecture, {})}
        fused = _FUSED.get(self.architecture, {})
        for t in self.header.tensors:
            if t.name in _IGNORED:
                continue
            m = _LAYER_RE.fullmatch(t.name)
            if m and m.group(2) in fused:
                yield from self._split_rows(t, [f"model.layers.{m.group(1)}.{n}" for n in fused[m.group(2)]])
                continue
            if m and m.group(2) in layer_names:
                hf = f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
            elif t.name in _GLOBAL_NAMES:
                hf = _GLOBAL_NAMES[t.name]
            else:
                raise ModelLoadError(
                    f"{self.path.name} has a tensor {t.name!r} that a {self.architecture} model does not use; the file is not a plain {self.architecture} model."
                )
            qtype = t.type_name
            if qtype not in FLOAT_TYPES + BLOCK_TYPES:
                raise ModelLoadError(
                    f"{self.path.name} stores {t.name} as {qtype}, a type MLoT Spark does not read "
                    f"(it reads {', '.join(FLOAT_TYPES + BLOCK_TYPES)}); choose another quantization of the model."
                )
            shape = tuple(reversed(t.dims))
            heads = 0
            if permuted and (hf.endswith("q_proj.weight") or hf.endswith("q_proj.bias")):
                heads = cfg.num_attention_heads
            elif permuted and (hf.endswith("k_proj.weight") or hf.endswith("k_proj.bias")):
                heads = cfg.num_key_value_heads
            yield self._rotary_order(
                _Tensor(hf, t.name, qtype, shape, tensor_view(self._mapping, self.header, t), heads)
            )

    def _rotary_order(self, t: _Tensor) -> _Tensor:
        """A partial-rotary model's q/k rows in the engine's order (engine.loading.rotary_rows); others as they are."""
        cfg = self.config
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(t.hf_name.split(".")[-2], 0)
        if not cfg.rotary_dims or not heads or "self_attn" not in t.hf_name or t.data.shape[0] != t.shape[0]:
            return t
        if t.shape[0] != heads * cfg.head_dim:
            return t  # not the rows the metadata implies: check_tensors refuses it by its shape, nothing reshaped
        return dataclasses.replace(t, data=reorder_rows(t.data, heads, cfg.head_dim, cfg.rotary_dims))

    def _split_rows(self, t: TensorInfo, hf_names: list[str]) -> Iterator[_Tensor]:
        """A fused tensor's row ranges as the Hugging Face tensors they are (q, k, v or gate, up): views, no copy."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        rows = (q, kv, kv) if len(hf_names) == 3 else (cfg.intermediate_size,) * 2
        shape = tuple(int(s) for s in reversed(t.dims))
        qtype = t.type_name
        data = tensor_view(self._mapping, self.header, t)
        if (
            len(shape) != 2
            or shape[0] != sum(rows)
            or data.shape[0] != sum(rows)
            or qtype not in FLOAT_TYPES + BLOCK_TYPES
        ):
            raise ModelLoadError(
                f"{self.path.name} has a fused tensor {t.name} of shape {shape} ({qtype}) that does not fit the model; the file is damaged."
            )
        start = 0
        for name, n in zip(hf_names, rows, strict=True):
            yield self._rotary_order(_Tensor(name, t.name, qtype, (n, shape[1]), data[start : start + n], 0))
            start += n

    def stored_tensors(self) -> dict[str, StoredTensor]:
        """Every 2-D weight the file keeps in a block type, by Hugging Face name, rows in HF order."""
        out: dict[str, StoredTensor] = {}
        for t in self._tensors():
            if t.qtype in BLOCK_TYPES and len(t.shape) == 2:
                data = unpermute_rows(t.data, t.heads) if t.heads else t.data
                out[t.hf_name] = StoredTensor(t.qtype, (t.shape[0], t.shape[1]), data, self._releaser(data))
        return out

    def dequantized_state(self, skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 tensor) one at a time: float tensors as mmap views where they are already fp32; the
        tensors named in `skip` are left out (never decoded)."""
        import gguf

        for t in self._tensors():
            if t.hf_name in skip:
                continue
            if t.qtype in BLOCK_TYPES:
                kind = getattr(gguf.GGMLQuantizationType, t.qtype)
                try:
                    values = gguf.quants.dequantize(t.data, kind)
                except Exception as exc:
                    raise ModelLoadError(
                        f"{self.path.name}: tensor {t.gguf_name} cannot be decoded ({exc.__class__.__name__}); the file is damaged."
                    ) from None
            elif t.qtype == "BF16":
                values = (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif len(t.shape) == 1:
                # A norm or a bias: copied (a few kB), so that no page of the mapping is touched while the model
                # runs. Where the page cache holds the file in large folios, touching one byte of a page maps in
                # megabytes of the weights around it, which the backend holds as its own copy already.
                values = np.array(t.data)
            else:
                values = np.asarray(t.data)
            if math.prod(values.shape) != math.prod(t.shape):
                raise ModelLoadError(
                    f"{self.path.name}: tensor {t.gguf_name} holds {values.size} values for shape {t.shape}; the file is damaged."
                )
            values = values.reshape(t.shape)
            if t.heads:
                values = unpermute_rows(values, t.heads)
            tensor = torch.from_numpy(np.ascontiguousarray(values))
            yield t.hf_name, tensor if tensor.dtype == torch.float32 else tensor.float()

    def check_data(self) -> None:
        """Every tensor's values finite, as loading checks them (a block's float scales, a float tensor's values),
        one tensor at a time: a type changed in the header makes other bytes the scales, often NaN."""
        import gguf

        for t in self._tensors():
            if t.qtype in BlockType.__members__ and len(t.shape) == 2:
                blocks = StoredTensor(t.qtype, (t.shape[0], t.shape[1]), t.data)
                try:
                    check_stored(blocks, t.gguf_name)
                except ValueError as exc:
                    raise ModelLoadError(f"{self.path.name}: {exc}; the file is damaged.") from None
                finite = scales_finite(blocks)
            elif t.qtype == "BF16":  # exponent bits all set: infinity or NaN
                finite = not bool(((np.asarray(t.data).view(np.uint16) & 0x7F80) == 0x7F80).any())
            elif t.qtype in FLOAT_TYPES:
                finite = bool(np.isfinite(t.data).all())
            else:  # a block type without a kernel: decoded, as loading decodes it
                values = gguf.quants.dequantize(t.data, getattr(gguf.GGMLQuantizationType, t.qtype))
                finite = bool(np.isfinite(values).all())
            if not finite:
                raise ModelLoadError(
                    f"{self.path.name}: tensor {t.gguf_name} holds NaN or infinite values; the file is damaged."
                )

    def tokenizer_fields(self) -> list[tuple[str, Any, list[Any]]]:
        """(name, value, gguf value types) of every tokenizer.* field, for writing them into another GGUF."""
        import gguf

        return [
            (name, value, [gguf.GGUFValueType(t) for t in self.header.value_types[name]])
            for name, value in self.tokenizer_metadata().items()
        ]

    def tensor_shapes(self) -> list[_Tensor]:
        """Every tensor the network uses, with its torch-order shape (nothing is read)."""
        return list(self._tensors())
