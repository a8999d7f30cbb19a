"""Pictures on the Core ML backend: the host embeds a picture's ids through the vision model's rows, so a tiny SmolVLM
runs its pictures on a converted bundle of its text model; its tower runs as the encoder's Core ML program where the
conversion cache holds one (or a converter is passed in), else in PyTorch on the CPU. Off-Mac through the fake bridge
(tests/helpers/fake_coreml.py) and the reference interpreter; the `mac` test runs real Core ML."""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from coreml.convert import cached_bundle
from coreml.interpreter import Interpreter
from coreml.vision import convert_encoder
from engine.backends.base import Backend
from engine.backends.coreml.package import Package
from engine.backends.coreml.runtime import CoreMLBackend, core_ml_loader
from engine.backends.coreml.vision_runtime import ProgramTower, cache_encoder, core_ml_encoder_loader
from engine.backends.torch_backend import TorchBackend
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory
from engine.vision.model import ImageInputError, VisionModel, attach_vision
from tests.helpers.coreml_bundles import ATOL, run_greedy
from tests.helpers.coreml_fixtures import SLOTS
from tests.helpers.fake_coreml import FakeLoader, FakeProgram
from tests.helpers.pictures import picture
from tests.helpers.tiny_idefics3 import make_tiny_idefics3

STEPS = 16
ON_MAC = platform.system() == "Darwin" and platform.machine() == "arm64"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64 / 2 = 32: the Neural Engine's KV state rule (coreml.convert.check_geometry)
    return make_tiny_idefics3(
        tmp_path_factory.mktemp("vlm") / "vlm", text_overrides={"num_attention_heads": 2, "num_key_value_heads": 1}
    )


@pytest.fixture(scope="module")
def cache(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("coreml-vision-cache")
    cached_bundle(folder, slots=SLOTS, quantize="none", cache_dir=root)
    return root


def fake_encoder_loader(package: Path, units: str) -> FakeProgram:
    """The encoder program through the reference interpreter, behind the fake bridge's input checks."""
    return FakeProgram(Interpreter(Package.open(package)), "encoder", "main")


def coreml_backend(
    folder: Path,
    cache: Path,
    loader: Callable[..., object] | None = None,
    encoder_loader: Callable[..., object] = fake_encoder_loader,
    convert_encoder: Callable[[torch.nn.Module, Path], Path] | None = None,
) -> CoreMLBackend:
    backend = CoreMLBackend(
        folder,
        quantize="none",
        cache_dir=cache,
        loader=loader or FakeLoader(),  # type: ignore[arg-type]
        encoder_loader=encoder_loader,  # type: ignore[arg-type]
        convert_encoder=convert_encoder,
    )
    backend.allocate(1, SLOTS)
    return backend


def prompt(vision: VisionModel, pictures: int) -> list[int]:
    images = [picture(20 + 7 * i, 18 + 5 * i, seed=i) for i in range(pictures)]
    text = "".join(f"picture {i}: <image> " for i in range(pictures)) + "what is in these?"
    return vision.encode_prompt(text, images)


def greedy(backend: Backend, ids: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    backend.allocate(1, SLOTS)  # a fresh slot table
    return run_greedy(backend, FullAttentionMemory(backend), ids, STEPS, chunk=16)


@pytest.mark.parametrize("pictures", [1, 2])
def test_the_core_ml_host_reads_pictures_as_the_torch_cpu_path_does(folder: Path, cache: Path, pictures: int) -> None:
    tok = Tokenizer.load(folder)
    reference = TorchBackend(folder)  # the torch CPU path: fp32, ImageEmbedding around its lookup
    ref_vision = attach_vision(folder, tok, reference)
    backend = coreml_backend(folder, cache)
    vision = attach_vision(folder, tok, backend)
    assert ref_vision is not None and vision is not None
    ids = prompt(vision, pictures)
    assert ids == prompt(ref_vision, pictures)  # the same pictures get the same ids on either backend
    assert sum(i >= backend.config.vocab_size for i in ids) >= 4 * pictures
    ref_logits, ref_tokens = greedy(reference, ids)
    got_logits, got_tokens = greedy(backend, ids)
    assert got_tokens == ref_tokens
    for r, g in zip(ref_logits, got_logits, strict=True):
        torch.testing.assert_close(g, r, atol=ATOL, rtol=0)
    assert vision.embedding is not None and vision.embedding.encoded_frames > 0


def test_the_encoder_program_is_converted_once_and_runs_the_pictures(
    folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Given the converter, the first backend writes the encoder's program into the conversion cache and the next
    finds it there; the program's rows equal the torch tower's (tolerance of tests/coreml/test_vision.py) and the
    greedy tokens the torch CPU path's, for one picture and for two."""
    tok = Tokenizer.load(folder)
    cache = tmp_path_factory.mktemp("encoder-cache")
    cached_bundle(folder, slots=SLOTS, quantize="none", cache_dir=cache)
    converted: list[Path] = []

    def convert(tower: torch.nn.Module, out: Path) -> Path:
        converted.append(out)
        return convert_encoder(tower, out)

    reference = TorchBackend(folder)
    ref_vision = attach_vision(folder, tok, reference)
    first = attach_vision(folder, tok, coreml_backend(folder, cache, convert_encoder=convert))
    assert ref_vision is not None and first is not None
    assert len(converted) == 1 and isinstance(first.tower, ProgramTower)
    assert first.placement == "vision encoder: Core ML CPU_AND_NE float16"
    frame = torch.from_numpy(np.random.default_rng(0).uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32))
    with torch.no_grad():
        want, got = ref_vision.tower(frame), first.tower(frame)
    assert float((got - want).norm() / want.norm()) < 3e-3
    backend = coreml_backend(folder, cache, convert_encoder=convert)
    vision = attach_vision(folder, tok, backend)  # found in the cache: not converted again
    assert vision is not None and isinstance(vision.tower, ProgramTower) and len(converted) == 1
    assert backend.numerics.endswith("-vision-program")  # the persistent cache keeps apart the towers' rows
    for pictures in (1, 2):
        ids = prompt(vision, pictures)
        assert ids == prompt(ref_vision, pictures)
        ref_logits, ref_tokens = greedy(reference, ids)
        got_logits, got_tokens = greedy(backend, ids)
        assert got_tokens == ref_tokens
        for r, g in zip(ref_logits, got_logits, strict=True):
            torch.testing.assert_close(g, r, atol=ATOL, rtol=0)


def test_the_converters_cache_entry_is_what_the_backend_finds(
    folder: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`python -m coreml convert`'s second program (cache_encoder): written once, found by a backend given no
    converter; a text model has none."""
    cache = tmp_path_factory.mktemp("cli-cache")
    cached_bundle(folder, slots=SLOTS, quantize="none", cache_dir=cache)
    converted: list[Path] = []

    def convert(tower: torch.nn.Module, out: Path) -> Path:
        converted.append(out)
        return convert_encoder(tower, out)

    made = cache_encoder(folder, units="CPU_AND_NE", convert=convert, cache_dir=cache)
    assert made is not None and made.is_dir() and len(converted) == 1
    assert cache_encoder(folder, units="CPU_AND_NE", convert=convert, cache_dir=cache) == made
    assert len(converted) == 1
    vision = attach_vision(folder, Tokenizer.load(folder), coreml_backend(folder, cache))
    assert vision is not None and isinstance(vision.tower, ProgramTower)
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert cache_encoder(text, units="CPU_AND_NE", convert=convert, cache_dir=cache) is None


def test_without_a_converted_encoder_the_tower_runs_in_pytorch(folder: Path, cache: Path) -> None:
    backend = coreml_backend(folder, cache)
    text_numerics = backend.numerics
    vision = attach_vision(folder, Tokenizer.load(folder), backend)
    assert vision is not None and not isinstance(vision.tower, ProgramTower)
    assert backend.numerics == text_numerics + "-vision-torch"
    assert vision.placement == "vision encoder: PyTorch cpu float32 (no Core ML conversion of it in the cache)"


def test_pictures_change_the_reply_and_text_is_embedded_as_before(folder: Path, cache: Path) -> None:
    """The picture rows reach the programs (another picture, other logits); a text-only step with pictures attached
    is bit-identical to one without."""
    tok = Tokenizer.load(folder)
    plain = coreml_backend(folder, cache)
    text = tok.encode("a plain question about nothing", add_bos=True)
    before, _ = greedy(plain, text)
    seeing = coreml_backend(folder, cache)
    vision = attach_vision(folder, tok, seeing)
    assert vision is not None
    after, _ = greedy(seeing, text)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    one = vision.encode_prompt("<image> what?", [picture(20, 18, seed=0)])
    other = vision.encode_prompt("<image> what?", [picture(20, 18, seed=9)])
    assert not torch.allclose(greedy(seeing, one)[0][0], greedy(seeing, other)[0][0], atol=ATOL)


def test_ids_the_host_cannot_place_are_one_sentence(folder: Path, cache: Path) -> None:
    tok = Tokenizer.load(folder)
    bare = coreml_backend(folder, cache)
    vocab = bare.config.vocab_size
    with pytest.raises(ImageInputError, match="no picture attached"):
        greedy(bare, [1, 2, vocab + 5])
    vision = attach_vision(folder, tok, coreml_backend(folder, cache))
    assert vision is not None and vision.embedding is not None
    with pytest.raises(ImageInputError, match="no longer held"):
        vision.embedding.picture_rows([vocab + 5])


def test_a_host_without_a_picture_family_is_refused(tmp_path: Path) -> None:
    """Families whose programs the host cannot feed (Gemma 3's two-way picture attention, Qwen2.5-VL's rotary) are
    refused on a PictureHost in one sentence."""
    from tests.helpers.tiny_gemma3 import make_tiny_gemma3

    gemma = make_tiny_gemma3(tmp_path / "gemma")

    class Host:
        config = TorchBackend(gemma).model.config

        def take_pictures(self, rows: Callable[[np.ndarray], np.ndarray]) -> None:
            raise AssertionError("not for this family")

    with pytest.raises(Exception, match="sees images only on the CPU, CUDA or MPS"):
        attach_vision(gemma, Tokenizer.load(gemma), Host())


@pytest.mark.mac
@pytest.mark.skipif(not ON_MAC, reason="needs Core ML (macOS 15+ on Apple Silicon)")
def test_real_core_ml_reads_a_picture_as_the_torch_cpu_path_does(folder: Path, cache: Path) -> None:
    tok = Tokenizer.load(folder)
    reference = TorchBackend(folder)
    ref_vision = attach_vision(folder, tok, reference)
    backend = coreml_backend(
        folder, cache, core_ml_loader, encoder_loader=core_ml_encoder_loader, convert_encoder=convert_encoder
    )
    vision = attach_vision(folder, tok, backend)
    assert vision is not None and isinstance(vision.tower, ProgramTower)
    assert ref_vision is not None and vision is not None
    ids = prompt(vision, 1)
    assert ids == prompt(ref_vision, 1)
    ref_logits, ref_tokens = greedy(reference, ids)
    got_logits, got_tokens = greedy(backend, ids)
    assert got_tokens == ref_tokens
    for r, g in zip(ref_logits, got_logits, strict=True):
        torch.testing.assert_close(g, r, atol=ATOL, rtol=0)
