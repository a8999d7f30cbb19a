"""The exports the GGUF vision tests compare (an f32 pair, exact, and a Q8_0 text model with an f16 mmproj);
transformers' vision-language model holding the very weights a GGUF and its mmproj store (dequantized), to
compare a quantized export against; our vision model loaded from a folder or from a GGUF and its mmproj; a prompt's ids as ours and as transformers'
processor writes them; and greedy tokens from our causal path, multimodal offsets included."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from engine.bench.mmproj_export import export_vision
from engine.loading.tokenizer import Tokenizer
from engine.loading.weights import load_model
from engine.vision.gguf_vision import load_mmproj
from engine.vision.idefics3 import Frames
from engine.vision.images import DecodedImage
from engine.vision.mmproj import read_mmproj
from engine.vision.model import VisionModel, load_vision

EXPORTS = {"f32": ("f32", "f32"), "q8_0": ("q8_0", "f16")}  # (text model, mmproj)


def exported(folder: Path, root: Path) -> dict[str, tuple[Path, Path]]:
    """Each of EXPORTS of `folder` under `root`: kind -> (text model GGUF, mmproj)."""
    return {kind: export_vision(folder, root / kind, *types) for kind, types in EXPORTS.items()}


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


def ours_from_folder(folder: Path) -> tuple[Any, VisionModel]:
    """Our text model of a checkpoint folder with its vision model attached."""
    loaded = load_model(folder)
    vision = load_vision(folder, Tokenizer.load(folder), loaded.config.hidden_size, loaded.config.vocab_size)
    vision.attach(loaded.model)
    return loaded.model, vision


def ours_from_gguf(text: Path, mmproj: Path) -> tuple[Any, VisionModel]:
    """Our text model of a GGUF with the vision model of its mmproj attached."""
    loaded = load_model(text)
    vision = load_mmproj(mmproj, Tokenizer.load(text), loaded.config.hidden_size, loaded.config.vocab_size)
    vision.attach(loaded.model)
    return loaded.model, vision


def our_prompt(
    vision: VisionModel, prompt: str, pictures: list[DecodedImage]
) -> tuple[list[int], list[int], list[Frames]]:
    """(our ids for `prompt` with `pictures`, each picture's tokens its own ids above the vocabulary; the same ids with
    those as the model's image token, as transformers' processor writes them; the pictures' frames)."""
    expanded, frames = vision.prompt_text(prompt, pictures)
    ids = vision.image_ids(vision.tokenizer.encode(expanded), pictures, frames)
    plain = [vision.image_token_id if i >= vision.vocab_size else i for i in ids]
    return ids, plain, frames


def causal_greedy(model: Any, vision: VisionModel, ids: list[int], n: int, offsets: bool = True) -> list[int]:
    """n greedy tokens after `ids` through the causal path, each turned by its multimodal offsets (a model without
    them has none; `offsets=False` leaves them out)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            seq = ids + out
            turn = vision.position_offsets(seq) if offsets else None
            logits = model.forward_causal(torch.tensor([seq]), None if turn is None else turn[None])
            out.append(int(logits[0, -1].argmax()))
    return out
