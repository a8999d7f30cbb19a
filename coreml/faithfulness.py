"""How faithful each Core ML compression is to the fp32 model, measured as llama.cpp measures CPU types: mean KL
divergence of the next-token distribution and the same-top-token rate against fp32, teacher-forced on text.

The compressed weights are `coreml.compress.simulate` of the fp16 weights (the conversion's own arithmetic), run
by the torch engine in fp32, so the figure isolates the compression. `python -m coreml faithfulness --model DIR`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from coreml import compress
from engine.loading.weights import LoadedModel


@dataclass(frozen=True)
class Faithfulness:
    quantize: str
    mean_kld: float
    same_top: float
    tokens: int


def _compressed_model(model_dir: Path, quantize: str) -> LoadedModel:
    from engine.loading.weights import load_model

    loaded = load_model(model_dir, dtype=torch.float32)
    model = loaded.model
    with torch.no_grad():
        for _name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and module.weight.dim() == 2:
                w16 = module.weight.detach().to(torch.float16).numpy()
                module.weight.copy_(torch.from_numpy(compress.simulate(w16, quantize).astype(np.float32)))
    return loaded


def _logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = loaded.model.forward_causal(torch.tensor([ids]))[0].float()  # (n, V)
    return logits


def measure(
    model_dir: str | Path, quantizations: tuple[str, ...], text: str, max_tokens: int = 512
) -> list[Faithfulness]:
    from engine.loading.tokenizer import Tokenizer
    from engine.loading.weights import load_model

    model_dir = Path(model_dir)
    ids = Tokenizer.load(model_dir).encode(text)[:max_tokens]
    ref = torch.log_softmax(_logits(load_model(model_dir, dtype=torch.float32), ids), -1)
    out = []
    for q in quantizations:
        got = torch.log_softmax(_logits(_compressed_model(model_dir, q), ids), -1)
        kld = (ref.exp() * (ref - got)).sum(-1).mean().item()
        same = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        out.append(Faithfulness(q, kld, same, len(ids)))
    return out
