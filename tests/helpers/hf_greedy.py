"""transformers' own greedy generation, the oracle the parity tests compare our greedy tokens with, and its
vision-language models loaded from a folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_greedy_tokens(model: Any, ids: list[int], n: int) -> list[int]:
    """Exactly n greedy tokens after `ids` from a transformers causal LM (EOS does not stop it)."""
    with torch.no_grad():
        inp = torch.tensor([ids])
        # An explicit mask: otherwise transformers infers one from pad_token_id and could hide a BOS of the same id.
        out = model.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    tokens: list[int] = out[0, len(ids) :].tolist()
    return tokens


def hf_vision_tokens(model: Any, inputs: Any, n: int) -> list[int]:
    """Exactly n greedy tokens from a transformers vision-language model on its processor's `inputs`."""
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    tokens: list[int] = out[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens


def hf_vision_model(model_class: Any, folder: Path, processor_class: Any = None) -> tuple[Any, Any]:
    """(transformers' model of `model_class` in fp32, eval mode; its processor, AutoProcessor's unless given)."""
    import transformers

    model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    return model, (processor_class or transformers.AutoProcessor).from_pretrained(folder)
