"""Gemma 3's image path (`Gemma3ForConditionalGeneration`): its processor and its projector; the encoder is
engine.vision.siglip's.

Preprocessing equals transformers' Gemma3ImageProcessor (its Pillow backend) as Gemma 3's folders configure it: the
picture resized to the encoder's square (8-bit RGB, the configured resample: bilinear), scaled to [0, 1] and
normalised, one frame a picture. Pan-and-scan (extra crops of a wide or tall picture) is off by default in
transformers and in Gemma 3's published folders; a folder that turns it on is refused. The prompt's one marker
becomes the processor's `full_image_sequence`: "\\n\\n<start_of_image>", `mm_tokens_per_image` image tokens,
"<end_of_image>\\n\\n".

The tower: SigLIP's last hidden state (N, P, E), average-pooled over the patch grid to `mm_tokens_per_image` tokens,
Gemma's RMSNorm (`mm_soft_emb_norm`, scaled by 1 + w in fp32) and one matrix (`mm_input_projection_weight`, E x C).
Those rows go into the text model unscaled: transformers scatters them into the text embeddings after Gemma's
sqrt(hidden) scale, and engine.model.network scales only ids below the vocabulary. A picture's tokens attend to each
other both ways (ModelConfig.images_bidirectional).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image
from torch import nn

from engine.errors import ModelLoadError
from engine.vision.idefics3 import Frames, normalise
from engine.vision.processor_json import read_processor_json
from engine.vision.siglip import SIGLIP_DEFAULTS, Tower, VisionConfig, VisionTransformer

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
MAX_TOKENS_PER_IMAGE = 4096
# Checkpoint names of the tower -> ours. transformers 5 writes the original layout (`vision_tower.`,
# `multi_modal_projector.`, the text model under `language_model.model.`); published folders name the encoder
# `vision_tower.vision_model.`, and transformers' own modules live under `model.`.
NAME_PREFIXES = (
    ("model.vision_tower.vision_model.", "vision_model."),
    ("vision_tower.vision_model.", "vision_model."),
    ("model.vision_tower.", "vision_model."),
    ("vision_tower.", "vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def tower_name(name: str) -> str | None:
    """A checkpoint tensor's name in Gemma3Tower, or None for the text model's."""
    for prefix, ours in NAME_PREFIXES:
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return None


@dataclass(frozen=True)
class Gemma3Preprocessing:
    """Gemma3Processor's settings (processor_config.json, its image processor's nested or in
    preprocessor_config.json)."""

    image_token: ClassVar[str] = SOFT
    template_marker: ClassVar[str] = BOI  # what Gemma 3's chat template writes for an image part
    height: int
    width: int
    image_seq_len: int  # mm_tokens_per_image: image tokens a picture
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = int(Image.Resampling.BILINEAR)

    @property
    def frame(self) -> int:
        """The side of the square the encoder takes (0 when the configured size is not square)."""
        return self.height if self.height == self.width else 0

    @classmethod
    def from_folder(cls, folder: Path) -> Gemma3Preprocessing:
        proc, image = read_processor_json(folder)
        if image.get("do_pan_and_scan"):
            raise ModelLoadError(
                f"{folder.name} asks for pan-and-scan crops of its pictures, which MLoT Spark does not make."
            )
        if image.get("do_resize") is False or image.get("do_normalize") is False:
            raise ModelLoadError(f"{folder.name}'s image processor skips resizing or normalising; it looks damaged.")
        try:
            size = image.get("size", {"height": 896, "width": 896})
            mean = tuple(float(x) for x in image.get("image_mean", (0.5, 0.5, 0.5)))
            std = tuple(float(x) for x in image.get("image_std", (0.5, 0.5, 0.5)))
            out = cls(
                height=int(size["height"]),
                width=int(size["width"]),
                image_seq_len=int(proc.get("image_seq_length", 256)),
                mean=(mean[0], mean[1], mean[2]),
                std=(std[0], std[1], std[2]),
                rescale=float(image.get("rescale_factor", 1 / 255)) if image.get("do_rescale", True) else 1.0,
                resample=int(image.get("resample", int(Image.Resampling.BILINEAR))),
            )
        except (KeyError, TypeError, ValueError, IndexError):
            raise ModelLoadError(
                f"{folder.name}'s image processor settings are incomplete; it looks damaged."
            ) from None
        if not (1 <= out.height <= 4096 and 1 <= out.width <= 4096 and 1 <= out.image_seq_len <= MAX_TOKENS_PER_IMAGE):
            raise ModelLoadError(f"{folder.name}'s image processor sizes are out of range; it looks damaged.")
        numbers = (*out.mean, *out.std, out.rescale)
        if not all(math.isfinite(x) for x in numbers) or min(out.std) <= 0 or out.resample not in range(6):
            raise ModelLoadError(f"{folder.name}'s image processor settings are out of range; it looks damaged.")
        return out

    def frames(self, image: Image.Image) -> Frames:
        """An RGB picture -> its one frame, as the processor makes it."""
        if (image.height, image.width) != (self.height, self.width):
            image = image.resize((self.width, self.height), Image.Resampling(self.resample))
        return Frames(normalise([image], self.rescale, self.mean, self.std), 0, 0)

    def expand(self, frames: Frames) -> str:
        """What the prompt's marker becomes: Gemma3Processor's full_image_sequence."""
        return f"\n\n{BOI}{SOFT * self.image_seq_len}{EOI}\n\n"

    def largest_picture(self) -> tuple[str, int]:
        """Every picture, as the Preprocessing protocol says: one frame of `mm_tokens_per_image` tokens."""
        return f"\n\n{BOI}{SOFT}{EOI}\n\n", self.image_seq_len - 1


class RMSNorm(nn.Module):
    """Gemma's: x / rms(x) * (1 + w), in fp32 as transformers computes it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class Projector(nn.Module):
    """Gemma3MultiModalProjector: (N, P, E) -> (N, tokens, C)."""

    def __init__(self, cfg: VisionConfig, tokens: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(cfg.hidden_size, cfg.text_hidden_size))
        self.mm_soft_emb_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.side = cfg.patches_per_side
        self.kernel = self.side // math.isqrt(tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, e = x.shape
        grid = x.transpose(1, 2).reshape(n, e, self.side, self.side)  # (N, E, side, side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # (N, T, E)
        y = torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)  # (N, T, C)
        return y.type_as(x)


class Gemma3Tower(Tower):
    """SigLIP and Gemma 3's projector under our names for the checkpoint's (tower_name)."""

    def __init__(self, cfg: VisionConfig, tokens: int) -> None:
        super().__init__()
        self.config = cfg
        self.tokens_per_frame = tokens
        self.image_size = cfg.image_size
        self.vision_model = VisionTransformer(cfg)
        self.multi_modal_projector = Projector(cfg, tokens)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # (N, 3, S, S) -> (N * tokens, C)
        y: torch.Tensor = self.multi_modal_projector(self.vision_model(pixels))
        return y.reshape(-1, y.shape[-1])


def build_tower(d: dict[str, Any], text_hidden_size: int) -> Gemma3Tower:
    """The tower a Gemma 3 config.json describes (on the current default device: meta, to assign weights to)."""
    cfg = VisionConfig.from_dict(d, text_hidden_size, SIGLIP_DEFAULTS)
    try:
        tokens = int(d.get("mm_tokens_per_image", 256))
    except (TypeError, ValueError):
        raise ModelLoadError("config.json's mm_tokens_per_image is not a number; it looks damaged.") from None
    side = math.isqrt(max(tokens, 1))
    if not 1 <= tokens <= MAX_TOKENS_PER_IMAGE or side * side != tokens or cfg.patches_per_side % side:
        raise ModelLoadError(
            f"config.json's mm_tokens_per_image ({tokens}) is not a square that divides the encoder's "
            f"{cfg.patches_per_side} x {cfg.patches_per_side} patches; it looks damaged."
        )
    return Gemma3Tower(cfg, tokens)
