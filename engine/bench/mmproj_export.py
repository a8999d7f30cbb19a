"""Export a Hugging Face vision-language folder as llama.cpp does: the text model as a GGUF (engine.bench.gguf_export)
and the vision encoder with its projector as an mmproj GGUF (`clip.*` keys, `v.*` and `mm.*` tensors), so llama.cpp's
`mtmd` and our loader read the very same weights.

The names, keys and tensor types are those of llama.cpp's converter (convert_hf_to_gguf.py, `MmprojModel` and its
Idefics3/SmolVLM, Gemma 3 and Qwen2.5-VL subclasses), taken from engine.vision.mmproj's family tables read
backwards. Types per tensor, as the converter picks them: norms, biases and position embeddings F32; SmolVLM's and
Gemma 3's embeddings F32; the patch kernel F16 in an f16 file and F32 otherwise; Gemma 3's input projection F16 in
every file; other matrices in the file's type, a Q8_0 file's rows that are no whole blocks falling back to F16.
Gemma 3's soft embedding norm is written as 1 + w; Qwen2.5-VL's fused qkv is split and its two-frame patch kernel
written as one kernel per frame. From the command line:
    python -m engine.bench.mmproj_export MODEL_DIR OUT_DIR [--dtype f32|f16|q8_0] [--mmproj-dtype f32|f16|q8_0]
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.bench.gguf_export import export_gguf
from engine.errors import SparkError
from engine.loading.weights import mmap_tensors, read_safetensors_header, weight_files
from engine.vision.mmproj import QWEN_FRAMES, ClipConfig, Family, family_of_architecture
from engine.vision.processor_json import read_processor_json

MMPROJ_TYPES = {"f32": ("ALL_F32", "F32"), "f16": ("MOSTLY_F16", "F16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0")}
# What a Gemma 3 folder written by transformers names its encoder, from the name the Hub's checkpoints use.
_GEMMA3_HUB_PREFIX = ("vision_tower.vision_model.", "vision_tower.")


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def clip_of_folder(family: Family, d: dict[str, Any], model_dir: Path) -> ClipConfig:
    """The `clip.*` sizes llama.cpp's converter writes for this folder (its defaults where config.json has none)."""
    v = d.get("vision_config") or {}
    text = d.get("text_config") or {}
    _, proc = read_processor_json(model_dir)
    mean = tuple(float(x) for x in proc.get("image_mean", (0.5, 0.5, 0.5)))
    std = tuple(float(x) for x in proc.get("image_std", (0.5, 0.5, 0.5)))
    common: dict[str, Any] = {
        "projector": family.projector,
        "projection_dim": int(text.get("hidden_size", d.get("hidden_size", 0))),
        "image_mean": (mean[0], mean[1], mean[2]),
        "image_std": (std[0], std[1], std[2]),
    }
    if family.projector == "qwen2.5vl_merger":
        full = [int(i) for i in v.get("fullatt_block_indexes", [])]
        pattern = full[0] + 1 if full else 0
        if not full or any(b - a != pattern for a, b in itertools.pairwise(full)):
            raise SparkError("A Qwen2.5-VL mmproj needs evenly spaced fullatt_block_indexes; this folder has others.")
        if int(v.get("temporal_patch_size", QWEN_FRAMES)) != QWEN_FRAMES or int(v.get("spatial_merge_size", 2)) != 2:
            raise SparkError(
                "llama.cpp's Qwen2.5-VL projector takes 2-frame patches merged 2 x 2; this folder differs."
            )
        return ClipConfig(
            **common,
            image_size=int(v.get("image_size", 560)),
            patch_size=int(v.get("patch_size", 14)),
            hidden_size=int(v.get("hidden_size", 1280)),
            intermediate_size=int(v.get("intermediate_size", 3420)),
            layers=int(v.get("depth", 32)),
            heads=int(v.get("num_heads", 16)),
            layer_norm_eps=float(d.get("rms_norm_eps", text.get("rms_norm_eps", 1e-6))),
            scale_factor=0,
            preproc_image_size=0,
            wa_pattern=pattern,
            window_size=int(v.get("window_size", 112)),
        )
    image, patch = int(v.get("image_size", 224)), int(v.get("patch_size", 32))
    if family.projector == "gemma3":
        per_side = math.isqrt(int(d.get("mm_tokens_per_image", proc.get("image_seq_length", 256))))
        scale = (image // patch) // max(per_side, 1)
        sizes = (1152, 4304, 27, 16)
    else:
        scale = int(d.get("scale_factor", 2))
        sizes = (1152, 3072, 12, 16)
    return ClipConfig(
        **common,
        image_size=image,
        patch_size=patch,
        hidden_size=int(v.get("hidden_size", sizes[0])),
        intermediate_size=int(v.get("intermediate_size", sizes[1])),
        layers=int(v.get("num_hidden_layers", sizes[2])),
        heads=int(v.get("num_attention_heads", sizes[3])),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        scale_factor=scale,
        preproc_image_size=int((proc.get("size") or {}).get("longest_edge", 0))
        if family.projector == "idefics3"
        else 0,
        wa_pattern=0,
        window_size=0,
    )


def _checkpoint(model_dir: Path, family: Family) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        state.update(mmap_tensors(f, read_safetensors_header(f)))
    if family.projector == "gemma3":
        hub, ours = _GEMMA3_HUB_PREFIX
        state = {n.replace(hub, ours, 1) if n.startswith(hub) else n: t for n, t in state.items()}
    return state


def _tensor_type(family: Family, hf: str, gguf_name: str, ndim: int, cols: int, qtype: str) -> str:
    """llama.cpp's converter's choice for one tensor (its forced types first, then the generic rules)."""
    if family.projector == "gemma3" and "input_projection" in hf:
        return "F16"
    if family.projector in ("idefics3", "gemma3") and ".embeddings." in hf:
        return "F32"
    if ".patch_embd.weight" in gguf_name:
        return "F16" if qtype == "F16" else "F32"
    if ndim <= 1 or not gguf_name.endswith(".weight") or ".position_embd." in gguf_name:
        return "F32"
    if qtype == "Q8_0" and cols % 32:
        return "F16"  # the converter's fallback for rows that are no whole blocks
    return qtype


def export_mmproj(model_dir: Path, out: Path, dtype: str = "f16") -> Path:
    """The folder's vision encoder and projector as llama.cpp's mmproj GGUF of `dtype` (f32, f16 or q8_0)."""
    import gguf

    if dtype not in MMPROJ_TYPES:
        raise SparkError(f"The mmproj export writes {', '.join(MMPROJ_TYPES)}, not {dtype!r}.")
    d = _json(model_dir / "config.json")
    family = family_of_architecture(str((d.get("architectures") or [""])[0]))
    if family is None:
        raise SparkError(f"{model_dir.name} is not a vision-language folder of a family the mmproj export knows.")
    clip = clip_of_folder(family, d, model_dir)
    table = family.tensors(clip)
    state = _checkpoint(model_dir, family)
    file_type, qtype = MMPROJ_TYPES[dtype]
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(getattr(gguf.LlamaFileType, file_type))
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(clip.projection_dim)
    w.add_vision_image_size(clip.image_size)
    w.add_vision_patch_size(clip.patch_size)
    w.add_vision_embedding_length(clip.hidden_size)
    w.add_vision_feed_forward_length(clip.intermediate_size)
    w.add_vision_block_count(clip.layers)
    w.add_vision_head_count(clip.heads)
    w.add_vision_image_mean(list(clip.image_mean))
    w.add_vision_image_std(list(clip.image_std))
    w.add_clip_projector_type(family.projector)
    w.add_vision_attention_layernorm_eps(clip.layer_norm_eps)
    if family.projector == "idefics3":
        w.add_vision_projector_scale_factor(clip.scale_factor)
        w.add_vision_use_gelu(True)
        if clip.preproc_image_size:
            w.add_vision_preproc_image_size(clip.preproc_image_size)
    elif family.projector == "gemma3":
        w.add_vision_use_gelu(True)
        if clip.scale_factor != family.default_scale:  # the converter writes it only when not 4
            w.add_vision_projector_scale_factor(clip.scale_factor)
    else:
        w.add_vision_use_silu(True)
        w.add_vision_n_wa_pattern(clip.wa_pattern)
        if clip.window_size != 112:
            w.add_vision_window_size(clip.window_size)
    for hf, part in table.items():
        t = state.get(hf)
        if t is None:
            raise SparkError(f"{model_dir.name} lacks the vision tensor {hf}.")
        a = t.detach().float().numpy() - np.float32(part.add)  # stored as (value - add): 1 + w for Gemma's norm
        if part.join == "rows":
            pieces = np.split(a, len(part.gguf))
        elif part.join == "frames":
            pieces = [a[:, :, k] for k in range(a.shape[2])]
        else:
            pieces = [a]
        for name, piece in zip(part.gguf, pieces, strict=True):
            piece = np.ascontiguousarray(piece, dtype=np.float32)
            if piece.shape != part.shape:
                raise SparkError(f"{model_dir.name}'s {hf} has shape {tuple(t.shape)}, not what its config implies.")
            kind = _tensor_type(family, hf, name, piece.ndim, piece.shape[-1], qtype)
            if kind == "F32":
                w.add_tensor(name, piece)
            elif kind == "F16":
                w.add_tensor(name, piece.astype(np.float16))
            else:
                q = getattr(gguf.GGMLQuantizationType, kind)
                w.add_tensor(name, gguf.quants.quantize(piece, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def export_vision(model_dir: Path, out_dir: Path, dtype: str = "f16", mmproj_dtype: str = "f16") -> tuple[Path, Path]:
    """The folder's text model (`<name>-<dtype>.gguf`) and its projector (`mmproj-<name>-<dtype>.gguf`) in
    `out_dir`, as ggml-org's repos name them. The text model is written by engine.bench.gguf_export, as llama.cpp's
    converter writes a vision folder's text part: Gemma 3's as `gemma3`, Qwen2.5-VL's as `qwen2vl` with its
    multimodal rotary sections."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = model_dir.name
    text = export_gguf(model_dir, out_dir / f"{name}-{dtype}.gguf", dtype)
    mmproj = export_mmproj(model_dir, out_dir / f"mmproj-{name}-{mmproj_dtype}.gguf", mmproj_dtype)
    return text, mmproj


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m engine.bench.mmproj_export", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="a vision-language model folder")
    p.add_argument("out", type=Path, help="the folder to write the two GGUFs into")
    p.add_argument("--dtype", default="f16", help="the text model's type (as engine.bench.gguf_export's)")
    p.add_argument("--mmproj-dtype", default="f16", choices=list(MMPROJ_TYPES))
    args = p.parse_args(argv)
    try:
        for path in export_vision(args.model, args.out, args.dtype, args.mmproj_dtype):
            print(path)
    except SparkError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
