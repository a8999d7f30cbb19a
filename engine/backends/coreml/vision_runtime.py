"""The vision encoder on Core ML: SmolVLM / Idefics3's tower run as its converted program (coreml.vision), for a
model whose text runs on the Core ML backend.

The program lives in the conversion cache beside the text model's bundles, `<cache dir>/coreml/<encoder key>/`
(engine.backends.coreml.cache.encoder_cache_key), or in the app's shipped folder. As for the bundles, the runtime
converts nothing itself: a caller allowed to use the converter passes `coreml.vision.convert_encoder` in, and it
writes the program once, atomically; without it and without a cached program the tower stays in PyTorch on the CPU,
and the placement line says why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from engine.backends.coreml.cache import default_cache_root, encoder_cache_key
from engine.backends.coreml.vision import ENCODER_INPUT, ENCODER_OUTPUT, ENCODER_PACKAGE, frame_patches, rows
from engine.backends.coreml.watchdog import Watchdog
from engine.fileio import atomic_dir
from engine.vision.siglip import Tower, VisionTower


class Program(Protocol):
    """The encoder's one function, as coremltools' CompiledMLModel exposes it (stateless)."""

    def predict(self, data: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


EncoderLoader = Callable[[Path, str], Program]  # (the .mlpackage, compute units) -> its one function
EncoderConverter = Callable[[nn.Module, Path], Path]  # (the tower, the .mlpackage to write) -> it (convert_encoder)


def core_ml_encoder_loader(package: Path, units: str) -> Program:
    """The program compiled once to `.mlmodelc` beside the package (atomically), loaded for `units`."""
    import shutil

    import coremltools as ct

    from engine.errors import BackendUnavailable

    compiled = package.with_suffix(".mlmodelc")
    try:
        if not compiled.is_dir():
            made = Path(ct.models.utils.compile_model(str(package)))
            try:
                with atomic_dir(compiled) as tmp:
                    shutil.move(str(made), tmp)
            finally:
                shutil.rmtree(made, ignore_errors=True)
        program: Program = ct.models.CompiledMLModel(str(compiled), getattr(ct.ComputeUnit, units))
    except Exception as exc:
        first = str(exc).splitlines()[0][:200] if str(exc) else exc.__class__.__name__
        raise BackendUnavailable(f"Core ML could not load the vision encoder ({first}).") from None
    return program


class ProgramTower(Tower):
    """The tower's frames through the encoder program: (N, 3, S, S) -> (N * tokens_per_frame, C) float32, the rows
    fp16 as the program gives them."""

    def __init__(self, program: Program, tower: VisionTower, watchdog: Watchdog) -> None:
        super().__init__()
        self.program, self.watchdog = program, watchdog
        self.tokens_per_frame, self.image_size = tower.tokens_per_frame, tower.image_size
        self.patch = tower.config.patch_size

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        out = []
        for frame in pixels.detach().float().cpu().numpy():
            patches = frame_patches(frame, self.patch)
            result = self.watchdog.predict(functools.partial(self.program.predict, {ENCODER_INPUT: patches}))
            out.append(rows(np.asarray(result[ENCODER_OUTPUT], dtype=np.float16)))
        return torch.cat(out)


def encoder_tower(
    tower: Tower,
    *,
    fingerprint: str,
    units: str,
    roots: Sequence[Path],
    loader: EncoderLoader,
    watchdog: Watchdog,
    convert: EncoderConverter | None = None,
) -> tuple[Tower, str]:
    """The tower pictures run on, and the line saying where: the encoder program found under one of `roots` (the
    last one the conversion cache, where `convert` writes it when none is found), else `tower` itself."""
    if not isinstance(tower, VisionTower):
        return tower, "vision encoder: PyTorch cpu float32 (this family has no Core ML encoder)"
    key = encoder_cache_key(fingerprint, units)
    found = next((root / key / ENCODER_PACKAGE for root in roots if (root / key / ENCODER_PACKAGE).is_dir()), None)
    if found is None:
        if convert is None:
            return tower, "vision encoder: PyTorch cpu float32 (no Core ML conversion of it in the cache)"
        found = _convert_into(roots[-1] / key, tower, convert)
    package = found
    program = watchdog.load(lambda: loader(package, units))
    return ProgramTower(program, tower, watchdog), f"vision encoder: Core ML {units} float16"


def _convert_into(folder: Path, tower: nn.Module, convert: EncoderConverter) -> Path:
    """The program written whole into `folder` (atomically: a cache entry is complete or absent)."""
    with atomic_dir(folder) as tmp:
        tmp.mkdir()
        convert(tower, tmp / ENCODER_PACKAGE)
    return folder / ENCODER_PACKAGE


def cache_encoder(
    model_dir: Path, *, units: str, convert: EncoderConverter, cache_dir: Path | None = None
) -> Path | None:
    """`python -m coreml convert`'s second program: a SmolVLM / Idefics3 folder's encoder into the conversion cache
    (converted once), where `CoreMLBackend.picture_tower` finds it; None for a model with no such encoder."""
    from engine.loading.model_files import read_config
    from engine.loading.tokenizer import Tokenizer
    from engine.loading.weights import model_fingerprint
    from engine.vision.model import PICTURES_ON_HOST, architecture, load_vision

    if architecture(model_dir) not in PICTURES_ON_HOST:
        return None
    folder = (cache_dir or default_cache_root()) / encoder_cache_key(model_fingerprint(model_dir), units)
    if (folder / ENCODER_PACKAGE).is_dir():
        return folder / ENCODER_PACKAGE
    config = read_config(model_dir)
    vision = load_vision(model_dir, Tokenizer.load(model_dir), config.hidden_size, config.vocab_size)
    return _convert_into(folder, vision.tower, convert)
