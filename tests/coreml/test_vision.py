"""The vision encoder as its own Core ML program (coreml.vision): the reference interpreter runs the converted
program and equals the torch tower, in both accumulations; the ANE lint finds no error; the host's patches are the
patch embedding's own order; on a Mac, Core ML runs it to the same rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from coreml.ane_rules import check_package
from coreml.interpreter import Interpreter
from coreml.vision import EncoderProgram, convert_encoder
from engine.backends.coreml.package import Package
from engine.backends.coreml.vision import ENCODER_INPUT, ENCODER_OUTPUT, frame_patches, rows
from engine.loading.tokenizer import Tokenizer
from engine.vision.model import load_vision
from engine.vision.siglip import VisionTower
from tests.helpers.tiny_idefics3 import FRAME, make_tiny_idefics3

pytest.importorskip("transformers")
pytest.importorskip("coremltools")


@pytest.fixture(scope="module")
def tower(tmp_path_factory: pytest.TempPathFactory) -> VisionTower:
    folder = make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))
    return load_vision(folder, Tokenizer.load(folder), 64, 360).tower


@pytest.fixture(scope="module")
def package(tower: VisionTower, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_encoder(tower, tmp_path_factory.mktemp("encoder") / "encoder.mlpackage")


@pytest.fixture(scope="module")
def frame() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).uniform(-1, 1, (1, 3, FRAME, FRAME)).astype(np.float32))


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_patches_are_the_patch_embeddings_order(tower: VisionTower, frame: torch.Tensor) -> None:
    conv = tower.vision_model.embeddings.patch_embedding
    want = F.conv2d(frame, conv.weight, conv.bias, stride=conv.stride).flatten(2)[0]  # (E, P)
    patches = torch.from_numpy(frame_patches(frame[0].numpy(), tower.config.patch_size).astype(np.float32))
    got = conv.weight.flatten(1) @ patches[0, :, 0, :] + conv.bias[:, None]
    assert torch.allclose(got, want, atol=1e-2)  # the patches are fp16


@pytest.mark.parametrize(("accumulate", "bound"), [("fp32", 3e-3), ("fp16", 5e-3)])
def test_the_interpreted_program_equals_the_torch_tower(
    tower: VisionTower, package: Path, frame: torch.Tensor, accumulate: str, bound: float
) -> None:
    program = Interpreter(Package.open(package), accumulate)
    patches = frame_patches(frame[0].numpy(), tower.config.patch_size)
    out = program.run("main", {ENCODER_INPUT: patches}, {})[ENCODER_OUTPUT]
    assert out.dtype == np.float16 and out.shape == (1, 64, 1, tower.config.tokens_per_frame)
    with torch.no_grad():
        want = tower(frame)
    # fp16 weights and activations against the fp32 tower (measured 8e-4 and 1.1e-3 relative)
    assert rel_error(rows(out), want) < bound
    other = frame_patches(np.flip(frame[0].numpy(), axis=2).copy(), tower.config.patch_size)
    assert rel_error(rows(program.run("main", {ENCODER_INPUT: other}, {})[ENCODER_OUTPUT]), want) > 10 * bound


def test_the_torch_layout_equals_the_tower(tower: VisionTower, frame: torch.Tensor) -> None:
    program = EncoderProgram(tower).float()
    patches = torch.from_numpy(frame_patches(frame[0].numpy(), tower.config.patch_size)).float()
    with torch.no_grad():
        assert rel_error(rows(program(patches).numpy()), tower(frame)) < 2e-3


def test_the_ane_lint_finds_no_error(package: Path) -> None:
    assert check_package(Package.open(package)) == []


@pytest.mark.mac
def test_core_ml_runs_the_program_to_the_towers_rows(tower: VisionTower, package: Path, frame: torch.Tensor) -> None:
    import coremltools as ct

    model = ct.models.MLModel(str(package), compute_units=ct.ComputeUnit.CPU_AND_NE)
    out = model.predict({ENCODER_INPUT: frame_patches(frame[0].numpy(), tower.config.patch_size)})[ENCODER_OUTPUT]
    with torch.no_grad():
        assert rel_error(rows(np.asarray(out)), tower(frame)) < 1e-2
