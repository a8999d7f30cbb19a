"""What the tiny vision checkpoints (tiny_idefics3, tiny_gemma3, tiny_qwen25vl) build alike: the tiny BPE tokenizer of
tests.helpers.tiny with a family's image tokens, loaded back by transformers, and a random init that keeps every norm
near its identity; and a copy of such a folder with one of its JSON files edited, for the damaged-folder tests."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny import build_tokenizer


def vision_tokenizer(out: Path, special: list[str], extra_config: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(the `tokenizers` tokenizer, transformers' tokenizer loaded from it) with `special` added; `extra_config`:
    more keys for tokenizer_config.json. The files are written to a scratch folder in `out` and removed once read."""
    import transformers

    tok = build_tokenizer()
    tok.add_special_tokens(special)
    tok_dir = Path(out) / "_tok"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    config = {
        "bos_token": "<|bos|>",
        "eos_token": "<|end|>",
        "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
        **(extra_config or {}),
    }
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    hf_tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    shutil.rmtree(tok_dir)
    return tok, hf_tok


def init_near_identity(
    model: torch.nn.Module, matrix_std: float, zero_centred: Callable[[str], bool] = lambda name: False
) -> None:
    """Random weights: 1-D weights (norms) around 1 (around 0 where `zero_centred(name)`: norms that scale by 1 + w),
    matrices N(0, matrix_std), biases N(0, 0.02). Seed the generator first."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if zero_centred(name):
                torch.nn.init.normal_(p, 0.0, 0.1)
            elif name.endswith("weight") and p.dim() == 1:
                torch.nn.init.normal_(p, 1.0, 0.1)
            else:
                torch.nn.init.normal_(p, 0.0, matrix_std if p.dim() > 1 else 0.02)


def edited_copy(folder: Path, out: Path, name: str, change: Callable[[dict[str, Any]], None]) -> Path:
    """`folder` copied to `out`, its JSON file `name` changed in place by `change`."""
    shutil.copytree(folder, out)
    d = json.loads((out / name).read_text())
    change(d)
    (out / name).write_text(json.dumps(d))
    return out
