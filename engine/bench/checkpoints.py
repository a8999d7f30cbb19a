"""Random checkpoints of real model shapes for speed benchmarks (weights don't change speed; no download)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.config import ModelConfig
from engine.model.network import Transformer

BENCH_VOCAB_SPECIALS = ["<|endoftext|>"]


def write_random_checkpoint(out: Path, config: dict[str, object], seed: int = 0) -> Path:
    """A model folder with `config` and random weights (std 0.02, norms 1), plus a byte-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_dict(config))
    state = {}
    for name, p in model.state_dict().items():
        if config.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        state[name] = torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    # A byte-level vocabulary: 256 byte tokens + specials; ids beyond it exist in the model but are never typed.
    vocab = {tok: i for i, tok in enumerate(BENCH_VOCAB_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(BENCH_VOCAB_SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "add_bos_token": False})
    )
    return out
