"""Byte-level BPE tokenizer for the bundled model, trained with HF `tokenizers` on the training split.

Saved as `tokenizer.json` + `tokenizer_config.json` in the format the engine's loader and Hugging Face read.
BOS is added by the chat template / `add_bos_token`, not by a post-processor, so it is never doubled.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, END = "<|bos|>", "<|eos|>", "<|end|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [BOS, EOS, END, SYSTEM, USER, ASSISTANT]
# One turn per message, each closed by <|end|>; the reply is open after <|assistant|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (every byte representable, so no unknown token) with the chat special tokens first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def chat_text(question: str, answer: str) -> str:
    """One exchange exactly as CHAT_TEMPLATE renders it (without BOS, which the trainer adds as an id)."""
    return f"{USER}\n{question}{END}\n{ASSISTANT}\n{answer}{END}\n"


def save_tokenizer(tok: Tokenizer, out: Path, max_length: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": END,  # a chat turn ends with <|end|>; <|eos|> ends a document
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
