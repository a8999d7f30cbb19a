"""Every llama.cpp projector family engine.vision.mmproj reads builds its VisionModel (Idefics3, Gemma 3,
Qwen2.5-VL), found beside a GGUF model whatever its family; its preprocessing comes from the `clip.*` keys (Gemma 3:
the encoder's square and its pooled tokens; Qwen2.5-VL: clip.cpp's 8 to 4096 merged tokens a picture); a Qwen2.5-VL
projector whose largest picture would pass our pixel bound is refused in one sentence."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ModelLoadError
from engine.vision.gemma3 import Gemma3Preprocessing, Gemma3Tower
from engine.vision.gguf_vision import LOADERS, QWEN_MAX_TOKENS, QWEN_MIN_TOKENS, find_mmproj, load_mmproj
from engine.vision.mmproj import FAMILIES, ClipConfig
from engine.vision.qwen25vl import MAX_PICTURE_PIXELS, Qwen25VLPreprocessing, Qwen25VLTower

gguf = pytest.importorskip("gguf")

GEMMA3 = ClipConfig(
    projector="gemma3",
    image_size=32,
    patch_size=4,
    hidden_size=32,
    intermediate_size=48,
    layers=2,
    heads=2,
    projection_dim=64,
    layer_norm_eps=1e-6,
    image_mean=(0.25, 0.5, 0.75),
    image_std=(0.5, 0.25, 0.5),
    scale_factor=2,
    preproc_image_size=0,
    wa_pattern=0,
    window_size=0,
)
QWEN = dataclasses.replace(
    GEMMA3, projector="qwen2.5vl_merger", image_size=560, patch_size=2, scale_factor=0, wa_pattern=2, window_size=8
)


class _Vocabulary:
    """The one thing a VisionModel asks of its tokenizer while it is built: its image token's id."""

    def token_to_id(self, token: str) -> int:
        return 7


def write_projector(path: Path, clip: ClipConfig) -> Path:
    """A projector file of `clip`'s family with its keys as llama.cpp's converter writes them, random tensors."""
    rng = np.random.default_rng(0)
    v = "clip.vision."
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", clip.projector)
    for key, value in (
        ("image_size", clip.image_size),
        ("patch_size", clip.patch_size),
        ("embedding_length", clip.hidden_size),
        ("feed_forward_length", clip.intermediate_size),
        ("block_count", clip.layers),
        ("attention.head_count", clip.heads),
        ("projection_dim", clip.projection_dim),
    ):
        w.add_uint32(v + key, value)
    w.add_float32(v + "attention.layer_norm_epsilon", clip.layer_norm_eps)
    w.add_array(v + "image_mean", list(clip.image_mean))
    w.add_array(v + "image_std", list(clip.image_std))
    if clip.projector == "gemma3":
        w.add_uint32(v + "projector.scale_factor", clip.scale_factor)
    else:
        w.add_uint32(v + "n_wa_pattern", clip.wa_pattern)
        w.add_uint32(v + "window_size", clip.window_size)
    for part in FAMILIES[clip.projector].tensors(clip).values():
        for name in part.gguf:
            w.add_tensor(name, rng.normal(0, 0.05, part.shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_family_read_has_a_loader() -> None:
    assert set(LOADERS) == set(FAMILIES)


def test_gemma3_projector_beside_a_model_is_found_and_loads(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # found by name; the model itself is not read here
    path = write_projector(tmp_path / "mmproj-model-f32.gguf", GEMMA3)
    assert find_mmproj(tmp_path / "model.gguf") == path
    vision = load_mmproj(path, _Vocabulary(), 64, 300)  # type: ignore[arg-type]
    pre = vision.preprocessing
    assert isinstance(vision.tower, Gemma3Tower) and isinstance(pre, Gemma3Preprocessing)
    assert (pre.height, pre.width) == (32, 32)
    assert pre.image_seq_len == vision.tower.tokens_per_frame == (32 // 4 // 2) ** 2
    assert (pre.mean, pre.std) == (GEMMA3.image_mean, GEMMA3.image_std)
    assert vision.weights_id  # the projector's identity salts its pictures' ids


def test_qwen25vl_projector_loads_with_clipcpp_picture_sizes(tmp_path: Path) -> None:
    vision = load_mmproj(write_projector(tmp_path / "mmproj.gguf", QWEN), _Vocabulary(), 64, 300)  # type: ignore[arg-type]
    pre = vision.preprocessing
    assert isinstance(vision.tower, Qwen25VLTower) and isinstance(pre, Qwen25VLPreprocessing)
    assert vision.tower.config.fullatt_block_indexes == (1,)  # every second of two layers
    assert vision.tower.config.window_size == 8
    assert (pre.min_pixels, pre.max_pixels) == (QWEN_MIN_TOKENS * 16, QWEN_MAX_TOKENS * 16)
    assert (pre.mean, pre.std) == (QWEN.image_mean, QWEN.image_std)


def test_qwen25vl_projector_of_huge_pictures_refused(tmp_path: Path) -> None:
    patch = 33  # 4096 merged tokens of 66 x 66 pixels: over our bound on one picture
    assert QWEN_MAX_TOKENS * (2 * patch) ** 2 > MAX_PICTURE_PIXELS
    path = write_projector(tmp_path / "mmproj.gguf", dataclasses.replace(QWEN, patch_size=patch, window_size=132))
    with pytest.raises(ModelLoadError, match=r"would resize a picture to \d+ pixels; MLoT Spark takes at most") as err:
        load_mmproj(path, _Vocabulary(), 64, 300)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)
