"""A GGUF text model's image path from its llama.cpp projector file (`mmproj*.gguf`): which file, and the
`VisionModel` it gives, the same as the model's Hugging Face folder gives.

Which file: the one `--mmproj` names; else, for a GGUF model, the single `mmproj*.gguf` beside it (the model
library stores a downloaded model's projector there); several there is one sentence asking to choose one.
A family is one entry of `LOADERS` (its projector type -> what builds its `VisionModel` from the opened file): its
tower under the checkpoint names `engine.vision.mmproj` gives, and its preprocessing as llama.cpp's clip.cpp sets it
from the `clip.*` keys. The text model's config gains what the family's Hugging Face folder gives it
(engine.model.config): image ids, and Gemma 3's pictures attending both ways; Qwen2.5-VL's rotary sections come with
its `qwen2vl` text GGUF (engine.loading.gguf).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.loading.model_files import MMPROJ_PREFIX, file_sha256, gguf_file_of, is_mmproj_name
from engine.loading.tokenizer import Tokenizer
from engine.model.config import BIDIRECTIONAL_IMAGES
from engine.model.network import Transformer
from engine.vision import gemma3
from engine.vision.idefics3 import MAX_TILES_A_SIDE, Idefics3Preprocessing
from engine.vision.mmproj import Mmproj
from engine.vision.model import VisionModel, not_on_this_backend, seat
from engine.vision.qwen25vl import MAX_PICTURE_PIXELS, Qwen25VLPreprocessing, Qwen25VLTower, Qwen25VLVisionConfig
from engine.vision.siglip import Tower, VisionConfig, VisionTower

Loader = Callable[[Mmproj, Tokenizer, int, int], VisionModel]
# clip.cpp's Qwen2.5-VL picture sizes (set_limit_image_tokens(8, 4096)): from 8 to 4096 merged tokens a picture,
# which no clip.* key changes.
QWEN_MIN_TOKENS, QWEN_MAX_TOKENS = 8, 4096


def find_mmproj(model: Path, given: Path | None = None) -> Path | None:
    """The projector file for `model`: `given`, else the one `mmproj*.gguf` beside a GGUF model, else None."""
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
    return found[0] if found else None


def attach_mmproj(path: Path, tokenizer: Tokenizer, backend: object) -> VisionModel:
    """The image path of `backend`'s GGUF text model from the projector file at `path`, wrapped around it."""
    model = getattr(backend, "model", None)
    if not isinstance(model, Transformer):
        raise not_on_this_backend(path)
    m = Mmproj(path)
    vision = _vision(m, tokenizer, model.config.hidden_size, model.config.vocab_size)
    # A vision model's memories hold ids above the vocabulary (engine.model.config.IMAGE_ID_LIMIT); a family whose
    # pictures attend both ways (Gemma 3) says so in its text config, as its Hugging Face folder's does.
    bidirectional = m.family.architecture in BIDIRECTIONAL_IMAGES
    config = dataclasses.replace(model.config, image_ids=True, images_bidirectional=bidirectional)
    model.config = config
    if hasattr(backend, "config"):
        backend.config = config
    rename = RENAMES[m.clip.projector]  # the tower's matrices run as the file stores them
    stored = {ours: t for name, t in m.stored_tensors().items() if (ours := rename(name)) is not None}
    return seat(vision, model, backend, stored)


def load_mmproj(path: Path, tokenizer: Tokenizer, text_hidden_size: int, vocab_size: int) -> VisionModel:
    """The projector file's `VisionModel` for a text model of this width and vocabulary (fp32 tower on the CPU)."""
    return _vision(Mmproj(path), tokenizer, text_hidden_size, vocab_size)


def _vision(m: Mmproj, tokenizer: Tokenizer, text_hidden_size: int, vocab_size: int) -> VisionModel:
    m.check_width(text_hidden_size)  # before reading any value: a file for another model is one sentence
    m.check_data()
    vision = LOADERS[m.clip.projector](m, tokenizer, text_hidden_size, vocab_size)  # every family of mmproj's
    vision.weights_id = file_sha256(m.path)
    return vision


# projector type -> a checkpoint tensor's name in the family's tower
RENAMES: dict[str, Callable[[str], str | None]] = {
    "idefics3": lambda name: name.removeprefix("model."),
    "gemma3": gemma3.tower_name,
    "qwen2.5vl_merger": lambda name: name,
}


def _load(tower: Tower, m: Mmproj, rename: Callable[[str], str | None]) -> None:
    """`m`'s tensors into `tower` (built on meta) under its names for the checkpoint's."""
    state: dict[str, torch.Tensor] = {}
    for name, t in m.state_dict():
        ours = rename(name)
        assert ours is not None  # the family table names the tower's tensors only
        state[ours] = t
    tower.load_state_dict(state, strict=True, assign=True)
    tower.eval().requires_grad_(False)


def _idefics3(m: Mmproj, tokenizer: Tokenizer, text_hidden_size: int, vocab_size: int) -> VisionModel:
    cfg = VisionConfig.from_dict(m.config, text_hidden_size)
    with torch.device("meta"):
        tower = VisionTower(cfg)
    _load(tower, m, RENAMES["idefics3"])
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


def _gemma3(m: Mmproj, tokenizer: Tokenizer, text_hidden_size: int, vocab_size: int) -> VisionModel:
    with torch.device("meta"):
        tower = gemma3.build_tower(m.config, text_hidden_size)  # tokens a picture: the patch grid pooled
    _load(tower, m, RENAMES["gemma3"])
    # llama.cpp's gemma3 preprocessing: the picture resized to the encoder's square, normalised by clip's mean/std.
    pre = gemma3.Gemma3Preprocessing(
        height=tower.image_size,
        width=tower.image_size,
        image_seq_len=tower.tokens_per_frame,
        mean=m.clip.image_mean,
        std=m.clip.image_std,
    )
    return VisionModel(pre, tower, tokenizer, vocab_size)


def _qwen25vl(m: Mmproj, tokenizer: Tokenizer, text_hidden_size: int, vocab_size: int) -> VisionModel:
    cfg = Qwen25VLVisionConfig.from_dict(m.config, text_hidden_size)
    # clip.cpp's qwen2.5vl preprocessing: sides multiples of patch x merge, 8 to 4096 merged tokens a picture.
    area = (cfg.patch_size * cfg.spatial_merge_size) ** 2
    if QWEN_MAX_TOKENS * area > MAX_PICTURE_PIXELS:
        raise ModelLoadError(
            f"{m.name} would resize a picture to {QWEN_MAX_TOKENS * area} pixels; MLoT Spark takes at most "
            f"{MAX_PICTURE_PIXELS}."
        )
    with torch.device("meta"):
        tower = Qwen25VLTower(cfg)
    _load(tower, m, RENAMES["qwen2.5vl_merger"])
    pre = Qwen25VLPreprocessing(
        patch=cfg.patch_size,
        merge=cfg.spatial_merge_size,
        temporal=cfg.temporal_patch_size,
        min_pixels=QWEN_MIN_TOKENS * area,
        max_pixels=QWEN_MAX_TOKENS * area,
        mean=m.clip.image_mean,
        std=m.clip.image_std,
    )
    return VisionModel(pre, tower, tokenizer, vocab_size)


LOADERS: dict[str, Loader] = {"idefics3": _idefics3, "gemma3": _gemma3, "qwen2.5vl_merger": _qwen25vl}
