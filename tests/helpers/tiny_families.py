"""Tiny random Qwen3, Gemma 3 and Phi-3 checkpoints written by transformers itself (its own config and weight
names, fused Phi-3 projections, Gemma's 1 + w norms), with the tiny BPE tokenizer of tests.helpers.tiny."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny import CHAT_TEMPLATE, build_tokenizer

FAMILIES = ("qwen3", "gemma3", "phi3")
# A window shorter than the tests' prompts, so a sliding layer that saw past it would change the logits.
GEMMA_WINDOW = 8


def family_config(family: str, vocab: int, bos: int, eos: int, **extra: Any) -> Any:
    import transformers

    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": 0,
    }
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**common, num_hidden_layers=2, head_dim=16, tie_word_embeddings=False)
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common,
            num_hidden_layers=6,  # five sliding layers, then a global one
            head_dim=16,
            sliding_window=GEMMA_WINDOW,
            query_pre_attn_scalar=extra.pop("query_pre_attn_scalar", 24),
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    elif family == "phi3":
        cfg = transformers.Phi3Config(**common, num_hidden_layers=2, sliding_window=None, tie_word_embeddings=False)
    else:
        raise ValueError(family)
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def make_tiny_family(out: Path, family: str, *, seed: int = 0, **extra: Any) -> Path:
    """A transformers-written folder of `family` with random weights (norms near their identity), and its tokenizer."""
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|end|>")
    cfg = family_config(family, tok.get_vocab_size(), bos, eos, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma scales by 1 + w: its norms near 0, the others near 1
                torch.nn.init.normal_(p, 0.0 if family == "gemma3" else 1.0, 0.1)
            else:
                torch.nn.init.normal_(p, 0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|bos|>",
                "eos_token": "<|end|>",
                "add_bos_token": True,
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return out
