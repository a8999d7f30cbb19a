"""A vision-language model's image path: its vision tower loaded from the folder, and pictures turned into prompt
tokens.

An image enters the prompt as ordinary token ids, so the generation loop, the memory cascade and the prefix cache
need no image type of their own: each of the image's token positions gets an id above the vocabulary derived from
the picture's content hash and its index (`ImageEmbedding.register`), and `ImageEmbedding` — wrapped around the text
model's embedding lookup — gives those ids the vision tower's output rows. The encoder runs lazily, frame by frame,
the first time one of a frame's ids is embedded: tokens the prefix cache restores are never embedded, so a second
question about the same picture reads none of the tokens the restored prefix covers, encodes only the frames of
those it reads again, and in this process encodes nothing again. The same picture gives the same ids in every
process (the hash covers the preprocessing's settings too; the model's fingerprint keys the cache on the tower's
weights), so the persistent prefix cache keys on its content; two pictures sharing a prefix would need every one of
their ids to coincide (a 31-bit hash each).

A family (`FAMILIES`, by the folder's architecture) gives the rest: its preprocessing (pictures to frames, and what
the prompt's `<image>` marker becomes), its tower (frames to rows of the text model's width) and which checkpoint
tensors are the tower's: SmolVLM / Idefics3 (engine.vision.idefics3, siglip) and Gemma 3 (engine.vision.gemma3).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from PIL import Image
from torch import nn

from engine.errors import ModelLoadError, SparkError
from engine.loading.tokenizer import Tokenizer
from engine.loading.weights import mmap_tensors, read_safetensors_header, weight_files
from engine.model.config import IMAGE_ID_LIMIT, VISION_ARCHITECTURES, ModelConfig
from engine.model.network import Transformer
from engine.model.quant import StoredTensor
from engine.vision import gemma3
from engine.vision.idefics3 import IMAGE_TOKEN, Frames, Idefics3Preprocessing
from engine.vision.images import DecodedImage
from engine.vision.qwen25vl import (
    Qwen25VLPreprocessing,
    Qwen25VLTower,
    Qwen25VLVisionConfig,
    fits,
    mrope_offsets,
)
from engine.vision.siglip import Tower, VisionConfig, VisionTower

MAX_HELD_IMAGES = 16  # pictures whose frames or features are held for embedding, most recent first
MAX_GRIDS = 65536  # Qwen2.5-VL: pictures whose grids a conversation's ids still name, most recent kept
ID_CEILING = IMAGE_ID_LIMIT


class Preprocessing(Protocol):
    """A family's processor: a picture's frames, and what the prompt's `<image>` marker becomes for them."""

    @property
    def image_token(self) -> str:
        """The token the expansion repeats, once per image row."""
        ...

    @property
    def template_marker(self) -> str:
        """What the family's chat template writes for an image part (the processor's own marker)."""
        ...

    @property
    def image_seq_len(self) -> int:
        """Image tokens a frame gives."""
        ...

    @property
    def frame(self) -> int:
        """The side of the square frames it cuts."""
        ...

    def frames(self, image: Image.Image) -> Frames: ...

    def expand(self, frames: Frames) -> str: ...

    def largest_picture(self) -> tuple[str, int]:
        """The largest picture the processor makes (VisionModel.max_picture_tokens): its expansion with one image
        token a run, and how many more image tokens its runs hold (counted, not written: a folder's settings may
        ask for millions)."""
        ...


@dataclass(frozen=True)
class Family:
    """What a vision-language architecture brings to the shared image path."""

    tower: Callable[[dict[str, Any], int], Tower]  # (config.json, text width) -> the tower, built on meta
    tower_name: Callable[[str], str | None]  # a checkpoint tensor's name in the tower, None for the text model's
    preprocessing: Callable[[Path], Preprocessing]


def _idefics3_name(name: str) -> str | None:
    return name.removeprefix("model.") if name.startswith(("model.vision_model.", "model.connector.")) else None


def _qwen25vl_name(name: str) -> str | None:  # transformers 5 writes `visual.`, as Qwen's own folders do
    return name.removeprefix("model.") if name.startswith(("visual.", "model.visual.")) else None


FAMILIES: dict[str, Family] = {
    "Idefics3ForConditionalGeneration": Family(
        lambda d, width: VisionTower(VisionConfig.from_dict(d, width)),
        _idefics3_name,
        Idefics3Preprocessing.from_folder,
    ),
    "Gemma3ForConditionalGeneration": Family(
        gemma3.build_tower, gemma3.tower_name, gemma3.Gemma3Preprocessing.from_folder
    ),
    "Qwen2_5_VLForConditionalGeneration": Family(
        lambda d, width: Qwen25VLTower(Qwen25VLVisionConfig.from_dict(d, width)),
        _qwen25vl_name,
        Qwen25VLPreprocessing.from_folder,
    ),
}


# Backends running a converted program whose embedding lookup ImageEmbedding cannot wrap: `auto` passes over them
# for a model that sees images (engine.backends.open_backend's `passed_over`), so a Mac opens it on MPS.
PICTURES_ELSEWHERE: dict[str, str] = {
    name: "a model that sees images runs its pictures on MPS, CUDA or the CPU" for name in ("coreml", "mlx")
}
# Families a PictureHost (the Core ML host, which embeds ids itself) runs: a plain causal text model with ordinary
# rotary. Gemma 3's pictures attend both ways and Qwen2.5-VL's rotary is multimodal, which its programs do not take.
PICTURES_ON_HOST = frozenset({"Idefics3ForConditionalGeneration"})


def architecture(folder: Path) -> str | None:
    """The first of a Hugging Face folder's `architectures`; None where it has no readable one."""
    try:
        d = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    arch = (d.get("architectures") or [None])[0] if isinstance(d, dict) else None
    return arch if isinstance(arch, str) else None


def backends_passed_over(model_dir: Path, projector: Path | None) -> dict[str, str]:
    """The backends `auto` passes over for this model: PICTURES_ELSEWHERE where it sees images (a vision folder, or
    a GGUF with its projector), except Core ML for a folder of PICTURES_ON_HOST; none for a text model."""
    if projector is None and architecture(model_dir) in PICTURES_ON_HOST:
        return {name: why for name, why in PICTURES_ELSEWHERE.items() if name != "coreml"}
    return dict(PICTURES_ELSEWHERE) if projector is not None or is_vision_folder(model_dir) else {}


class ImageInputError(SparkError):
    """Images given to a model that cannot take them, or in a number its prompt does not place."""


@runtime_checkable
class TowerHost(Protocol):
    """A backend that runs a vision tower where it runs the text model (TorchBackend: its device, or the native
    kernels' block products); `stored` holds weights as a file stores them, by Hugging Face name."""

    def place_tower(self, tower: nn.Module, stored: Mapping[str, StoredTensor] | None = None) -> str:
        """Move `tower` in place; the line saying where it runs."""
        ...


@runtime_checkable
class PictureHost(Protocol):
    """A backend that looks its embedding up itself (the Core ML host) and takes a picture's rows from a callable:
    ids (n,) int64 at or above the vocabulary -> (n, C) float rows (engine.backends.coreml.host.PictureRows)."""

    config: ModelConfig

    def take_pictures(self, rows: Callable[[np.ndarray], np.ndarray]) -> None: ...

    def picture_tower(self, tower: Tower) -> tuple[Tower, str]:
        """The tower its pictures run on (its own encoder program, or `tower`), and the line saying where."""
        ...


def is_vision_folder(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a vision-language model engine.vision runs."""
    return architecture(path) in VISION_ARCHITECTURES


@dataclass
class _Held:
    frames: Frames | None  # until every frame is encoded
    features: dict[int, torch.Tensor]  # frame -> its rows (tokens_per_frame, C), once encoded


class ImageEmbedding(nn.Module):
    """The text model's embedding lookup with image rows: ids below the vocabulary go to `inner`, ids of a
    registered picture to the vision tower's rows for it (encoded on first use, then kept)."""

    def __init__(self, inner: nn.Module | None, vocab_size: int, tower: Tower, salt: str = "") -> None:
        super().__init__()
        self.inner = inner  # None where the backend looks text rows up itself (a PictureHost): picture_rows only
        self.salt = salt  # the preprocessing's settings: other settings, other features, other ids
        self.vocab_size = vocab_size
        self.tower = tower
        self.rows: dict[int, tuple[str, int]] = {}  # id -> (picture hash, its row)
        self.counts: dict[str, int] = {}  # picture hash -> its token count
        self.held: OrderedDict[str, _Held] = OrderedDict()
        self.encoded_frames = 0  # frames run through the tower since load: what tests and benchmarks count

    def register(self, image: DecodedImage, frames: Frames, count: int) -> list[int]:
        """The `count` ids of `image`'s tokens (the same ids for the same bytes in every process)."""
        if image.sha256 not in self.held:
            self.held[image.sha256] = _Held(frames, {})
        self.held.move_to_end(image.sha256)
        while len(self.held) > MAX_HELD_IMAGES:
            gone, _ = self.held.popitem(last=False)
            self.rows = {i: r for i, r in self.rows.items() if r[0] != gone}
            self.counts.pop(gone, None)
        self.counts[image.sha256] = count
        ids = []
        for k in range(count):
            i = _image_token_id(self.salt + image.sha256, k, self.vocab_size)
            while self.rows.get(i, (image.sha256, k)) != (image.sha256, k):  # another picture's: the next free id
                i = self.vocab_size + (i - self.vocab_size + 1) % (ID_CEILING - self.vocab_size)
            self.rows[i] = (image.sha256, k)
            ids.append(i)
        return ids

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        if self.inner is None:
            raise ImageInputError("This picture embedding has no text lookup; its backend embeds text itself.")
        mask = ids >= self.vocab_size
        if not bool(mask.any()):
            out: torch.Tensor = self.inner(ids)
            return out
        out = self.inner(torch.where(mask, torch.zeros_like(ids), ids))
        at = mask.nonzero(as_tuple=False)
        picked = self.picture_rows([int(ids[b, t]) for b, t in at.tolist()])
        out[at[:, 0], at[:, 1]] = picked.to(device=out.device, dtype=out.dtype)
        return out

    def picture_rows(self, ids: Sequence[int]) -> torch.Tensor:
        """Held pictures' ids -> their rows (n, C) in the tower's dtype; ImageInputError for one not held."""
        return torch.stack([self._row(i) for i in ids])

    def _row(self, token_id: int) -> torch.Tensor:
        where = self.rows.get(token_id)
        if where is None:
            raise ImageInputError("The prompt holds an image token whose picture is no longer held; attach it again.")
        sha, k = where
        held = self.held[sha]
        per = self.tower.tokens_per_frame
        frame = k // per
        rows = held.features.get(frame)
        if rows is None:
            # One frame at a time: a frame's rows are the same bits whichever of its picture's frames a prompt
            # reads, so a tail re-read after a prefix restore encodes only the frames it holds.
            assert held.frames is not None  # held until every frame is encoded
            p = next(self.tower.parameters(), None)  # None: a program's tower (Core ML), fed fp32 on the CPU
            with torch.no_grad():
                pixels = torch.from_numpy(held.frames.pixels[frame : frame + 1])
                if p is not None:
                    pixels = pixels.to(device=p.device, dtype=p.dtype)
                rows = held.features[frame] = self.tower(pixels)
            self.encoded_frames += 1
            if len(held.features) == held.frames.pixels.shape[0]:
                held.frames = None
        return rows[k % per]


def _image_token_id(sha256: str, index: int, vocab_size: int) -> int:
    h = int.from_bytes(hashlib.sha256(f"{sha256}:{index}".encode()).digest()[:8], "little")
    return vocab_size + h % (ID_CEILING - vocab_size)


class VisionModel:
    """A vision-language model's image path for a loaded text model (SmolVLM / Idefics3, Gemma 3, Qwen2.5-VL): the
    preprocessing, the tower, and the prompt. The prompt marks each picture with `<image>`; the family's
    preprocessing says what it becomes."""

    def __init__(
        self,
        preprocessing: Preprocessing,
        tower: Tower,
        tokenizer: Tokenizer,
        vocab_size: int,
        weights_id: str = "",
    ) -> None:
        self.preprocessing = preprocessing
        # Where the text model's fingerprint does not cover the tower (a GGUF and its mmproj): the tower's identity,
        # in the ids' salt, so the prefix cache never gives one projector's features for another's picture.
        self.weights_id = weights_id
        self.tower = tower
        self.tokenizer = tokenizer
        image_id = tokenizer.token_to_id(preprocessing.image_token)
        if image_id is None:
            raise ModelLoadError(
                f"The model's tokenizer has no {preprocessing.image_token} token; its folder looks damaged."
            )
        self.image_token_id = image_id
        self.vocab_size = vocab_size
        self.embedding: ImageEmbedding | None = None
        self.placement = "vision encoder: PyTorch cpu float32"  # where the tower runs (TowerHost.place_tower)
        # Qwen2.5-VL: the first id of a picture's tokens -> its rows x cols, for every picture registered (not only
        # those held), so a long conversation's offsets still find its early pictures.
        self.grids: dict[int, tuple[int, int]] = {}
        if isinstance(preprocessing, Qwen25VLPreprocessing) or isinstance(tower, Qwen25VLTower):
            why = (
                fits(preprocessing, tower.config)
                if isinstance(preprocessing, Qwen25VLPreprocessing) and isinstance(tower, Qwen25VLTower)
                else "The image processor and the vision encoder are of different model families."
            )
            if why:
                raise ModelLoadError(why)
            return
        if preprocessing.image_seq_len != tower.tokens_per_frame:
            raise ModelLoadError(
                f"The processor gives {preprocessing.image_seq_len} image tokens a frame but the vision encoder "
                f"{tower.tokens_per_frame}; the model folder does not fit together."
            )
        if preprocessing.frame != tower.image_size:
            raise ModelLoadError(
                f"The processor makes {preprocessing.frame or 'non-square'}-pixel frames but the vision encoder "
                f"takes {tower.image_size}; the model folder does not fit together."
            )

    @property
    def _salt(self) -> str:
        return hashlib.sha256((repr(self.preprocessing) + self.weights_id).encode()).hexdigest()[:16]

    def attach_host(self, host: PictureHost) -> ImageEmbedding:
        """Give `host` (which embeds text ids itself) the rows of this model's pictures' ids."""
        embedding = ImageEmbedding(None, self.vocab_size, self.tower, self._salt)
        self.embedding = embedding

        def rows(ids: np.ndarray) -> np.ndarray:
            return embedding.picture_rows(ids.tolist()).float().cpu().numpy()

        host.take_pictures(rows)
        return embedding

    def attach(self, model: Transformer) -> ImageEmbedding:
        """Wrap `model`'s embedding lookup (whatever the backend installed) so image ids embed as pictures."""
        backbone = model.model
        if not isinstance(backbone.embed_tokens, ImageEmbedding):
            backbone.embed_tokens = ImageEmbedding(backbone.embed_tokens, self.vocab_size, self.tower, self._salt)
        embedding = backbone.embed_tokens
        assert isinstance(embedding, ImageEmbedding)
        self.embedding = embedding
        if model.config.mrope_section:
            model.position_offsets = self.position_offsets
        return embedding

    def picture_token(self, token_id: int) -> tuple[int, int] | None:
        """(its index in its picture, the picture's token count) for a held picture's id; None for any other id.
        What the memory cascade keeps a picture a unit by (engine.memory.cascade.pictures)."""
        if token_id < self.vocab_size or self.embedding is None:
            return None
        where = self.embedding.rows.get(token_id)
        return None if where is None else (where[1], self.embedding.counts[where[0]])

    @functools.cached_property
    def max_picture_tokens(self) -> int:
        """Tokens of the largest picture's expansion, wrappers included (an upper bound on any picture's span in a
        prompt: special tokens split the text around it the same way in any context; the image token is one). What the memory reserves
        retrieval room for (engine.session.setup.seeing_pictures)."""
        text, more = self.preprocessing.largest_picture()
        return len(self.tokenizer.encode(text, add_bos=False)) + more

    def markers(self, text: str) -> str:
        """A rendered prompt with the family's own image marker (what its chat template writes for an image part:
        Gemma 3's `<start_of_image>`) as the engine's `<image>`."""
        marker = self.preprocessing.template_marker
        return text if marker == IMAGE_TOKEN else text.replace(marker, IMAGE_TOKEN)

    def prompt_text(self, text: str, images: Sequence[DecodedImage]) -> tuple[str, list[Frames]]:
        """`text` with each `<image>` (one per picture, in order; or the family's own marker) expanded as the
        processor does, and the frames."""
        text = self.markers(text)
        if text.count(IMAGE_TOKEN) != len(images):
            raise ImageInputError(f"The prompt places {text.count(IMAGE_TOKEN)} images but {len(images)} were given.")
        frames = [self.preprocessing.frames(img.image) for img in images]
        pieces = text.split(IMAGE_TOKEN)
        out = [pieces[0]]
        for f, rest in zip(frames, pieces[1:], strict=True):
            out += [self.preprocessing.expand(f), rest]
        return "".join(out), frames

    def image_ids(self, ids: Sequence[int], images: Sequence[DecodedImage], frames: Sequence[Frames]) -> list[int]:
        """Token ids of an expanded prompt with each picture's `<image>` runs replaced by its own ids."""
        if self.embedding is None:
            raise ImageInputError("The vision model is not attached to a loaded text model.")
        out = list(ids)
        at = [i for i, t in enumerate(out) if t == self.image_token_id]
        need = sum(self._count(f) for f in frames)
        if len(at) != need:
            raise ImageInputError(f"The prompt holds {len(at)} image tokens where its pictures need {need}.")
        start = 0
        for img, f in zip(images, frames, strict=True):
            count = self._count(f)
            for i, token in zip(at[start : start + count], self._register(img, f, count), strict=True):
                out[i] = token
            start += count
        return out

    def _count(self, f: Frames) -> int:
        """Image tokens of one picture's frames."""
        if isinstance(self.preprocessing, Qwen25VLPreprocessing):
            return f.rows * f.cols
        return int(f.pixels.shape[0]) * self.preprocessing.image_seq_len

    def _register(self, image: DecodedImage, f: Frames, count: int) -> list[int]:
        assert self.embedding is not None
        ids = self.embedding.register(image, f, count)
        if isinstance(self.preprocessing, Qwen25VLPreprocessing) and ids:
            self.grids.pop(ids[0], None)
            self.grids[ids[0]] = (f.rows, f.cols)
            if len(self.grids) > MAX_GRIDS:
                del self.grids[next(iter(self.grids))]
        return ids

    def position_offsets(self, ids: Sequence[int], start: int = 0) -> torch.Tensor | None:
        """(T - start, 3) long: the multimodal rotary offsets of `ids[start:]`, `ids` a conversation's tokens from
        its first, derived from the ids and the registered pictures (engine.vision.qwen25vl.mrope_offsets); None for
        a model without multimodal rotary or a conversation without pictures."""
        if not isinstance(self.preprocessing, Qwen25VLPreprocessing):
            return None

        def grid(first: int) -> tuple[int, int]:
            found = self.grids.get(first)
            if found is None:
                raise ImageInputError("The conversation holds image tokens of a picture never attached here.")
            return found

        return mrope_offsets(ids, self.vocab_size, grid, start)

    def register(self, images: Sequence[DecodedImage]) -> set[int]:
        """Every id `images` stand for in a prompt (a restored conversation's pictures, so its ids embed again)."""
        if self.embedding is None:
            raise ImageInputError("The vision model is not attached to a loaded text model.")
        distinct = {img.sha256: img for img in images}
        if len(distinct) > MAX_HELD_IMAGES:
            raise ImageInputError(
                f"The conversation holds {len(distinct)} pictures; at most {MAX_HELD_IMAGES} can be held at once."
            )
        ids: set[int] = set()
        for img in distinct.values():
            f = self.preprocessing.frames(img.image)
            ids.update(self._register(img, f, self._count(f)))
        return ids

    def encode_prompt(self, text: str, images: Sequence[DecodedImage], add_bos: bool | None = None) -> list[int]:
        """A rendered prompt holding one `<image>` per picture -> its token ids, pictures included (`add_bos` as
        Tokenizer.encode's)."""
        expanded, frames = self.prompt_text(text, images)
        return self.image_ids(self.tokenizer.encode(expanded, add_bos=add_bos), images, frames)


def attach_vision(folder: Path, tokenizer: Tokenizer, backend: object) -> VisionModel | None:
    """The image path of a vision-language folder, wrapped around `backend`'s text model; None for a text model."""
    if not is_vision_folder(folder):
        return None
    model = getattr(backend, "model", None)
    if not isinstance(model, Transformer):
        if isinstance(backend, PictureHost) and architecture(folder) in PICTURES_ON_HOST:
            # the tower in PyTorch on the CPU, its rows fed to the host's programs as fp16 (docs/DESIGN.md, "Images")
            vision = load_vision(folder, tokenizer, backend.config.hidden_size, backend.config.vocab_size)
            vision.tower, vision.placement = backend.picture_tower(vision.tower)
            vision.attach_host(backend)
            return vision
        raise not_on_this_backend(folder)
    vision = load_vision(folder, tokenizer, model.config.hidden_size, model.config.vocab_size)
    return seat(vision, model, backend)


def not_on_this_backend(path: Path) -> ModelLoadError:
    """The sentence for a model that sees images, opened on a backend whose text model ImageEmbedding cannot wrap."""
    return ModelLoadError(
        f"{path.name} sees images only on the CPU, CUDA or MPS backends; choose one of them with --backend."
    )


def seat(
    vision: VisionModel, model: Transformer, backend: object, stored: Mapping[str, StoredTensor] | None = None
) -> VisionModel:
    """`vision`'s tower placed where `backend` runs `model` (TowerHost: its matrices from `stored` where given, as a
    file stores them), and its embedding wrapped around `model`'s lookup."""
    if isinstance(backend, TowerHost):
        vision.placement = backend.place_tower(vision.tower, stored)
    vision.attach(model)
    return vision


def load_vision(folder: Path, tokenizer: Tokenizer, text_hidden_size: int, vocab_size: int) -> VisionModel:
    """The vision tower of a Hugging Face vision-language folder (a family of FAMILIES), fp32 on the CPU, and its
    preprocessing."""
    d = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    family = FAMILIES[(d.get("architectures") or [""])[0]]
    state: dict[str, torch.Tensor] = {}
    named: dict[str, str] = {}  # ours -> the checkpoint's, for the sentences
    for f in weight_files(folder):
        table = [t for t in read_safetensors_header(f) if family.tower_name(t.name) is not None]
        for theirs, tensor in mmap_tensors(f, table).items():
            ours = family.tower_name(theirs)
            assert ours is not None  # the table holds the tower's only
            state[ours], named[ours] = tensor, theirs
    with torch.device("meta"):
        tower = family.tower(d, text_hidden_size)
    expected = tower.state_dict()
    for name, ref in expected.items():
        t = state.get(name)
        if t is None:
            raise ModelLoadError(f"The vision weights lack {name}; they do not match the model's configuration.")
        if tuple(t.shape) != tuple(ref.shape) or not t.is_floating_point():
            raise ModelLoadError(
                f"Vision tensor {named[name]} has shape {tuple(t.shape)} but the configuration implies "
                f"{tuple(ref.shape)}."
            )
        if not bool(torch.isfinite(t.float().sum())):
            raise ModelLoadError(f"Vision tensor {named[name]} holds NaN or infinite values; the file is corrupt.")
    tower.load_state_dict({n: state[n].float() for n in expected}, strict=True, assign=True)
    tower.eval().requires_grad_(False)
    return VisionModel(family.preprocessing(folder), tower, tokenizer, vocab_size)
