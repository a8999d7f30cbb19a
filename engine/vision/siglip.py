"""The SigLIP vision encoder, gpt-fast sized: patches (a strided conv) plus learned positions, pre-norm layers of full
(bidirectional) attention and a GELU MLP, a final LayerNorm. SmolVLM / Idefics3's connector follows it here (its
pixel shuffle, each scale x scale block of patches folded into one vector, and one linear into the text model's
width); Gemma 3's projector is engine.vision.gemma3's. Module and parameter names mirror Hugging Face's, so the
checkpoint's tensors load without renaming.

Shapes: N frames, P patches a frame (a square), E encoder width, C the text model's width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


# SigLIP's sizes where a config.json leaves them out: transformers' defaults differ by family (Idefics3VisionConfig's,
# SiglipVisionConfig's), and a saved config keeps only what differs from its class's.
IDEFICS3_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 32,
    "scale_factor": 2,
}
SIGLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 16,
    "scale_factor": 1,  # no pixel shuffle
}


@dataclass(frozen=True)
class VisionConfig:
    """`vision_config` of a config.json, with Idefics3's connector scale (1 elsewhere) and the text model's width."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    scale_factor: int
    text_hidden_size: int
    num_channels: int = 3

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        """Image tokens one frame gives after the pixel shuffle."""
        return self.patches_per_side**2 // self.scale_factor**2

    @classmethod
    def from_dict(
        cls, d: dict[str, Any], text_hidden_size: int, defaults: dict[str, Any] = IDEFICS3_DEFAULTS
    ) -> VisionConfig:
        v = d.get("vision_config")
        if not isinstance(v, dict):
            raise ModelLoadError("config.json has no vision_config object; the model folder looks damaged.")
        try:
            cfg = cls(
                hidden_size=int(v.get("hidden_size", defaults["hidden_size"])),
                intermediate_size=int(v.get("intermediate_size", defaults["intermediate_size"])),
                num_hidden_layers=int(v.get("num_hidden_layers", defaults["num_hidden_layers"])),
                num_attention_heads=int(v.get("num_attention_heads", defaults["num_attention_heads"])),
                image_size=int(v.get("image_size", defaults["image_size"])),
                patch_size=int(v.get("patch_size", defaults["patch_size"])),
                layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
                hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
                scale_factor=int(d.get("scale_factor", defaults["scale_factor"])),
                text_hidden_size=text_hidden_size,
                num_channels=int(v.get("num_channels", 3)),
            )
        except (TypeError, ValueError):
            raise ModelLoadError("config.json's vision_config holds a value that is not a number.") from None
        sizes = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.patch_size, cfg.scale_factor)
        if not all(1 <= s <= 1 << 16 for s in sizes) or not 1 <= cfg.num_hidden_layers <= 256:
            raise ModelLoadError("config.json's vision_config sizes are out of range; it looks damaged.")
        if cfg.hidden_size % cfg.num_attention_heads or not 1 <= cfg.image_size <= 8192 or cfg.num_channels != 3:
            raise ModelLoadError("config.json's vision_config sizes do not fit together; it looks damaged.")
        if cfg.image_size % cfg.patch_size or cfg.patches_per_side % cfg.scale_factor:
            raise ModelLoadError("config.json's image, patch and scale sizes do not divide; it looks damaged.")
        if cfg.hidden_act not in ACTIVATIONS or not math.isfinite(cfg.layer_norm_eps):
            raise ModelLoadError(f"The vision encoder uses activation {cfg.hidden_act!r}, which MLoT Spark does not.")
        return cfg


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        e, p = cfg.hidden_size, cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, e, kernel_size=p, stride=p, padding="valid")
        self.position_embedding = nn.Embedding(cfg.patches_per_side**2, e)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # (N, 3, S, S) -> (N, P, E)
        x: torch.Tensor = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        # Every frame is a whole image_size square, so transformers' fractional position buckets are 0..P-1.
        return x + self.position_embedding.weight[None, : x.shape[1]]


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        e = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(e, e), nn.Linear(e, e), nn.Linear(e, e)
        self.out_proj = nn.Linear(e, e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, P, E) -> (N, P, E)
        n, p, e = x.shape
        q, k, v = (
            proj(x).view(n, p, self.heads, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)  # (N, H, P, D), all patches see each other
        y: torch.Tensor = self.out_proj(out.transpose(1, 2).reshape(n, p, e))
        return y


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))
        return y


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        y: torch.Tensor = x + self.mlp(self.layer_norm2(x))
        return y


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # (N, 3, S, S) -> (N, P, E)
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        y: torch.Tensor = self.post_layernorm(x)
        return y


class Projection(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size * cfg.scale_factor**2, cfg.text_hidden_size, bias=False)


class Connector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.scale = cfg.scale_factor
        self.modality_projection = Projection(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, P, E) -> (N, P / scale**2, C)
        y: torch.Tensor = self.modality_projection.proj(pixel_shuffle(x, self.scale))
        return y


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """(N, P, E) -> (N, P / scale**2, E * scale**2), transformers' Idefics3 order: each row's scale neighbours first,
    then the rows of the block."""
    n, p, e = x.shape
    side = math.isqrt(p)
    x = x.reshape(n, side, side // scale, e * scale).permute(0, 2, 1, 3)
    x = x.reshape(n, side // scale, side // scale, e * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(n, p // scale**2, e * scale * scale)


class Tower(nn.Module):
    """A family's vision tower: frames (N, 3, S, S), S = `image_size`, in; `tokens_per_frame` rows a frame of the
    text model's width out, (N * tokens_per_frame, C)."""

    tokens_per_frame: int
    image_size: int


class VisionTower(Tower):
    """SmolVLM / Idefics3's: the encoder and the connector under their checkpoint names (`vision_model.`,
    `connector.`)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tokens_per_frame = cfg.tokens_per_frame
        self.image_size = cfg.image_size
        self.vision_model = VisionTransformer(cfg)
        self.connector = Connector(cfg)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # (N, 3, S, S) -> (N * tokens_per_frame, C)
        y: torch.Tensor = self.connector(self.vision_model(pixels))
        return y.reshape(-1, y.shape[-1])
