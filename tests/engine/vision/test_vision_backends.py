"""A model that sees images opens where its pictures run: `auto` passes over MLX for it, and Core ML unless its family
is one the Core ML host feeds (SmolVLM / Idefics3), saying why; a text model's order is unchanged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.backends import REGISTRY, BackendEntry, open_backend
from engine.backends.base import Backend, BackendProbe
from engine.backends.memo import BackendMemo
from engine.vision.model import PICTURES_ELSEWHERE, PICTURES_ON_HOST, backends_passed_over
from tests.helpers.tiny_gemma3 import make_tiny_gemma3
from tests.helpers.tiny_idefics3 import make_tiny_idefics3


def test_a_vision_folder_or_a_projector_passes_over_the_converted_backends(tmp_path: Path) -> None:
    folder = make_tiny_idefics3(tmp_path / "vlm")
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert set(PICTURES_ELSEWHERE) == {"coreml", "mlx"}
    assert set(PICTURES_ON_HOST) == {"Idefics3ForConditionalGeneration"}
    # SmolVLM's pictures run on the Core ML host (engine.backends.coreml.host.PictureRows); not on MLX
    assert backends_passed_over(folder, None) == {"mlx": PICTURES_ELSEWHERE["mlx"]}
    # a GGUF's projector, Gemma 3's two-way picture attention and Qwen2.5-VL's multimodal rotary: both passed over
    assert backends_passed_over(text, tmp_path / "mmproj-x.gguf") == PICTURES_ELSEWHERE
    for arch in ("Gemma3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"):
        other = tmp_path / arch
        other.mkdir()
        (other / "config.json").write_text(f'{{"architectures": ["{arch}"]}}')
        assert backends_passed_over(other, None) == PICTURES_ELSEWHERE
    assert backends_passed_over(text, None) == {}


def test_auto_passes_over_what_it_is_told_with_the_reason(tmp_path: Path) -> None:
    folder = make_tiny_gemma3(tmp_path / "gemma")
    opened: list[str] = []
    cpu = REGISTRY["cpu"]

    def converted_open(model_dir: Path, quantize: str, on_hang: Callable[[str], None]) -> Backend:
        opened.append("coreml")
        return cpu.open(model_dir, quantize, on_hang)

    def absent(name: str) -> BackendEntry:
        return BackendEntry(lambda: BackendProbe(name, False, "not here"), cpu.open)

    registry = {
        **{name: absent(name) for name in REGISTRY},
        "coreml": BackendEntry(lambda: BackendProbe("coreml", True, ""), converted_open),
        "cpu": cpu,
    }
    memo = BackendMemo(tmp_path / "memo")
    told = backends_passed_over(folder, None)
    choice = open_backend(folder, "auto", memo=memo, registry=registry, passed_over=told)
    assert choice.backend.name == "cpu" and opened == []
    assert "coreml: a model that sees images runs its pictures on MPS, CUDA or the CPU" in choice.explain()
    open_backend(folder, "auto", memo=memo, registry=registry)  # a text model's order: the converted one first
    assert opened == ["coreml"]
    smolvlm = make_tiny_idefics3(tmp_path / "vlm")  # its pictures run on the Core ML host: opened there
    told = backends_passed_over(smolvlm, None)
    assert open_backend(smolvlm, "auto", memo=memo, registry=registry, passed_over=told).backend.name == "cpu"
    assert opened == ["coreml", "coreml"]
