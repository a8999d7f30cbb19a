"""A GGUF text model's image path from its llama.cpp projector file (`mmproj*.gguf`): which file, and the
`VisionModel` it gives, the same as the model's Hugging Face folder gives.

Which file: the one `--mmproj` names; else, for a GGUF model, the single `mmproj*.gguf` beside it (the model
library stores a downloaded model's projector there); several there is one sentence asking to choose one.
A family is one entry of `LOADERS` (its projector type -> what builds its `VisionModel` from the opened file).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.loading.model_files import MMPROJ_PREFIX, file_sha256, gguf_file_of, is_mmproj_name
from engine.loading.tokenizer import Tokenizer
from engine.model.network import Transformer
from engine.vision.idefics3 import MAX_TILES_A_SIDE, Idefics3Preprocessing
from engine.vision.mmproj import Mmproj
from engine.vision.model import VisionModel
from engine.vision.siglip import VisionConfig, VisionTower

Loader = Callable[[Mmproj, Tokenizer, int, int], VisionModel]


def find_mmproj(model: Path, given: Path | None = None) -> Path | None:
    """The projector file for `model`: `given`, else the one `mmproj*.gguf` beside a GGUF model, else None. A
    projector found beside the model whose family this build does not run yet is left there: the model opens for
    text (one named with --mmproj is refused in its own sentence when it loads)."""
    file = gguf_file_of(model)
    if given is not None:
        given = Path(given).expanduser()
        if file is None:
            raise ModelLoadError(
                f"--mmproj goes with a GGUF model; {Path(model).name} is a model folder, which holds its own vision tower."
            )
        if not given.is_file():
            raise ModelLoadError(f"The projector file {given} does not exist.")
        return given
    if file is None:
        return None
    found = sorted(p for p in file.parent.glob(f"{MMPROJ_PREFIX}*") if is_mmproj_name(p.name) and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:3])
        raise ModelLoadError(f"{file.parent} holds several projector files ({names}); choose one with --mmproj.")
    if not found or Mmproj(found[0]).clip.projector not in LOADERS:
        return None
    return found[0]


def attach_mmproj(path: Path, tokenizer: Tokenizer, backend: object) -> VisionModel:
    """The image path of `backend`'s GGUF text model from the projector file at `path`, wrapped around it."""
    model = getattr(backend, "model", None)
    if not isinstance(model, Transformer):
        raise ModelLoadError(
            f"{path.name} sees images only on the CPU, CUDA or MPS backends; choose one of them with --backend."
        )
    vision = load_mmproj(path, tokenizer, model.config.hidden_size, model.config.vocab_size)
    # A vision model's memories hold ids above the vocabulary (engine.model.config.IMAGE_ID_LIMIT).
    config = dataclasses.replace(model.config, image_ids=True)
    model.config = config
    if hasattr(backend, "config"):
        backend.config = config
    vision.attach(model)
    return vision


def load_mmproj(path: Path, tokenizer: Tokenizer, text_hidden_size: int, vocab_size: int) -> VisionModel:
    """The projector file's `VisionModel` for a text model of this width and vocabulary (fp32 tower on the CPU)."""
    m = Mmproj(path)
    m.check_width(text_hidden_size)  # before reading any value: a file for another model is one sentence
    loader = LOADERS.get(m.clip.projector)
    if loader is None:
        raise ModelLoadError(
            f"{path.name} is a {m.clip.projector} projector, whose family MLoT Spark does not run from a GGUF yet."
        )
    m.check_data()
    vision = loader(m, tokenizer, text_hidden_size, vocab_size)
    vision.weights_id = file_sha256(m.path)
    return vision


def _idefics3(m: Mmproj, tokenizer: Tokenizer, text_hidden_size: int, vocab_size: int) -> VisionModel:
    cfg = VisionConfig.from_dict(m.config, text_hidden_size)
    with torch.device("meta"):
        tower = VisionTower(cfg)
    state = {name.removeprefix("model."): t for name, t in m.state_dict()}
    tower.load_state_dict(state, strict=True, assign=True)
    tower.eval().requires_grad_(False)
    # llama.cpp's idefics3 preprocessing: tiles of the encoder's frame after resizing the longest edge to
    # preproc_image_size (without it, the global view alone), always split, 8-bit RGB rescaled by 1/255.
    longest = m.clip.preproc_image_size or cfg.image_size
    if longest < cfg.image_size or -(-longest // cfg.image_size) > MAX_TILES_A_SIDE:
        raise ModelLoadError(f"{m.name} would cut an image into more tiles than the model's tokenizer names.")
    pre = Idefics3Preprocessing(
        frame=cfg.image_size,
        longest_edge=longest,
        image_seq_len=cfg.tokens_per_frame,
        mean=m.clip.image_mean,
        std=m.clip.image_std,
    )
    return VisionModel(pre, tower, tokenizer, vocab_size)


LOADERS: dict[str, Loader] = {"idefics3": _idefics3}
