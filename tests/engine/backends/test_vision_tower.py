"""The vision tower on the text model's backend (engine.backends.vision_tower): its linears on the native kernels'
block products from as-stored Q8_0 tensors equal the fp32 tower over the same dequantized weights to within the
kernels' activation rounding, and the fp32 original loosely; F16 tensors run exactly as widened fp32; the tower takes
a backend's dtype; a stored tensor that does not fit is one sentence."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.backends.native import NativeKernels
from engine.backends.native.decoder import NativeBlockLinear
from engine.backends.torch_backend import TorchBackend
from engine.backends.vision_tower import TowerPlacement, place_tower, tower_linears
from engine.errors import ModelLoadError
from engine.loading.tokenizer import Tokenizer
from engine.model.quant import BlockType, StoredTensor, dequantize, quantize
from engine.vision.model import attach_vision, load_vision
from engine.vision.siglip import VisionTower
from tests.helpers.tiny_idefics3 import FRAME, make_tiny_idefics3

pytest.importorskip("transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def tower(folder: Path) -> VisionTower:
    return load_vision(folder, Tokenizer.load(folder), 64, 360).tower


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).uniform(-1, 1, (2, 3, FRAME, FRAME)).astype(np.float32))


def weights(tower: nn.Module) -> dict[str, torch.Tensor]:
    return {p: tower.get_submodule(p).weight.detach() for p in tower_linears(tower)}


def as_q8_0(tower: nn.Module) -> dict[str, StoredTensor]:
    """Every linear whose input size Q8_0 can hold, quantized as a GGUF stores it, by checkpoint name."""
    out = {}
    for path, w in weights(tower).items():
        if w.shape[1] % 32 == 0:
            out[f"model.{path}.weight"] = StoredTensor("Q8_0", tuple(w.shape), quantize(w.numpy(), BlockType.Q8_0))
    return out


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_q8_0_block_products_equal_the_dequantized_tower(
    tower: VisionTower, pixels: torch.Tensor, kernels: NativeKernels
) -> None:
    stored = as_q8_0(tower)
    layers = tower.config.num_hidden_layers
    assert len(stored) == len(tower_linears(tower)) - layers  # fc2's 48 inputs are no multiple of 32: fp32, unstored
    native = copy.deepcopy(tower)
    line = place_tower(native, TowerPlacement(CPU, torch.float32, kernels, None), stored)
    assert f"{len(stored)} of {len(tower_linears(tower))} linears on native" in line
    assert sum(isinstance(m, NativeBlockLinear) for m in native.modules()) == len(stored)

    dequantized = copy.deepcopy(tower)  # the fp32 tower over exactly the stored weights
    with torch.no_grad():
        for name, t in stored.items():
            lin = dequantized.get_submodule(name.removeprefix("model.").removesuffix(".weight"))
            lin.weight.copy_(torch.from_numpy(dequantize(t.data, BlockType.Q8_0, t.shape)))
        got, same_weights, original = native(pixels), dequantized(pixels), tower(pixels)
    # Tight: the kernels round activations to int16 per block of 32 (one scale each), nothing else differs.
    assert rel_error(got, same_weights) < 2e-4  # measured 2.4e-5
    # Loose: Q8_0 weights themselves (8 bits per weight, a scale per 32) against the fp32 original.
    assert rel_error(got, original) < 3e-2  # measured 6.6e-3
    assert rel_error(got, original) > rel_error(got, same_weights)


def test_fp32_weights_are_quantized_to_q8_0_on_the_kernels(
    tower: VisionTower, pixels: torch.Tensor, kernels: NativeKernels
) -> None:
    native = copy.deepcopy(tower)
    line = place_tower(native, TowerPlacement(CPU, torch.float32, kernels, BlockType.Q8_0))
    n = len(tower_linears(tower))
    assert f"{n} of {n} linears on native" in line  # fc2's 48 inputs padded with zero columns
    fc2 = native.vision_model.encoder.layers[0].mlp.fc2
    assert isinstance(fc2, NativeBlockLinear) and (fc2.in_features, fc2.padded) == (48, 64)
    with torch.no_grad():
        assert rel_error(native(pixels), tower(pixels)) < 3e-2


def test_f16_tensors_run_as_widened_fp32(tower: VisionTower, pixels: torch.Tensor, kernels: NativeKernels) -> None:
    stored = {}
    widened = copy.deepcopy(tower)
    with torch.no_grad():
        for path, w in weights(tower).items():
            half = w.numpy().astype(np.float16)
            stored[f"model.{path}.weight"] = StoredTensor("F16", tuple(w.shape), half.view(np.uint8).reshape(-1))
            widened.get_submodule(path).weight.copy_(torch.from_numpy(half.astype(np.float32)))
    native = copy.deepcopy(tower)
    line = place_tower(native, TowerPlacement(CPU, torch.float32, kernels, BlockType.Q8_0), stored)
    assert "0 of" not in line and line.startswith("vision encoder: PyTorch")  # no float products in the kernels
    with torch.no_grad():
        assert torch.equal(native(pixels), widened(pixels))


def test_the_tower_takes_the_backends_device_and_dtype(tower: VisionTower, pixels: torch.Tensor) -> None:
    placed = copy.deepcopy(tower)
    line = place_tower(placed, TowerPlacement(CPU, torch.bfloat16))
    assert line == "vision encoder: PyTorch cpu bfloat16"
    assert {p.dtype for p in placed.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        out = placed(pixels.to(torch.bfloat16)).float()
        assert rel_error(out, tower(pixels)) < 5e-2
    with pytest.raises(ValueError, match="CPU in float32"):
        TowerPlacement(torch.device("cuda"), torch.float16, object(), None)  # type: ignore[arg-type]


def test_a_quantized_backend_runs_the_tower_on_its_kernels(folder: Path, kernels: NativeKernels) -> None:
    backend = TorchBackend(folder, quantize="q8_0", kernels="native")
    vision = attach_vision(folder, Tokenizer.load(folder), backend)
    assert vision is not None and "linears on native" in vision.placement
    assert any(isinstance(m, NativeBlockLinear) for m in vision.tower.modules())
    plain = attach_vision(folder, Tokenizer.load(folder), TorchBackend(folder))
    assert plain is not None and plain.placement == "vision encoder: PyTorch cpu float32"
    assert not any(isinstance(m, NativeBlockLinear) for m in plain.tower.modules())
    half = TorchBackend(folder, dtype=torch.bfloat16)  # a GPU backend's case: its device and dtype, no kernels
    placed = copy.deepcopy(plain.tower)
    assert half.place_tower(placed) == "vision encoder: PyTorch cpu bfloat16"
    assert {p.dtype for p in placed.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: StoredTensor("Q8_0", (t.shape[0] * 2, t.shape[1]), np.tile(t.data, 2)), "does not fit this model"),
        (lambda t: StoredTensor("Q8_0", t.shape, t.data[:-1]), "vision weights do not fit"),
        (lambda t: StoredTensor("IQ2_XXS", t.shape, t.data), "cannot run"),
        (lambda t: StoredTensor("F16", t.shape, np.full(t.shape, np.inf, np.float16)), "NaN or infinite"),
        (lambda t: StoredTensor("Q8_0", t.shape, _nan_scales(t.data)), "NaN or infinite"),
    ],
)
def test_a_stored_tensor_that_does_not_fit_is_one_sentence(
    tower: VisionTower, kernels: NativeKernels, change: object, message: str
) -> None:
    stored = as_q8_0(tower)
    name = "model.vision_model.encoder.layers.0.self_attn.q_proj.weight"
    stored[name] = change(stored[name])  # type: ignore[operator]
    with pytest.raises(ModelLoadError, match=message):
        place_tower(copy.deepcopy(tower), TowerPlacement(CPU, torch.float32, kernels, None), stored)


def _nan_scales(data: np.ndarray) -> np.ndarray:
    out = np.array(data, dtype=np.uint8).reshape(-1, 34)
    out[:, :2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    return out.reshape(data.shape)
