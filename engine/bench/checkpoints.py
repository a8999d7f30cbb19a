"""Random checkpoints of real model shapes for speed benchmarks (weights don't change speed; no download)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.config import ModelConfig
from engine.model.network import Transformer

BENCH_VOCAB_SPECIALS = ["<|endoftext|>"]

# Real geometries, for bigger-model speed runs: python -m engine.bench.checkpoints llama-3.2-1b OUT_DIR, then
# python -m engine.bench.gguf_export OUT_DIR OUT.gguf --dtype q4_k_m, then bench decode --model OUT.gguf.
# (The trained context is cut to 8,192 so the slot table stays small; it does not change a step's speed.)
GEOMETRIES: dict[str, dict[str, object]] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
    },
}


def byte_level_vocabulary(size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of exactly `size` tokens (the model's embedding rows, as llama.cpp requires):
    the specials, the 256 byte symbols, then pieces made by merges, first every pair of bytes, then each pair
    followed by a byte, in a fixed order. Every merged piece is in the vocabulary, so both engines load it."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    base = BENCH_VOCAB_SPECIALS + alphabet
    if size < len(base):
        raise ValueError(f"a byte-level vocabulary needs at least {len(base)} tokens, not {size}")
    vocab = {tok: i for i, tok in enumerate(base)}
    merges: list[tuple[str, str]] = []
    pairs = (a + b for a in alphabet for b in alphabet)
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    while len(vocab) < size:
        pair = next(pairs, None)
        left, right = (pair[0], pair[1]) if pair is not None else next(triples)
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    return vocab, merges


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
    vocab, merges = byte_level_vocabulary(int(config["vocab_size"]))  # type: ignore[call-overload]  # JSON ints
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(BENCH_VOCAB_SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "add_bos_token": False})
    )
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Write a random checkpoint of a real model's geometry.")
    p.add_argument("geometry", choices=sorted(GEOMETRIES))
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    write_random_checkpoint(args.out, GEOMETRIES[args.geometry])
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
