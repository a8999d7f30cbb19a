"""What a GGUF's header says, checked for sense before a config, a tokenizer or a tensor is built from it.

`engine.loading.gguf_header` checks the layout against the file; this module checks the meaning, generically:
the architecture's sizes are whole numbers in range, the vocabulary and its merges are in proportion to each other
and to the embedding, special token ids name tokens, the chat template is text of a sane size, every tensor the
architecture knows has the shape its config implies, and the layers the tensors fill are the layers `block_count`
declares. Every refusal is one `ModelLoadError` sentence naming the key or tensor at fault.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

from engine.errors import ModelLoadError
from engine.loading.template_limits import MAX_TEMPLATE_CHARS
from engine.model.config import SIZE_LIMITS, ModelConfig

MAX_VOCAB = 1 << 20  # the largest real vocabularies hold ~260k tokens
MAX_MERGES_PER_TOKEN = 4  # Llama 3 has ~2.2 merges per token
MAX_TOKEN_CHARS = 256
MAX_VOCAB_CHARS = 1 << 23
TOKEN_TYPES = range(0, 8)  # llama.cpp's: undefined, normal, unknown, control, user-defined, unused, byte

# config.json size key -> the GGUF key (after the architecture prefix) that holds it
_SIZE_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "max_position_embeddings": "context_length",
}
_REQUIRED_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
_FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor")
_BOOL_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix")
_ID_KEY = re.compile(r"tokenizer\.ggml\.\w+_token_id")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_metadata(name: str, meta: dict[str, Any], arch: str) -> None:
    """The architecture's sizes and the tokenizer's fields, before `ModelConfig` or the tokenizer sees them."""
    limits = {key: (lo, hi) for key, lo, hi in SIZE_LIMITS}
    for size, suffix in _SIZE_KEYS.items():
        key = f"{arch}.{suffix}"
        value = meta.get(key)
        if value is None and size not in _REQUIRED_SIZES:
            continue
        lo, hi = limits[size]
        if value is None:
            raise ModelLoadError(f"{name} lacks {key}; the file is incomplete.")
        if not _whole(value) or not lo <= value <= hi:
            raise ModelLoadError(
                f"{name} gives {key} = {str(value)[:40]}, which is not a whole number from {lo} to {hi}."
            )
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and (not _whole(rope_dims) or not 1 <= rope_dims <= limits["head_dim"][1]):
        raise ModelLoadError(
            f"{name} gives {arch}.rope.dimension_count = {str(rope_dims)[:40]}, which is not a channel count."
        )
    for suffix in _FLOAT_KEYS:
        key = f"{arch}.{suffix}"
        value = meta.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
        ):
            raise ModelLoadError(f"{name} gives {key} = {str(value)[:40]}, which is not a positive number.")
    for key in _BOOL_KEYS:
        if key in meta and not isinstance(meta[key], bool):
            raise ModelLoadError(f"{name} gives {key} = {str(meta[key])[:40]}, which is not true or false.")
    _check_vocabulary(name, meta)
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        if not isinstance(template, str):
            raise ModelLoadError(f"{name} has a tokenizer.chat_template that is not text.")
        if len(template) > MAX_TEMPLATE_CHARS:
            raise ModelLoadError(
                f"{name} has a tokenizer.chat_template of {len(template):,} characters, over the {MAX_TEMPLATE_CHARS:,} a chat template may have."
            )


def _check_vocabulary(name: str, meta: dict[str, Any]) -> None:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return  # the tokenizer says so in its own sentence when it is built
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError(f"{name} has a tokenizer.ggml.tokens that is not a list of texts.")
    n = len(tokens)
    if n > MAX_VOCAB:
        raise ModelLoadError(f"{name} has {n:,} tokens in tokenizer.ggml.tokens, over the {MAX_VOCAB:,} limit.")
    longest = max(len(t) for t in tokens)
    if longest > MAX_TOKEN_CHARS or sum(len(t) for t in tokens) > MAX_VOCAB_CHARS:
        raise ModelLoadError(f"{name} has tokens in tokenizer.ggml.tokens longer than any real vocabulary's.")
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and (
        not isinstance(types, list) or len(types) != n or not all(_whole(t) and t in TOKEN_TYPES for t in types)
    ):
        raise ModelLoadError(f"{name} has a tokenizer.ggml.token_type that does not give one known type per token.")
    scores = meta.get("tokenizer.ggml.scores")
    if scores is not None and (
        not isinstance(scores, list)
        or len(scores) != n
        or not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores)
    ):
        raise ModelLoadError(f"{name} has a tokenizer.ggml.scores that does not give one finite score per token.")
    for key in (k for k in meta if _ID_KEY.fullmatch(k)):
        value = meta[key]
        if not _whole(value) or not 0 <= value < n:
            raise ModelLoadError(
                f"{name} gives {key} = {str(value)[:40]}, which is not a token id of its {n:,}-token vocabulary."
            )
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        if key in meta and not isinstance(meta[key], str):
            raise ModelLoadError(f"{name} gives {key} = {str(meta[key])[:40]}, which is not a name.")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        return
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise ModelLoadError(f"{name} has a tokenizer.ggml.merges that is not a list of texts.")
    if len(merges) > MAX_MERGES_PER_TOKEN * n:
        raise ModelLoadError(
            f"{name} has {len(merges):,} merges in tokenizer.ggml.merges for {n:,} tokens; the vocabulary and its merges do not match."
        )
    vocab = set(tokens)
    for i, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep or left not in vocab or right not in vocab or left + right not in vocab:
            raise ModelLoadError(
                f"{name} has a merge {merge[:40]!r} (tokenizer.ggml.merges item {i}) whose pieces are not in its vocabulary."
            )


# Hugging Face name (after the layer prefix) -> its torch-order shape, from the config. A tensor whose name is not
# here is checked for layout only; an architecture that adds tensors adds their shapes here.
_SHAPES: dict[str, Callable[[ModelConfig], tuple[int, ...]]] = {
    "model.embed_tokens.weight": lambda c: (c.vocab_size, c.hidden_size),
    "lm_head.weight": lambda c: (c.vocab_size, c.hidden_size),
    "model.norm.weight": lambda c: (c.hidden_size,),
    "input_layernorm.weight": lambda c: (c.hidden_size,),
    "post_attention_layernorm.weight": lambda c: (c.hidden_size,),
    "self_attn.q_proj.weight": lambda c: (c.num_attention_heads * c.head_dim, c.hidden_size),
    "self_attn.k_proj.weight": lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
    "self_attn.v_proj.weight": lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
    "self_attn.o_proj.weight": lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim),
    "self_attn.q_proj.bias": lambda c: (c.num_attention_heads * c.head_dim,),
    "self_attn.k_proj.bias": lambda c: (c.num_key_value_heads * c.head_dim,),
    "self_attn.v_proj.bias": lambda c: (c.num_key_value_heads * c.head_dim,),
    "self_attn.o_proj.bias": lambda c: (c.hidden_size,),
    "mlp.gate_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "mlp.up_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "mlp.down_proj.weight": lambda c: (c.hidden_size, c.intermediate_size),
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def check_tensors(
    name: str, tensors: Iterable[tuple[str, str, tuple[int, ...]]], config: ModelConfig, arch: str
) -> None:
    """(GGUF name, Hugging Face name, torch-order shape) of every tensor the network uses: each known tensor has
    the shape the config implies, and the layers are exactly 0 .. block_count - 1, each with the same tensors."""
    layers: dict[int, set[str]] = {}
    first: dict[int, str] = {}
    for gguf_name, hf_name, shape in tensors:
        m = _LAYER.fullmatch(hf_name)
        suffix = m.group(2) if m else hf_name
        if m:
            index = int(m.group(1))
            if index >= config.num_hidden_layers:
                raise ModelLoadError(
                    f"{name} has a tensor {gguf_name} for layer {index}, but {arch}.block_count declares {config.num_hidden_layers} layers."
                )
            layers.setdefault(index, set()).add(suffix)
            first.setdefault(index, gguf_name)
        rule = _SHAPES.get(suffix)
        if rule is not None and tuple(shape) != rule(config):
            want = list(reversed(rule(config)))
            raise ModelLoadError(
                f"{name} has a tensor {gguf_name} of shape {list(reversed(shape))} where its metadata implies {want}."
            )
    expected = layers.get(0, set())
    for index in range(config.num_hidden_layers):
        have = layers.get(index, set())
        if have != expected:
            missing = sorted(expected - have) or sorted(have - expected)
            raise ModelLoadError(
                f"{name} declares {config.num_hidden_layers} layers in {arch}.block_count, but layer {index} "
                f"{'lacks' if expected - have else 'adds'} {missing[0]} that layer 0 {'has' if expected - have else 'does not have'}."
            )
    if config.head_dim % 2:
        raise ModelLoadError(
            f"{name} gives {config.head_dim} channels per head, an odd number rotary embedding cannot use."
        )
