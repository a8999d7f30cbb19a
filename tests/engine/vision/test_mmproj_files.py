"""llama.cpp's mmproj files read and written: Gemma 3's and Qwen2.5-VL's tensors and config survive a write by our
exporter (from checkpoints transformers wrote) and a read by our reader, with llama.cpp's tensor types; Idefics3's
names are the tower's; and a hostile projector file is refused in one sentence each (unknown projector type, a
missing or extra tensor, a shape its clip config does not imply, a projection that does not fit the text model,
non-finite values, a truncated file, a file that is no projector), as is an ambiguous pair of projectors beside a
model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.bench.mmproj_export import export_mmproj
from engine.errors import ModelLoadError
from engine.loading.model_files import gguf_file_of
from engine.loading.weights import mmap_tensors, read_safetensors_header
from engine.vision.gguf_vision import find_mmproj, load_mmproj
from engine.vision.mmproj import FAMILIES, ClipConfig, Mmproj, read_mmproj
from engine.vision.siglip import VisionConfig, VisionTower
from tests.helpers.gguf_files import write_gguf
from tests.helpers.tiny import make_tiny_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TINY = ClipConfig(
    projector="idefics3",
    image_size=16,
    patch_size=4,
    hidden_size=32,
    intermediate_size=64,
    layers=2,
    heads=2,
    projection_dim=64,
    layer_norm_eps=1e-6,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    scale_factor=2,
    preproc_image_size=32,
    wa_pattern=0,
    window_size=0,
)


def clip_keys(clip: ClipConfig) -> dict[str, Any]:
    v = "clip.vision."
    return {
        "clip.has_vision_encoder": True,
        "clip.projector_type": clip.projector,
        v + "image_size": clip.image_size,
        v + "patch_size": clip.patch_size,
        v + "embedding_length": clip.hidden_size,
        v + "feed_forward_length": clip.intermediate_size,
        v + "block_count": clip.layers,
        v + "attention.head_count": clip.heads,
        v + "projection_dim": clip.projection_dim,
        v + "attention.layer_norm_epsilon": clip.layer_norm_eps,
        v + "image_mean": list(clip.image_mean),
        v + "image_std": list(clip.image_std),
        v + "projector.scale_factor": clip.scale_factor,
        v + "preproc_image_size": clip.preproc_image_size,
    }


def write_mmproj(
    path: Path,
    keys: dict[str, Any] | None = None,
    tensors: dict[str, np.ndarray | None] | None = None,
    architecture: str = "clip",
) -> Path:
    """A projector file with TINY's keys and random tensors, `keys` and `tensors` changed (None: left out)."""
    rng = np.random.default_rng(0)
    table = FAMILIES[TINY.projector].tensors(TINY)
    arrays: dict[str, np.ndarray | None] = {
        g: rng.normal(0, 0.05, part.shape).astype(np.float32) for part in table.values() for g in part.gguf
    }
    arrays.update(tensors or {})
    w = gguf.GGUFWriter(str(path), architecture)
    for key, value in {**clip_keys(TINY), **(keys or {})}.items():
        if value is None:
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, a in arrays.items():
        if a is not None:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny text model's GGUF (not a projector)."""
    root = tmp_path_factory.mktemp("text")
    return write_gguf(make_tiny_model(root / "hf"), root / "text.gguf", "f32")


def test_idefics3_names_and_config_are_the_towers(tmp_path: Path) -> None:
    m = read_mmproj(write_mmproj(tmp_path / "mmproj.gguf"))
    cfg = VisionConfig.from_dict(m.config, TINY.projection_dim)
    with torch.device("meta"):
        tower = VisionTower(cfg)
    state = dict(m.state_dict())
    assert {n.removeprefix("model.") for n in state} == set(tower.state_dict())
    assert cfg.tokens_per_frame == (16 // 4) ** 2 // 4 and cfg.scale_factor == 2


HOSTILE: dict[str, tuple[dict[str, Any], dict[str, np.ndarray | None], str]] = {
    "unknown projector": ({"clip.projector_type": "ldp"}, {}, "'ldp' projector"),
    "no projector type": ({"clip.projector_type": None}, {}, "names no projector type"),
    "missing tensor": ({}, {"v.blk.1.attn_q.weight": None}, "lacks the tensor v.blk.1.attn_q.weight"),
    "extra tensor": ({}, {"v.blk.2.attn_q.weight": np.zeros((32, 32), np.float32)}, "does not have"),
    "wrong shape": ({}, {"mm.model.fc.weight": np.zeros((64, 64), np.float32)}, "clip configuration implies"),
    "shape of another config": ({"clip.vision.embedding_length": 64}, {}, "clip configuration implies"),
    "sizes that do not divide": ({"clip.vision.attention.head_count": 3}, {}, "do not divide"),
    "absurd size": ({"clip.vision.block_count": 1 << 20}, {}, "not a whole number"),
    "no size": ({"clip.vision.patch_size": None}, {}, "lacks clip.vision.patch_size"),
    "bad mean": ({"clip.vision.image_mean": [0.5, 0.5]}, {}, "three finite numbers"),
    "non-finite": ({}, {"v.blk.0.ffn_up.weight": np.full((64, 32), np.nan, np.float32)}, "NaN or infinite"),
    "no encoder": ({"clip.has_vision_encoder": False}, {}, "no vision encoder"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_projector_files_refused_in_one_sentence(case: str, tmp_path: Path) -> None:
    keys, tensors, words = HOSTILE[case]
    path = write_mmproj(tmp_path / "mmproj.gguf", keys, tensors)
    with pytest.raises(ModelLoadError) as err:
        read_mmproj(path)
    message = str(err.value)
    assert words in message and "\n" not in message and message.endswith(".")


def test_truncated_and_foreign_files_refused(tmp_path: Path, tiny_text: Path) -> None:
    path = write_mmproj(tmp_path / "mmproj.gguf")
    data = path.read_bytes()
    cut = tmp_path / "mmproj-cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="truncated"):
        read_mmproj(cut)
    with pytest.raises(ModelLoadError, match="not a projector file"):
        read_mmproj(tiny_text)


def test_projection_that_does_not_fit_the_text_model(tmp_path: Path) -> None:
    path = write_mmproj(tmp_path / "mmproj.gguf")
    with pytest.raises(
        ModelLoadError,
        match=r"does not fit this model: mmproj\.gguf writes rows of 64 values but the model's width is 96",
    ):
        load_mmproj(path, None, 96, 400)  # type: ignore[arg-type]  # refused before the tokenizer is used


def test_projector_beside_a_model_is_found_only_when_unambiguous(tmp_path: Path, tiny_text: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_bytes(tiny_text.read_bytes())
    assert find_mmproj(tmp_path) is None
    first = write_mmproj(tmp_path / "mmproj-model-f16.gguf")
    assert gguf_file_of(tmp_path) == text  # the projector beside it is not a second model
    assert find_mmproj(text) == first and find_mmproj(tmp_path) == first
    write_mmproj(tmp_path / "mmproj-model-q8_0.gguf")
    with pytest.raises(ModelLoadError, match=r"several projector files .* choose one with --mmproj"):
        find_mmproj(text)
    assert find_mmproj(text, first) == first
    with pytest.raises(ModelLoadError, match="does not exist"):
        find_mmproj(text, tmp_path / "missing.gguf")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="--mmproj goes with a GGUF model"):
        find_mmproj(folder, first)


# -- Gemma 3 and Qwen2.5-VL: written by our exporter from transformers' checkpoints, read back ----------------------


def gemma3_folder(out: Path) -> Path:
    cfg = transformers.Gemma3Config(
        text_config={
            "vocab_size": 300,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 4,
        },
        mm_tokens_per_image=16,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0, 0.1)
    model.save_pretrained(out)
    return out


def qwen25vl_folder(out: Path) -> Path:
    cfg = transformers.Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 300,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        vision_config={
            "depth": 4,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1, 3],
            "window_size": 112,
            "patch_size": 14,
        },
    )
    torch.manual_seed(0)
    transformers.Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(out)
    return out


FOLDERS = {"gemma3": gemma3_folder, "qwen2.5vl_merger": qwen25vl_folder}


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    f = folder / "model.safetensors"
    return mmap_tensors(f, read_safetensors_header(f))


@pytest.mark.parametrize("projector", sorted(FOLDERS))
def test_round_trip_keeps_tensors_and_config(projector: str, tmp_path: Path) -> None:
    folder = FOLDERS[projector](tmp_path / "model")
    m = read_mmproj(export_mmproj(folder, tmp_path / "mmproj.gguf", "f32"))
    assert m.clip.projector == projector and m.clip.projection_dim == 64
    state, saved = dict(m.state_dict()), checkpoint(folder)
    assert state, "no tensors read"
    for name, t in state.items():
        expected = saved[name].float()
        if "input_projection" in name:  # F16 in every file, as llama.cpp's converter writes it
            expected = expected.half().float()
        if "soft_emb_norm" in name:  # stored as 1 + w: the scale 1 + w the model multiplies by is kept exactly
            t, expected = t + 1, expected + 1
        assert torch.equal(t, expected), name
    hf = transformers.AutoConfig.from_pretrained(folder).vision_config.to_dict()
    ours = m.config["vision_config"]
    # the eps goes through a float32 key; Gemma's pooling head is not in an mmproj (llama.cpp drops it)
    shared = set(ours) & set(hf) - {"hidden_act", "vision_use_head", "layer_norm_eps"}
    assert shared and {k: ours[k] for k in shared} == {k: hf[k] for k in shared}
    assert ours.get("layer_norm_eps", 1e-6) == pytest.approx(hf.get("layer_norm_eps", 1e-6), rel=1e-6)
    if projector == "gemma3":
        assert m.config["mm_tokens_per_image"] == 16 and m.clip.scale_factor == 2
    else:
        assert ours["fullatt_block_indexes"] == [1, 3] and m.clip.wa_pattern == 2


@pytest.mark.parametrize("projector", sorted(FOLDERS))
def test_tensor_types_as_llamacpp_writes_them(projector: str, tmp_path: Path) -> None:
    folder = FOLDERS[projector](tmp_path / "model")
    types = {}
    for dtype in ("f16", "q8_0"):
        m = Mmproj(export_mmproj(folder, tmp_path / f"mmproj-{dtype}.gguf", dtype))
        types[dtype] = {t.name: t.type_name for t in m.header.tensors}
        table, stored = m.family.tensors(m.clip), m.stored_tensors()
        # every matrix as the file stores it (blocks and floats alike), each block-typed one among them
        assert all(t.qtype == types[dtype][table[hf].gguf[0]] for hf, t in stored.items())
        assert {hf for hf, part in table.items() if types[dtype][part.gguf[0]] == "Q8_0"} <= set(stored)
        assert any(t.qtype == "F16" for t in stored.values()) == (dtype == "f16" or projector == "gemma3")
    f16, q8 = types["f16"], types["q8_0"]
    assert f16["v.blk.0.ln1.weight"] == "F32" and f16["v.blk.0.attn_q.bias"] == "F32"
    assert f16["v.blk.0.attn_q.weight"] == "F16" and q8["v.blk.0.attn_q.weight"] == "Q8_0"
    if projector == "gemma3":
        assert f16["mm.input_projection.weight"] == q8["mm.input_projection.weight"] == "F16"
        assert f16["v.patch_embd.weight"] == f16["v.position_embd.weight"] == "F32"
    else:
        assert f16["v.patch_embd.weight"] == f16["v.patch_embd.weight.1"] == "F16"
        assert q8["v.patch_embd.weight"] == "F32" and q8["mm.2.weight"] == "Q8_0"
