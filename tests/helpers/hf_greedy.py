"""transformers' own greedy generation, the oracle the parity tests compare our greedy tokens with."""

from __future__ import annotations

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
