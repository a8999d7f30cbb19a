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


def text_settings(vocab: int, bos: int | None, eos: int | None) -> dict[str, Any]:
    """The sizes every tiny text model shares (the vision checkpoints' text models too); layers are each one's own."""
    return {
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


def family_config(family: str, vocab: int, bos: int, eos: int, **extra: Any) -> Any:
    import transformers

    common = text_settings(vocab, bos, eos)
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


def make_tiny_family(
    out: Path,
    family: str,
    *,
    seed: int = 0,
    chat_template: str = CHAT_TEMPLATE,
    eos_token: str = "<|end|>",
    special_tokens: tuple[str, ...] = (),
    added_tokens: tuple[str, ...] = (),
    add_bos: bool = True,
    **extra: Any,
) -> Path:
    """A transformers-written folder of `family` with random weights (norms near their identity), and its tokenizer
    (with `special_tokens` and plain `added_tokens` added to its vocabulary)."""
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.add_special_tokens(list(special_tokens))
    tok.add_tokens(list(added_tokens))
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id(eos_token)
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
                "eos_token": eos_token,
                "add_bos_token": add_bos,
                "chat_template": chat_template,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return out


QWEN3_CHAT_TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text(encoding="utf-8")
"""Qwen3's published chat template (Qwen/Qwen3-0.6B's tokenizer_config.json): `enable_thinking`, earlier turns'
thinking dropped before the last user query, `reasoning_content` read where given."""


def make_tiny_qwen3(out: Path, *, seed: int = 0, think_tokens: bool = True) -> Path:
    """A tiny random Qwen3 with Qwen3's chat template and its chat tokens in the vocabulary, and its think tokens
    unless `think_tokens` is false (then the tags are spelled in several tokens, which a grammar can force: llguidance
    takes added tokens for special ones)."""
    return make_tiny_family(
        out,
        "qwen3",
        seed=seed,
        chat_template=QWEN3_CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        special_tokens=("<|im_start|>", "<|im_end|>"),
        added_tokens=("<think>", "</think>") if think_tokens else (),
        add_bos=False,  # as Qwen3's tokenizer: no BOS
    )
