"""A model that sees images opens where its pictures run: `auto` passes over Core ML and MLX for it (a Mac then opens
it on MPS), saying why; a text model's order is unchanged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.backends import REGISTRY, BackendEntry, open_backend
from engine.backends.base import Backend, BackendProbe
from engine.backends.memo import BackendMemo
from engine.vision.model import PICTURES_ELSEWHERE, backends_passed_over
from tests.helpers.tiny_idefics3 import make_tiny_idefics3


def test_a_vision_folder_or_a_projector_passes_over_the_converted_backends(tmp_path: Path) -> None:
    folder = make_tiny_idefics3(tmp_path / "vlm")
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert backends_passed_over(folder, None) == PICTURES_ELSEWHERE
    assert set(PICTURES_ELSEWHERE) == {"coreml", "mlx"}
    assert backends_passed_over(text, tmp_path / "mmproj-x.gguf") == PICTURES_ELSEWHERE
    assert backends_passed_over(text, None) == {}


def test_auto_passes_over_what_it_is_told_with_the_reason(tmp_path: Path) -> None:
    folder = make_tiny_idefics3(tmp_path / "vlm")
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
