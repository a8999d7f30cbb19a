"""A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) rebuilt as a Hugging Face `tokenizers` object.

Two vocabularies exist in GGUF files of the Llama family:
- `gpt2`: byte-level BPE with merges (Llama 3, Qwen2, SmolLM). The pre-tokenizer split is named by
  `tokenizer.ggml.pre`; each name maps to the regex its original tokenizer.json used.
- `llama`: SentencePiece BPE with scores and byte fallback (Llama 2, Mistral). Merges are derived from the scores
  the way transformers converts a SentencePiece model: a pair merges when the joined piece is in the vocabulary,
  higher-scored pieces first.

Token types (llama.cpp's): 3 = control (special: dropped when decoding with skip_special), 4 = user-defined
(added but not special), 6 = byte (`<0x41>`, the SentencePiece fallback).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from engine.errors import TokenizerError

CONTROL, USER_DEFINED, BYTE = 3, 4, 6

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


END_OF_TURN = frozenset(("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>"))


def _split(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split a `tokenizer.ggml.pre` name stands for (llama.cpp's table, as the original tokenizer.json wrote it)."""
    if pre in ("default", "gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"):
        return _split(_LLAMA3_REGEX)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return _split(_QWEN2_REGEX)
    raise TokenizerError(
        f"The GGUF's tokenizer splits text the {pre!r} way, which MLoT Spark does not know; "
        "use the model's Hugging Face folder instead."
    )


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    return [
        AddedToken(tok, special=(kind == CONTROL), normalized=False, single_word=False, lstrip=False, rstrip=False)
        for tok, kind in zip(tokens, types, strict=True)
        if kind in (CONTROL, USER_DEFINED)
    ]


def _gpt2(meta: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges_raw, list) or not all(isinstance(m, str) for m in merges_raw):
        raise TokenizerError("The GGUF's BPE tokenizer has no merges; the file is incomplete.")
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise TokenizerError(f"The GGUF's BPE merge {m[:40]!r} is not two pieces; the file is damaged.")
        merges.append((left, right))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    backend.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges: (left, right) for every split of a piece into two pieces, best-scored first (then
    by the left piece's id, then the right's). The candidates are kept as three flat arrays, not as tuples of
    strings: a 262k vocabulary has half a million of them, which as Python tuples took some 200 MB while loading."""
    ranks, lefts, rights = array("d"), array("q"), array("q")  # -score of the joined piece, left id, right id
    for piece, pid in vocab.items():
        for i in range(1, len(piece)):
            left = vocab.get(piece[:i])
            if left is None:
                continue
            right = vocab.get(piece[i:])
            if right is not None:
                ranks.append(-scores[pid])
                lefts.append(left)
                rights.append(right)
    text = {i: t for t, i in vocab.items()}
    order = np.lexsort((np.frombuffer(rights, np.int64), np.frombuffer(lefts, np.int64), np.frombuffer(ranks)))
    return [(text[lefts[j]], text[rights[j]]) for j in order.tolist()]


def _llama_spm(meta: dict[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise TokenizerError("The GGUF's SentencePiece tokenizer has no scores for its tokens; the file is incomplete.")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    model = models.BPE(
        vocab=vocab,
        merges=_spm_merges(vocab, [float(s) for s in scores]),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(model)
    prefix = [normalizers.Prepend("▁")] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return backend


def tokenizer_parts(meta: dict[str, Any]) -> tuple[tokenizers.Tokenizer, dict[str, str], frozenset[int], bool, str]:
    """(backend, special token texts by template name, EOS ids, whether to add BOS, content hash) from metadata."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError("The GGUF has no vocabulary (tokenizer.ggml.tokens); the file is incomplete.")
    types_raw = meta.get("tokenizer.ggml.token_type")
    types = (
        [int(t) for t in types_raw]
        if isinstance(types_raw, list) and len(types_raw) == len(tokens)
        else [1] * len(tokens)
    )
    if kind == "gpt2":
        backend = _gpt2(meta, tokens)
    elif kind == "llama":
        backend = _llama_spm(meta, tokens, types)
    else:
        raise TokenizerError(
            f"The GGUF's tokenizer is of type {kind!r}; MLoT Spark reads gpt2 (BPE) and llama (SentencePiece) vocabularies."
        )
    backend.add_tokens(_added_tokens(tokens, types))  # ids already in the vocabulary: marks them whole and special
    backend.no_truncation()
    backend.no_padding()

    def text_of(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tokens) else None

    special = {
        name: t
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
        if (t := text_of(key)) is not None
    }
    eos = {
        i
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if isinstance(i := meta.get(f"tokenizer.ggml.{key}"), int) and 0 <= i < len(tokens)
    }
    # A turn ends at its end-of-turn marker even when the file names only the document's EOS (Gemma's
    # <end_of_turn>, Qwen's <|im_end|>): llama.cpp ends generation at these control tokens by their text too.
    eos.update(i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == CONTROL and t in END_OF_TURN)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    digest = hashlib.sha256()
    for key in sorted(k for k in meta if k.startswith("tokenizer.")):
        digest.update(key.encode())
        digest.update(json.dumps(meta[key], default=str).encode())
    return backend, special, frozenset(eos), add_bos, digest.hexdigest()
