"""Qwen2.5-VL's image path: its processor's preprocessing, its vision transformer (window attention, 2-D rotary,
the 2x2 patch merger), the prompt's image tokens and the multimodal rotary offsets of a conversation's tokens.

Preprocessing equals transformers' Qwen2VLImageProcessor (its Pillow backend): `smart_resize` to sides that are
multiples of patch * merge with the pixel count inside [min_pixels, max_pixels], a Pillow resize with the
processor's resample, x * rescale (float64, then float32), (x - mean) / std, then the patches flattened in the
processor's order: merge x merge blocks of patches row by row, each patch (channel, time, row, column) with the
picture repeated along time (temporal_patch_size). One picture is one frame of engine.vision.model: `Frames.pixels`
is (1, grid_h, grid_w, patch values) — the processor's rows in its order, shaped so the grid travels with them —
and `rows` x `cols` is the merged grid (grid / merge), one image token each.

The tower is transformers' Qwen2_5_VisionTransformerPretrainedModel under its checkpoint names (`visual.`): the
Conv3d patch embedding as one linear over the flattened patches (its kernel covers the whole patch), pre-norm RMSNorm
blocks with a SwiGLU MLP, attention inside windows of `window_size` pixels (windows of merged tokens; the patches
reordered window by window, and the merged rows put back in raster order at the end) except in
`fullatt_block_indexes`, which attend over the whole picture; then the merger (ln_q, each merge x merge block of
patches concatenated, an MLP) into the text model's width.

Multimodal rotary (get_rope_index): a text token's (t, h, w) positions are all the same; an image's tokens sit at
t = base, h = base + row, w = base + col, where base is the position the image's first token would have had; the
text after it continues at base + max(rows, cols). Our slot table rotates by one scalar position (the token's index
while nothing is evicted); `mrope_offsets` gives each token the (dt, dh, dw) that turns that index into its three
positions, derived from the token ids and the registered pictures' grids alone.

Shapes: N patches of one picture, E encoder width, P patch values (3 * temporal * patch * patch), C text width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from engine.errors import ModelLoadError, SparkError
from engine.model.network import RMSNorm
from engine.vision.idefics3 import Frames
from engine.vision.processor_json import read_processor_json
from engine.vision.siglip import Tower

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
TEMPLATE_MARK = VISION_START + IMAGE_PAD + VISION_END  # what Qwen's chat template renders for an image part
MAX_PICTURE_PIXELS = 4096 * 4096  # our own bound on a processor's max_pixels: what one picture may be resized to
MAX_ASPECT = 200  # transformers' smart_resize refuses pictures more elongated than this
# One frame per picture, however many tokens: engine.vision.model reads token k of a picture as frame k // this.
TOKENS_PER_PICTURE_BOUND = 1 << 30
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class PictureShapeError(SparkError):
    """A picture whose shape the model's processor refuses."""


@dataclass(frozen=True)
class Qwen25VLPreprocessing:
    """The image processor's settings (processor_config.json's `image_processor`, or preprocessor_config.json)."""

    patch: int
    merge: int
    temporal: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    rescale: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)
    image_token: ClassVar[str] = IMAGE_PAD
    template_marker: ClassVar[str] = TEMPLATE_MARK  # what Qwen's chat template writes for an image part
    # A picture's token count follows its size (its grid: Frames.rows x cols); no fixed frame either.
    image_seq_len: ClassVar[int] = TOKENS_PER_PICTURE_BOUND
    frame: ClassVar[int] = 0

    @classmethod
    def from_folder(cls, folder: Path) -> Qwen25VLPreprocessing:
        _, image = read_processor_json(folder)
        try:
            size = image.get("size") or {}
            lo = image.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", 56 * 56)))
            hi = image.get("max_pixels", size.get("longest_edge", size.get("max_pixels", 28 * 28 * 1280)))
            mean = tuple(float(x) for x in image.get("image_mean", CLIP_MEAN))
            std = tuple(float(x) for x in image.get("image_std", CLIP_STD))
            out = cls(
                patch=int(image.get("patch_size", 14)),
                merge=int(image.get("merge_size", 2)),
                temporal=int(image.get("temporal_patch_size", 2)),
                min_pixels=int(lo),
                max_pixels=int(hi),
                mean=(mean[0], mean[1], mean[2]) if image.get("do_normalize", True) else (0.0, 0.0, 0.0),
                std=(std[0], std[1], std[2]) if image.get("do_normalize", True) else (1.0, 1.0, 1.0),
                rescale=float(image.get("rescale_factor", 1 / 255)) if image.get("do_rescale", True) else 1.0,
                resample=int(image.get("resample", int(Image.Resampling.BICUBIC))),
            )
        except (AttributeError, TypeError, ValueError, IndexError):
            raise ModelLoadError(
                f"{folder.name}'s image processor settings are incomplete; it looks damaged."
            ) from None
        if not (1 <= out.patch <= 64 and 1 <= out.merge <= 8 and 1 <= out.temporal <= 8):
            raise ModelLoadError(f"{folder.name}'s image processor patch sizes are out of range; it looks damaged.")
        if not 1 <= out.min_pixels <= out.max_pixels <= MAX_PICTURE_PIXELS:
            raise ModelLoadError(
                f"{folder.name}'s image processor allows {out.max_pixels} pixels a picture; MLoT Spark takes at most "
                f"{MAX_PICTURE_PIXELS}."
            )
        if not all(s > 0 and math.isfinite(s) for s in out.std) or out.resample not in range(6):
            raise ModelLoadError(f"{folder.name}'s image processor settings are out of range; it looks damaged.")
        return out

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch * self.merge

    def frames(self, image: Image.Image) -> Frames:
        """An RGB picture -> its patches as the processor makes them, one frame (see the module doc)."""
        h, w = smart_resize(image.height, image.width, self.factor, self.min_pixels, self.max_pixels)
        image = image if image.mode == "RGB" else image.convert("RGB")  # as the processor: RGB, then resized
        if (image.height, image.width) != (h, w):
            image = image.resize((w, h), Image.Resampling(self.resample))
        a = np.asarray(image, dtype=np.uint8).astype(np.float64) * self.rescale
        mean, std = np.array(self.mean, np.float32), np.array(self.std, np.float32)
        x = ((a.astype(np.float32) - mean) / std).transpose(2, 0, 1)  # (3, H, W)
        p, m, gh, gw = self.patch, self.merge, h // self.patch, w // self.patch
        x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (h/m, w/m, m, m, 3, p, p)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], self.temporal, p, p))
        pixels = np.ascontiguousarray(x.reshape(1, gh, gw, 3 * self.temporal * p * p), dtype=np.float32)
        return Frames(pixels, gh // m, gw // m)

    def expand(self, frames: Frames) -> str:
        """What the prompt's marker of one picture becomes: its image tokens between the vision start and end."""
        return VISION_START + IMAGE_PAD * (frames.rows * frames.cols) + VISION_END

    def largest_picture(self) -> tuple[str, int]:
        """The largest grid `smart_resize` gives, as the Preprocessing protocol says: at most max_pixels / factor^2 merged tokens,
        except where a picture at the most elongated aspect it takes would shrink its short side below one factor
        (kept at one factor: its long side's tokens then). A picture enlarged to min_pixels rounds each side up by
        less than a factor: past this only where max_pixels - min_pixels is under factor x (its height + width) +
        factor^2."""
        tokens = self.max_pixels // self.factor**2
        if self.max_pixels < MAX_ASPECT * self.factor**2:  # sqrt(max_pixels / MAX_ASPECT) < factor
            tokens = max(tokens, math.isqrt(self.max_pixels * MAX_ASPECT) // self.factor)
        return VISION_START + IMAGE_PAD + VISION_END, tokens - 1


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: sides rounded to multiples of `factor`, scaled into [min_pixels, max_pixels]."""
    if max(height, width) > MAX_ASPECT * min(height, width):
        raise PictureShapeError(
            f"The picture is {width}x{height}, more elongated than the model's processor takes (at most {MAX_ASPECT}:1)."
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen25VLVisionConfig:
    """`vision_config` of a Qwen2.5-VL config.json."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float = 10000.0
    in_channels: int = 3

    @property
    def tokens_per_frame(self) -> int:
        """A picture is one frame (see TOKENS_PER_PICTURE_BOUND)."""
        return TOKENS_PER_PICTURE_BOUND

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, d: dict[str, Any], text_hidden_size: int) -> Qwen25VLVisionConfig:
        v = d.get("vision_config")
        if not isinstance(v, dict):
            raise ModelLoadError("config.json has no vision_config object; the model folder looks damaged.")
        rope = v.get("rope_parameters")
        try:
            full = v.get("fullatt_block_indexes", [7, 15, 23, 31])
            cfg = cls(
                depth=int(v.get("depth", 32)),
                hidden_size=int(v.get("hidden_size", 1280)),
                intermediate_size=int(v.get("intermediate_size", 3420)),
                num_heads=int(v.get("num_heads", 16)),
                patch_size=int(v.get("patch_size", 14)),
                spatial_merge_size=int(v.get("spatial_merge_size", 2)),
                temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                window_size=int(v.get("window_size", 112)),
                out_hidden_size=int(v.get("out_hidden_size", text_hidden_size)),
                fullatt_block_indexes=tuple(int(i) for i in full),
                rope_theta=float((rope if isinstance(rope, dict) else {}).get("rope_theta", 10000.0)),
                in_channels=int(v.get("in_channels") or v.get("in_chans") or 3),
            )
        except (TypeError, ValueError):
            raise ModelLoadError("config.json's vision_config holds a value that is not a number.") from None
        sizes = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.window_size, cfg.out_hidden_size)
        if not all(1 <= s <= 1 << 16 for s in sizes) or not 1 <= cfg.depth <= 256:
            raise ModelLoadError("config.json's vision_config sizes are out of range; it looks damaged.")
        if not (1 <= cfg.patch_size <= 64 and 1 <= cfg.spatial_merge_size <= 8 and 1 <= cfg.temporal_patch_size <= 8):
            raise ModelLoadError("config.json's vision patch sizes are out of range; it looks damaged.")
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4 or cfg.in_channels != 3:
            raise ModelLoadError("config.json's vision_config sizes do not fit together; it looks damaged.")
        if cfg.window_size < cfg.patch_size * cfg.spatial_merge_size:
            raise ModelLoadError("config.json's vision window is smaller than one merged patch; it looks damaged.")
        if not math.isfinite(cfg.rope_theta) or cfg.rope_theta <= 1.0:
            raise ModelLoadError("config.json's vision rope base is not a usable rotary base.")
        if cfg.out_hidden_size != text_hidden_size:
            raise ModelLoadError(
                f"The vision encoder gives rows of {cfg.out_hidden_size} but the text model is {text_hidden_size} "
                "wide; the model folder does not fit together."
            )
        act = v.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"The vision encoder uses activation {act!r}, which MLoT Spark does not.")
        return cfg


class PatchEmbed(nn.Module):
    def __init__(self, cfg: Qwen25VLVisionConfig) -> None:
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, P) -> (N, E)
        # The kernel covers a whole patch, so the convolution is one product with the flattened kernel.
        return x @ self.proj.weight.reshape(self.proj.weight.shape[0], -1).T


class VisionAttention(nn.Module):
    def __init__(self, cfg: Qwen25VLVisionConfig) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, cfg.hidden_size * 3)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], spans: list[int]) -> torch.Tensor:
        n, e = x.shape
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 2, 0, 3).unbind(0)  # (H, N, D) each
        cos, sin = rope  # (N, D)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Each span (a window, or the whole picture) attends within itself, bidirectionally.
        out = torch.cat(
            [
                F.scaled_dot_product_attention(qs, ks, vs)
                for qs, ks, vs in zip(
                    q.split_with_sizes(spans, 1),
                    k.split_with_sizes(spans, 1),
                    v.split_with_sizes(spans, 1),
                    strict=True,
                )
            ],
            dim=1,
        )  # (H, N, D)
        y: torch.Tensor = self.proj(out.transpose(0, 1).reshape(n, e))
        return y


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate-half rotation: x (H, N, D), cos and sin (N, D)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class VisionMLP(nn.Module):
    def __init__(self, cfg: Qwen25VLVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return y


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen25VLVisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, 1e-6)
        self.norm2 = RMSNorm(cfg.hidden_size, 1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], spans: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, spans)
        y: torch.Tensor = x + self.mlp(self.norm2(x))
        return y


class PatchMerger(nn.Module):
    def __init__(self, cfg: Qwen25VLVisionConfig) -> None:
        super().__init__()
        wide = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, E) -> (N / merge**2, C)
        y: torch.Tensor = self.mlp(self.ln_q(x).reshape(-1, self.mlp[0].in_features))
        return y


class VisionTransformer(nn.Module):
    def __init__(self, cfg: Qwen25VLVisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # (1, gh, gw, P) -> (gh * gw / merge**2, C)
        cfg = self.config
        gh, gw = int(pixels.shape[1]), int(pixels.shape[2])
        m, unit = cfg.spatial_merge_size, cfg.spatial_merge_size**2
        order, spans = window_order(gh // m, gw // m, cfg.window_size // m // cfg.patch_size)
        x = self.patch_embed(pixels.reshape(gh * gw, -1))  # (N, E), merge blocks row by row
        x = x.reshape(-1, unit, x.shape[-1])[order].reshape(gh * gw, -1)  # window by window
        rope = tuple(r.reshape(-1, unit, r.shape[-1])[order].reshape(gh * gw, -1) for r in self._rope(gh, gw))
        cos, sin = rope[0].to(x.dtype), rope[1].to(x.dtype)
        windows, whole = [s * unit for s in spans], [gh * gw]
        for i, block in enumerate(self.blocks):
            x = block(x, (cos, sin), whole if i in cfg.fullatt_block_indexes else windows)
        merged: torch.Tensor = self.merger(x)  # (N / unit, C), window by window
        return merged[torch.argsort(order)]

    def _rope(self, gh: int, gw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, D) of each patch's (row, column), patches in merge-block order."""
        m, half = self.config.spatial_merge_size, self.config.head_dim // 2
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))  # (D/4,)
        rows = torch.arange(gh)[:, None].expand(gh, gw)
        cols = torch.arange(gw)[None, :].expand(gh, gw)
        pos = [p.reshape(gh // m, m, gw // m, m).transpose(1, 2).flatten() for p in (rows, cols)]  # (N,) each
        freqs = torch.stack(pos, dim=1)[..., None].float() * inv_freq  # (N, 2, D/4)
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = torch.cat((cos[:, 0], cos[:, 1]), -1), torch.cat((sin[:, 0], sin[:, 1]), -1)  # (N, D/2)
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


def window_order(rows: int, cols: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """Merged tokens of a rows x cols grid grouped into side x side windows (row by row of windows, raster inside,
    edge windows smaller): (rows*cols,) the raster index of each token in window order, and each window's size."""
    index = torch.arange(rows * cols).reshape(rows, cols)
    order: list[torch.Tensor] = []
    spans: list[int] = []
    for r in range(0, rows, side):
        for c in range(0, cols, side):
            w = index[r : r + side, c : c + side].flatten()
            order.append(w)
            spans.append(int(w.numel()))
    return torch.cat(order), spans


class Qwen25VLTower(Tower):
    """The vision transformer under its checkpoint name (`visual.`): one picture's patches in, one row of the text
    model's width per image token out, in the order the prompt holds its tokens."""

    def __init__(self, cfg: Qwen25VLVisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tokens_per_frame = cfg.tokens_per_frame
        self.image_size = 0  # no fixed frame: the picture's own grid
        self.visual = VisionTransformer(cfg)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # (1, gh, gw, P) -> (tokens, C)
        y: torch.Tensor = self.visual(pixels)
        return y


def fits(preprocessing: Qwen25VLPreprocessing, cfg: Qwen25VLVisionConfig) -> str | None:
    """Why the processor's patches do not fit the encoder, or None."""
    if (preprocessing.patch, preprocessing.merge, preprocessing.temporal) != (
        cfg.patch_size,
        cfg.spatial_merge_size,
        cfg.temporal_patch_size,
    ):
        return (
            f"The processor cuts {preprocessing.patch}-pixel patches merged {preprocessing.merge}x{preprocessing.merge}"
            f" but the vision encoder takes {cfg.patch_size}-pixel patches merged {cfg.spatial_merge_size}x"
            f"{cfg.spatial_merge_size}; the model folder does not fit together."
        )
    return None


def mrope_offsets(
    ids: Sequence[int], vocab_size: int, grid: Callable[[int], tuple[int, int]], start: int = 0
) -> torch.Tensor | None:
    """(T - start, 3) long: the (dt, dh, dw) of tokens `ids[start:]`, what turns each one's index in `ids` (a whole
    conversation, from its first token) into its (t, h, w) rotary positions as transformers' get_rope_index gives
    them; None when the conversation holds no picture (every offset 0). A picture's tokens are one run of ids above
    the vocabulary (the prompt wraps each in its vision start and end); `grid(id)` of a run's first id: the
    picture's merged rows and columns."""
    at = [i for i, t in enumerate(ids) if t >= vocab_size]
    if not at:
        return None
    out = np.zeros((len(ids) - start, 3), dtype=np.int64)
    delta, done = 0, start  # the text's offset so far; tokens before `done` have theirs
    first, rows, cols = -2, 0, 0  # the current run's first index and its picture's grid
    for i in at:
        k = i - first
        if k > rows * cols - 1 or ids[i - 1] < vocab_size:  # a new run: its first id names its picture
            first, k = i, 0
            rows, cols = grid(ids[i])
        if i >= start:
            out[done - start : i - start] = delta
            out[i - start] = (delta - k, delta + k // cols - k, delta + k % cols - k)
            done = i + 1
        if k == rows * cols - 1:  # the picture's last token: the text after it continues at base + max(rows, cols)
            delta += max(rows, cols) - rows * cols
    out[done - start :] = delta
    return torch.from_numpy(out)
