"""SmolVLM / Idefics3 image preprocessing, equal to transformers' Idefics3 processor (its Pillow backend): the
picture resized (Lanczos, as 8-bit RGB) so its longest edge is `size`, then up to multiples of the encoder's frame,
cut into frame-sized tiles row by row plus the whole picture resized to one frame (the global view), each scaled to
[0, 1] and normalised. The prompt's one `<image>` becomes the processor's expansion: per tile
`<fake_token_around_image><row_r_col_c>` and `image_seq_len` image tokens, a newline after each row, then the global
view `<fake_token_around_image><global-img>`, its image tokens and a closing `<fake_token_around_image>`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
from PIL import Image

from engine.errors import ModelLoadError
from engine.vision.processor_json import read_processor_json

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TAG = "<global-img>"
MAX_IMAGE_SIZE = 4096  # transformers' own bound on the first resize
MAX_TILES_A_SIDE = 6  # the tokenizer names tiles <row_1_col_1> .. <row_6_col_6>


@dataclass(frozen=True)
class Frames:
    """One picture as the encoder's input: `pixels` (N, 3, F, F) float32, tiles row by row then the global view;
    `rows` x `cols` tiles (0 x 0: the global view only)."""

    pixels: np.ndarray
    rows: int
    cols: int


@dataclass(frozen=True)
class Idefics3Preprocessing:
    """The processor's settings (processor_config.json, or the older preprocessor_config.json)."""

    image_token: ClassVar[str] = IMAGE_TOKEN  # the token its expansion repeats for a frame's rows
    template_marker: ClassVar[str] = IMAGE_TOKEN  # what SmolVLM's chat template writes for an image part
    frame: int  # max_image_size.longest_edge: the side of every tile and of the global view
    longest_edge: int  # size.longest_edge: the first resize
    image_seq_len: int  # image tokens per frame
    splitting: bool = True
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = int(Image.Resampling.LANCZOS)

    @classmethod
    def from_folder(cls, folder: Path) -> Idefics3Preprocessing:
        proc, image = read_processor_json(folder)
        try:
            frame = int(image["max_image_size"]["longest_edge"])
            longest = int(image["size"]["longest_edge"])
            seq = int(proc.get("image_seq_len", 169))
            mean = tuple(float(x) for x in image.get("image_mean", (0.5, 0.5, 0.5)))
            std = tuple(float(x) for x in image.get("image_std", (0.5, 0.5, 0.5)))
            out = cls(
                frame=frame,
                longest_edge=longest,
                image_seq_len=seq,
                splitting=bool(image.get("do_image_splitting", True)),
                mean=(mean[0], mean[1], mean[2]),
                std=(std[0], std[1], std[2]),
                rescale=float(image.get("rescale_factor", 1 / 255)) if image.get("do_rescale", True) else 1.0,
                resample=int(image.get("resample", int(Image.Resampling.LANCZOS))),
            )
        except (KeyError, TypeError, ValueError, IndexError):
            raise ModelLoadError(
                f"{folder.name}'s image processor settings are incomplete; it looks damaged."
            ) from None
        if not (1 <= frame <= 4096 and frame <= longest <= MAX_IMAGE_SIZE and 1 <= seq <= 65536):
            raise ModelLoadError(f"{folder.name}'s image processor sizes are out of range; it looks damaged.")
        if not all(s > 0 and math.isfinite(s) for s in out.std) or out.resample not in range(6):
            raise ModelLoadError(f"{folder.name}'s image processor settings are out of range; it looks damaged.")
        if out.splitting and -(-longest // frame) > MAX_TILES_A_SIDE:
            raise ModelLoadError(f"{folder.name} would cut an image into more tiles than its tokenizer names.")
        return out

    def frames(self, image: Image.Image) -> Frames:
        """An RGB picture -> the encoder's frames, as the processor makes them."""
        img = self._resize(image, *_longest_edge_size(image.height, image.width, self.longest_edge))
        if not self.splitting:
            return Frames(self._normalise([self._resize(img, self.frame, self.frame)]), 0, 0)
        img = self._resize(img, *_multiple_of_frame(img.height, img.width, self.frame))
        h, w, f = img.height, img.width, self.frame
        if h <= f and w <= f:
            return Frames(self._normalise([img]), 0, 0)
        rows, cols = (h - f) // f + 1, (w - f) // f + 1
        tiles = [img.crop((c * f, r * f, c * f + f, r * f + f)) for r in range(rows) for c in range(cols)]
        return Frames(self._normalise([*tiles, self._resize(img, f, f)]), rows, cols)

    def expand(self, frames: Frames) -> str:
        """What the prompt's `<image>` becomes for `frames`."""
        return self.prompt_text(frames.rows, frames.cols)

    def largest_picture(self) -> tuple[str, int]:
        """The largest picture this processor makes, as the Preprocessing protocol says: with splitting, the tiles a
        side of a square picture's resizes (no side of any picture's is longer: the first resize's longest edge,
        the other rounded up to even) on both sides, and the global view; without, the global view alone."""
        side = 0
        if self.splitting:
            h, w = _longest_edge_size(self.longest_edge, self.longest_edge, self.longest_edge)
            side = max(_multiple_of_frame(h, w, self.frame)) // self.frame
        side = side if side > 1 else 0
        return self.prompt_text(side, side, 1), (side * side + 1) * (self.image_seq_len - 1)

    def prompt_text(self, rows: int, cols: int, run: int | None = None) -> str:
        """What the prompt's `<image>` becomes for a picture of rows x cols tiles (`run`: image tokens a frame
        written, image_seq_len unless given)."""
        tokens = IMAGE_TOKEN * (self.image_seq_len if run is None else run)
        glob = f"{FAKE_TOKEN}{GLOBAL_TAG}{tokens}{FAKE_TOKEN}"
        if rows == 0 and cols == 0:
            return glob
        text = "".join(
            "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n" for r in range(rows)
        )
        return f"{text}\n{glob}"

    def _resize(self, img: Image.Image, height: int, width: int) -> Image.Image:
        if (img.height, img.width) == (height, width):
            return img
        return img.resize((width, height), Image.Resampling(self.resample))

    def _normalise(self, frames: list[Image.Image]) -> np.ndarray:
        return normalise(frames, self.rescale, self.mean, self.std)


def normalise(
    frames: list[Image.Image], rescale: float, mean: tuple[float, float, float], std: tuple[float, float, float]
) -> np.ndarray:
    """8-bit RGB frames -> (N, 3, H, W) float32 as transformers' Pillow processors make them: x * rescale in
    float64, then (x - mean) / std in float32."""
    a = np.stack([np.asarray(f, dtype=np.uint8) for f in frames]).astype(np.float64) * rescale
    a = a.astype(np.float32)
    m, s = np.array(mean, np.float32), np.array(std, np.float32)
    out: np.ndarray = ((a - m) / s).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(out)


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' first resize: the longest edge to `longest` (the other rounded up to even), then below 4096."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _multiple_of_frame(height: int, width: int, frame: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: both sides up to multiples of the frame, the aspect kept first."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / frame) * frame
        height = math.ceil(int(width / aspect) / frame) * frame
    else:
        height = math.ceil(height / frame) * frame
        width = math.ceil(int(height * aspect) / frame) * frame
    return height, width
