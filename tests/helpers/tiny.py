"""Tiny random Llama-family checkpoints in real Hugging Face folder format, made by the tests themselves.

The folder is written exactly as a downloaded model would be (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) so every loader path under test is the production one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.model.config import ModelConfig
from engine.model.network import Transformer

TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. Python is a programming language. "
    "def main():\n    return 42\n"
    "Memory cascade: working, episodic, persistent. Ünïcödé, 日本語, emoji 🙂🚀. "
) * 8

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

ARCH_CONFIGS: dict[str, dict] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "llama3": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False},
}


def build_tokenizer(vocab_size: int = 320) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TOKENIZER_TEXT], trainer=trainer)
    return tok


def make_tiny_model(
    out: Path,
    arch: str = "llama",
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 4096,
    tie: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """Write a random tiny checkpoint + tokenizer to `out` and return it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.get_vocab_size()
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    end = tok.token_to_id("<|end|>")
    cfg = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": tie,
        "bos_token_id": bos,
        "eos_token_id": [eos, end],
        "torch_dtype": {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype],
        **ARCH_CONFIGS[arch],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Transformer(ModelConfig.from_dict(cfg))
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            torch.nn.init.normal_(p, 1.0, 0.1)
        else:
            torch.nn.init.normal_(p, 0.0, 0.08)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if tie:
        state.pop("lm_head.weight")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|bos|>",
                "eos_token": "<|end|>",
                "add_bos_token": True,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": max_positions,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": [eos, end], "do_sample": False})
    )
    return out
