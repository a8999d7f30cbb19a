"""transformers' vision-language model holding the very weights a GGUF and its mmproj store (dequantized), to
compare a quantized export against; and greedy tokens from our causal path, multimodal offsets included."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from engine.loading.weights import load_model
from engine.vision.mmproj import read_mmproj
from engine.vision.model import VisionModel


def on_stored_weights(hf_model: Any, text: Path, mmproj: Path, text_prefix: str, vision_prefix: str) -> Any:
    """A copy of `hf_model` with the text GGUF's matrices (ours `model.X` -> `text_prefix` + X, `lm_head` as is;
    norms and biases are stored as float and left as they are) and every mmproj tensor (its checkpoint name under
    `vision_prefix`)."""
    model = copy.deepcopy(hf_model)
    params = dict(model.state_dict())
    stored: dict[str, torch.Tensor] = {}
    for name, t in load_model(text).model.state_dict().items():
        if t.dim() == 2:
            stored[name if name == "lm_head.weight" else text_prefix + name.removeprefix("model.")] = t
    if "lm_head.weight" not in stored:  # tied: the head is the embedding
        stored["lm_head.weight"] = stored[text_prefix + "embed_tokens.weight"]
    stored.update({vision_prefix + name: t for name, t in read_mmproj(mmproj).state_dict()})
    assert set(stored) <= set(params), sorted(set(stored) - set(params))[:3]
    assert any("vision" in n or "visual" in n for n in stored) and len(stored) > len(params) // 2
    params.update(stored)
    model.load_state_dict(params, strict=True)
    return model


def causal_greedy(model: Any, vision: VisionModel, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            seq = ids + out
            turn = vision.position_offsets(seq)
            logits = model.forward_causal(torch.tensor([seq]), None if turn is None else turn[None])
            out.append(int(logits[0, -1].argmax()))
    return out
