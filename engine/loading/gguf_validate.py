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
from collections.abc import Iterable
from typing import Any

from engine.errors import ModelLoadError
from engine.loading.template_limits import MAX_TEMPLATE_CHARS
from engine.model.config import SIZE_LIMITS, ModelConfig

MAX_VOCAB = 1 << 20  # the largest real vocabularies hold ~260k tokens
MAX_MERGES_PER_TOKEN = 4  # Llama 3 has ~2.2 merges per token
MAX_TOKEN_CHARS = 256
MAX_NAME_CHARS = 64  # a tokenizer kind or pre-tokenizer name ("gpt2", "llama-bpe")
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
        if key in meta and (not isinstance(meta[key], str) or len(meta[key]) > MAX_NAME_CHARS):
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


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _layer_of(hf_name: str) -> int:
    m = _LAYER.fullmatch(hf_name)
    return int(m.group(1)) if m else -1


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the network for `config` has, by Hugging Face name, with its shape: the network built on the
    meta device (no memory), so an architecture that adds tensors adds them here by adding them to the network."""
    import torch

    from engine.model.network import Transformer

    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Transformer(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def check_tensors(
    name: str, tensors: Iterable[tuple[str, str, tuple[int, ...]]], config: ModelConfig, arch: str
) -> None:
    """(GGUF name, Hugging Face name, torch-order shape) of every tensor the network uses: each is a parameter of the
    network the config describes, with its shape, and every parameter is there; layers past `block_count` and
    layers without their tensors are named as such."""
    if config.head_dim % 2:
        raise ModelLoadError(
            f"{name} gives {config.head_dim} channels per head, an odd number rotary embedding cannot use."
        )
    expected = expected_shapes(config)
    layers = config.num_hidden_layers
    seen: set[str] = set()
    for gguf_name, hf_name, shape in tensors:
        m = _LAYER.fullmatch(hf_name)
        if m and int(m.group(1)) >= layers:
            raise ModelLoadError(
                f"{name} has a tensor {gguf_name} for layer {m.group(1)}, but {arch}.block_count declares {layers} layers."
            )
        want = expected.get(hf_name)
        if want is None:
            raise ModelLoadError(f"{name} has a tensor {gguf_name} that its {arch} configuration does not use.")
        if tuple(shape) != want:
            raise ModelLoadError(
                f"{name} has a tensor {gguf_name} of shape {list(reversed(shape))} where its metadata implies {list(reversed(want))}."
            )
        seen.add(hf_name)
    missing = sorted(set(expected) - seen, key=lambda n: (_layer_of(n), n))
    if missing:
        index = _layer_of(missing[0])
        where = f" (layer {index} of the {layers} that {arch}.block_count declares)" if index >= 0 else ""
        raise ModelLoadError(f"{name} lacks the tensor for {missing[0]}{where}; the file is incomplete.")
