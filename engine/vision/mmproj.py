"""llama.cpp's multimodal projector files (`mmproj*.gguf`): a vision encoder and its projector beside a text GGUF.

An mmproj is a GGUF whose `general.architecture` is `clip`: `clip.projector_type` names the family, `clip.vision.*`
its sizes and its processor's mean and std, and its tensors are `v.*` (the encoder) and `mm.*` (the projector), as
llama.cpp's converter (convert_hf_to_gguf.py, `MmprojModel` and its subclasses) writes them and `tools/mtmd/clip.cpp`
reads them. `read_mmproj` turns one into what a Hugging Face folder would give: its `config.json` (the family's
`vision_config`) and its tensors under the folder's checkpoint names, kept as stored (`stored_tensors`: block-typed
matrices for backends that run them as stored) or as fp32 (`state_dict`).

A family is one entry of `FAMILIES`: each checkpoint tensor, the GGUF tensors it comes from (llama.cpp splits
Qwen2.5-VL's fused qkv and its two-frame patch kernel) and the shape the `clip.*` sizes imply. The file is hostile
input: its header is read under bounds (engine.loading.gguf_header) before anything is allocated, sizes are checked
against limits and against each other, every tensor must be one the family has, with its shape and a type we read,
every tensor the family needs must be there, and the values must be finite. Each refusal is one sentence.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import ModelLoadError
from engine.loading.gguf import BLOCK_TYPES, FLOAT_TYPES
from engine.loading.gguf_header import GGUFHeader, TensorInfo, read_header, tensor_view
from engine.model.quant import BlockType, StoredTensor, check_stored, scales_finite

CLIP_ARCHITECTURE = "clip"
MAX_SIDE = 8192  # pixels of an encoder's square input
MAX_WIDTH = 1 << 16  # channels of any encoder, MLP or projection
MAX_LAYERS = 256
DEFAULT_QWEN_WINDOW = 112  # Qwen2.5-VL's window attention, pixels a side (transformers' default; llama.cpp's too)

Join = str  # how a checkpoint tensor is built from its GGUF tensors: "one", "rows" (concatenated) or "frames"


@dataclass(frozen=True)
class ClipConfig:
    """The `clip.*` keys of an mmproj, checked."""

    projector: str
    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    projection_dim: int  # the text model's width the projector writes
    layer_norm_eps: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    scale_factor: int  # Idefics3's pixel shuffle, Gemma 3's pooling kernel (0 where the family has none)
    preproc_image_size: int  # Idefics3's first resize (0: not stated)
    wa_pattern: int  # Qwen2.5-VL: every n-th layer attends globally, however many layers (0 elsewhere)
    window_size: int  # Qwen2.5-VL's attention window, pixels (0 elsewhere)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class Part:
    """A checkpoint tensor's GGUF source: the GGUF tensors, how they join, what is added to every value on the way
    (Gemma 3's soft embedding norm is stored as 1 + w), and the shape of each GGUF tensor (torch order)."""

    gguf: tuple[str, ...]
    shape: tuple[int, ...]
    join: Join = "one"
    add: float = 0.0


Table = dict[str, Part]  # checkpoint name -> where it comes from


@dataclass(frozen=True)
class Family:
    projector: str  # clip.projector_type
    architecture: str  # config.json's architectures[0] for such a folder
    default_scale: int  # clip.vision.projector.scale_factor when the file does not state it
    tensors: Callable[[ClipConfig], Table]
    config: Callable[[ClipConfig], dict[str, Any]]


def _siglip(cfg: ClipConfig, prefix: str) -> Table:
    """The SigLIP encoder shared by Idefics3 and Gemma 3, under the checkpoint `prefix`."""
    e, f, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    t: Table = {
        f"{prefix}embeddings.patch_embedding.weight": Part(("v.patch_embd.weight",), (e, 3, p, p)),
        f"{prefix}embeddings.patch_embedding.bias": Part(("v.patch_embd.bias",), (e,)),
        f"{prefix}embeddings.position_embedding.weight": Part(
            ("v.position_embd.weight",), (cfg.patches_per_side**2, e)
        ),
        f"{prefix}post_layernorm.weight": Part(("v.post_ln.weight",), (e,)),
        f"{prefix}post_layernorm.bias": Part(("v.post_ln.bias",), (e,)),
    }
    layer = {
        "layer_norm1": ("ln1", (e,), None),
        "self_attn.q_proj": ("attn_q", (e, e), (e,)),
        "self_attn.k_proj": ("attn_k", (e, e), (e,)),
        "self_attn.v_proj": ("attn_v", (e, e), (e,)),
        "self_attn.out_proj": ("attn_out", (e, e), (e,)),
        "layer_norm2": ("ln2", (e,), None),
        "mlp.fc1": ("ffn_up", (f, e), (f,)),
        "mlp.fc2": ("ffn_down", (e, f), (e,)),
    }
    for i in range(cfg.layers):
        for hf, (short, weight, bias) in layer.items():
            t[f"{prefix}encoder.layers.{i}.{hf}.weight"] = Part((f"v.blk.{i}.{short}.weight",), weight)
            t[f"{prefix}encoder.layers.{i}.{hf}.bias"] = Part((f"v.blk.{i}.{short}.bias",), bias or weight)
    return t


def _idefics3_tensors(cfg: ClipConfig) -> Table:
    t = _siglip(cfg, "model.vision_model.")
    width = cfg.hidden_size * cfg.scale_factor**2
    t["model.connector.modality_projection.proj.weight"] = Part(("mm.model.fc.weight",), (cfg.projection_dim, width))
    return t


def _idefics3_config(cfg: ClipConfig) -> dict[str, Any]:
    return {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "scale_factor": cfg.scale_factor,
        "vision_config": {**_siglip_config(cfg), "hidden_act": "gelu_pytorch_tanh"},
    }


def _gemma3_tensors(cfg: ClipConfig) -> Table:
    t = _siglip(cfg, "vision_tower.")
    e = cfg.hidden_size
    t["multi_modal_projector.mm_input_projection_weight"] = Part(
        ("mm.input_projection.weight",), (e, cfg.projection_dim)
    )  # stored (in, out), as the checkpoint holds it; llama.cpp transposes it when it multiplies
    t["multi_modal_projector.mm_soft_emb_norm.weight"] = Part(("mm.soft_emb_norm.weight",), (e,), add=-1.0)
    return t


def _gemma3_config(cfg: ClipConfig) -> dict[str, Any]:
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "mm_tokens_per_image": (cfg.patches_per_side // cfg.scale_factor) ** 2,
        "vision_config": {**_siglip_config(cfg), "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False},
    }


def _siglip_config(cfg: ClipConfig) -> dict[str, Any]:
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "image_size": cfg.image_size,
        "patch_size": cfg.patch_size,
        "layer_norm_eps": cfg.layer_norm_eps,
        "num_channels": 3,
    }


QWEN_MERGE = 2  # Qwen2.5-VL merges 2 x 2 patches into one token; llama.cpp fixes it too
QWEN_FRAMES = 2  # its patch kernel spans two frames; llama.cpp stores one 2-D kernel per frame


def _qwen25vl_tensors(cfg: ClipConfig) -> Table:
    e, f, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    merged = e * QWEN_MERGE**2
    t: Table = {
        "visual.patch_embed.proj.weight": Part(
            ("v.patch_embd.weight", "v.patch_embd.weight.1"), (e, 3, p, p), "frames"
        ),
        "visual.merger.ln_q.weight": Part(("v.post_ln.weight",), (e,)),
        "visual.merger.mlp.0.weight": Part(("mm.0.weight",), (merged, merged)),
        "visual.merger.mlp.0.bias": Part(("mm.0.bias",), (merged,)),
        "visual.merger.mlp.2.weight": Part(("mm.2.weight",), (cfg.projection_dim, merged)),
        "visual.merger.mlp.2.bias": Part(("mm.2.bias",), (cfg.projection_dim,)),
    }
    for i in range(cfg.layers):
        b, v = f"visual.blocks.{i}.", f"v.blk.{i}."
        t[b + "norm1.weight"] = Part((v + "ln1.weight",), (e,))
        t[b + "norm2.weight"] = Part((v + "ln2.weight",), (e,))
        for part, shape in (("weight", (e, e)), ("bias", (e,))):
            t[f"{b}attn.qkv.{part}"] = Part(tuple(f"{v}attn_{x}.{part}" for x in "qkv"), shape, "rows")
            t[f"{b}attn.proj.{part}"] = Part((f"{v}attn_out.{part}",), shape)
        for hf, short, weight, bias in (
            ("gate_proj", "ffn_gate", (f, e), (f,)),
            ("up_proj", "ffn_up", (f, e), (f,)),
            ("down_proj", "ffn_down", (e, f), (e,)),
        ):
            t[f"{b}mlp.{hf}.weight"] = Part((f"{v}{short}.weight",), weight)
            t[f"{b}mlp.{hf}.bias"] = Part((f"{v}{short}.bias",), bias)
    return t


def _qwen25vl_config(cfg: ClipConfig) -> dict[str, Any]:
    n = cfg.wa_pattern
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "vision_config": {
            "depth": cfg.layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_heads": cfg.heads,
            "out_hidden_size": cfg.projection_dim,
            "patch_size": cfg.patch_size,
            "spatial_merge_size": QWEN_MERGE,
            "temporal_patch_size": QWEN_FRAMES,
            "window_size": cfg.window_size,
            "fullatt_block_indexes": [i for i in range(cfg.layers) if (i + 1) % n == 0],
            "hidden_act": "silu",
            "in_channels": 3,
        },
    }


FAMILIES: dict[str, Family] = {
    f.projector: f
    for f in (
        Family("idefics3", "Idefics3ForConditionalGeneration", 2, _idefics3_tensors, _idefics3_config),
        Family("gemma3", "Gemma3ForConditionalGeneration", 4, _gemma3_tensors, _gemma3_config),
        Family("qwen2.5vl_merger", "Qwen2_5_VLForConditionalGeneration", 0, _qwen25vl_tensors, _qwen25vl_config),
    )
}


def family_of_architecture(architecture: str) -> Family | None:
    return next((f for f in FAMILIES.values() if f.architecture == architecture), None)


# -- the file ------------------------------------------------------------------------------------------------------


class Mmproj:
    """One opened mmproj: its checked `clip` config, the folder-style `config`, and its tensors by checkpoint name."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.name = self.path.name
        self.header: GGUFHeader = read_header(self.path)  # every size and offset bounded before anything else
        meta = self.header.metadata
        if meta.get("general.architecture") != CLIP_ARCHITECTURE:
            raise ModelLoadError(
                f"{self.name} is not a projector file (its general.architecture is "
                f"{str(meta.get('general.architecture'))[:40]!r}, not 'clip')."
            )
        if meta.get("clip.has_vision_encoder") is not True:
            raise ModelLoadError(f"{self.name} holds no vision encoder (clip.has_vision_encoder is not true).")
        self.clip = clip_config(self.name, meta)
        self.family = FAMILIES[self.clip.projector]
        self.config: dict[str, Any] = self.family.config(self.clip)
        self._table = self.family.tensors(self.clip)
        self._infos = {t.name: t for t in self.header.tensors}
        self._check_table()
        try:
            with self.path.open("rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{self.name} cannot be mapped ({exc.__class__.__name__}).") from None
        self._mapping: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8)

    def _check_table(self) -> None:
        wanted = {g: part.shape for part in self._table.values() for g in part.gguf}
        for t in self.header.tensors:
            shape = wanted.get(t.name)
            if shape is None:
                raise ModelLoadError(
                    f"{self.name} has a tensor {t.name} that a {self.clip.projector} projector does not have; "
                    "the file does not match its clip configuration."
                )
            if tuple(reversed(t.dims)) != shape:
                raise ModelLoadError(
                    f"{self.name} has a tensor {t.name} of shape {list(t.dims)} where its clip configuration implies "
                    f"{list(reversed(shape))}."
                )
            if t.type_name not in FLOAT_TYPES + BLOCK_TYPES:
                raise ModelLoadError(f"{self.name} stores {t.name} as {t.type_name}, a type MLoT Spark does not read.")
            if len(shape) != 2 and t.type_name not in FLOAT_TYPES:
                raise ModelLoadError(f"{self.name} stores {t.name} as {t.type_name}; only matrices may be blocks.")
        for name in wanted:
            if name not in self._infos:
                raise ModelLoadError(f"{self.name} lacks the tensor {name}; the file is incomplete.")
        for hf, part in self._table.items():
            kinds = {self._infos[g].type_name for g in part.gguf}
            if len(kinds) > 1:
                raise ModelLoadError(f"{self.name} stores the parts of {hf} in different types; the file is damaged.")

    def check_width(self, text_hidden_size: int) -> None:
        """One sentence unless the projector writes rows of the text model's width."""
        if self.clip.projection_dim != text_hidden_size:
            raise ModelLoadError(
                f"The projector file does not fit this model: {self.name} writes rows of "
                f"{self.clip.projection_dim} values but the model's width is {text_hidden_size}."
            )

    def _view(self, name: str) -> np.ndarray:
        return tensor_view(self._mapping, self.header, self._infos[name])

    def stored_tensors(self) -> dict[str, StoredTensor]:
        """Every matrix by checkpoint name, as stored (fused rows joined: a copy of the same blocks or floats)."""
        out: dict[str, StoredTensor] = {}
        for hf, part in self._table.items():
            info = self._infos[part.gguf[0]]
            kinds = BLOCK_TYPES + FLOAT_TYPES
            if info.type_name not in kinds or len(part.shape) != 2 or part.join == "frames" or part.add:
                continue
            views = [self._view(g) for g in part.gguf]
            data = views[0] if len(views) == 1 else np.concatenate(views)
            out[hf] = StoredTensor(info.type_name, (int(data.shape[0]), part.shape[1]), data)
        return out

    def check_data(self) -> None:
        """Every tensor's values finite (a block's scales, a float tensor's values), one tensor at a time."""
        for t in self.header.tensors:
            if t.type_name in BlockType.__members__:
                blocks = StoredTensor(t.type_name, (t.dims[1], t.dims[0]), self._view(t.name))
                try:
                    check_stored(blocks, t.name)
                except ValueError as exc:
                    raise ModelLoadError(f"{self.name}: {exc}; the file is damaged.") from None
                finite = scales_finite(blocks)
            else:
                finite = bool(np.isfinite(_floats(self._view(t.name), t)).all())
            if not finite:
                raise ModelLoadError(f"{self.name}: tensor {t.name} holds NaN or infinite values; the file is damaged.")

    def state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, fp32 tensor) one at a time, each a copy the caller owns."""
        for hf, part in self._table.items():
            arrays = [_floats(self._view(g), self._infos[g]).reshape(part.shape) for g in part.gguf]
            if part.join == "rows":
                value = np.concatenate(arrays)
            elif part.join == "frames":  # (E, 3, p, p) per frame -> (E, 3, frames, p, p)
                value = np.stack(arrays, axis=2)
            else:
                value = arrays[0]
            if part.add:
                value = value + np.float32(part.add)
            yield hf, torch.from_numpy(np.array(value, dtype=np.float32))


def _floats(view: np.ndarray, t: TensorInfo) -> np.ndarray:
    """A tensor's values as float32, whatever its stored type."""
    if t.type_name == "F32":
        return view
    if t.type_name == "F16":
        return view.astype(np.float32)
    if t.type_name == "BF16":
        return (np.asarray(view).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    import gguf

    try:
        values: np.ndarray = gguf.quants.dequantize(view, getattr(gguf.GGMLQuantizationType, t.type_name))
    except Exception as exc:
        raise ModelLoadError(
            f"Tensor {t.name} cannot be decoded ({exc.__class__.__name__}); the file is damaged."
        ) from None
    return values


def _whole(meta: dict[str, Any], name: str, key: str, lo: int, hi: int, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise ModelLoadError(f"{name} lacks {key}; the projector file is incomplete.")
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ModelLoadError(f"{name} gives {key} = {str(value)[:40]}, which is not a whole number from {lo} to {hi}.")
    return value


def _triple(
    meta: dict[str, Any], name: str, key: str, default: tuple[float, float, float]
) -> tuple[float, float, float]:
    value = meta.get(key, list(default))
    if (
        not isinstance(value, list)
        or len(value) != 3
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    ):
        raise ModelLoadError(f"{name} gives {key} that is not three finite numbers.")
    return float(value[0]), float(value[1]), float(value[2])


def clip_config(name: str, meta: dict[str, Any]) -> ClipConfig:
    """The `clip.*` keys of a projector file, each checked (type, range, how the sizes divide)."""
    projector = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    if projector is None:
        raise ModelLoadError(f"{name} names no projector type (clip.projector_type); the projector file is incomplete.")
    if not isinstance(projector, str) or projector not in FAMILIES:
        known = ", ".join(FAMILIES)
        raise ModelLoadError(f"{name} is a {str(projector)[:40]!r} projector; MLoT Spark reads the {known} projectors.")
    family = FAMILIES[projector]
    v = "clip.vision."
    eps = meta.get(v + "attention.layer_norm_epsilon", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ModelLoadError(
            f"{name} gives {v}attention.layer_norm_epsilon = {str(eps)[:40]}, not a small positive number."
        )
    std = _triple(meta, name, v + "image_std", (0.5, 0.5, 0.5))
    if not all(s > 0 for s in std):
        raise ModelLoadError(f"{name} gives {v}image_std with a value that is not positive.")
    qwen = projector == "qwen2.5vl_merger"
    cfg = ClipConfig(
        projector=projector,
        image_size=_whole(meta, name, v + "image_size", 1, MAX_SIDE),
        patch_size=_whole(meta, name, v + "patch_size", 1, MAX_SIDE),
        hidden_size=_whole(meta, name, v + "embedding_length", 1, MAX_WIDTH),
        intermediate_size=_whole(meta, name, v + "feed_forward_length", 1, MAX_WIDTH * 4),
        layers=_whole(meta, name, v + "block_count", 1, MAX_LAYERS),
        heads=_whole(meta, name, v + "attention.head_count", 1, MAX_WIDTH),
        projection_dim=_whole(meta, name, v + "projection_dim", 1, MAX_WIDTH),
        layer_norm_eps=float(eps),
        image_mean=_triple(meta, name, v + "image_mean", (0.5, 0.5, 0.5)),
        image_std=std,
        scale_factor=0 if qwen else _whole(meta, name, v + "projector.scale_factor", 1, 64, family.default_scale),
        preproc_image_size=_whole(meta, name, v + "preproc_image_size", 0, MAX_SIDE, 0)
        if projector == "idefics3"
        else 0,
        wa_pattern=_whole(meta, name, v + "n_wa_pattern", 1, MAX_LAYERS) if qwen else 0,
        window_size=_whole(meta, name, v + "window_size", 1, MAX_SIDE, DEFAULT_QWEN_WINDOW) if qwen else 0,
    )
    if cfg.hidden_size % cfg.heads:
        raise ModelLoadError(
            f"{name} splits {cfg.hidden_size} channels into {cfg.heads} heads; the sizes do not divide."
        )
    if not qwen and (cfg.image_size % cfg.patch_size or cfg.patches_per_side % cfg.scale_factor):
        raise ModelLoadError(f"{name}'s image, patch and scale sizes do not divide; the projector file is damaged.")
    return cfg


def read_mmproj(path: Path) -> Mmproj:
    """An mmproj opened and checked (header, config, every tensor's name, shape and type, finite values)."""
    m = Mmproj(path)
    m.check_data()
    return m
