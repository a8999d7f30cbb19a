"""Qwen2.5-VL against transformers on a tiny random checkpoint it wrote itself (model and processor): the patches and
grids equal the processor's pixel values and image_grid_thw, the prompt ids its input ids, the tower's rows its image
features, each token's three rotary positions its get_rope_index, and greedy tokens its `generate`, fp32, over 24
tokens, with one picture and with two of different sizes — through the causal path and through the slot table
(full attention and the cascade, prompts fed in chunks that cut through pictures). The multimodal offsets are derived
from the ids, so a memory saved and restored continues exactly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.backends.base import Backend, BackendWrapper
from engine.backends.torch_backend import TorchBackend
from engine.generation.beam import BeamSettings
from engine.generation.loop import GenerationSettings, decode_step, prefill, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory
from engine.memory.cascade import CascadeConfig, CascadeMemory, PersistentStore
from engine.model.slots import SlotBatch
from engine.vision.images import DecodedImage
from engine.vision.model import MAX_HELD_IMAGES, VisionModel, attach_vision
from engine.vision.qwen25vl import PictureShapeError, Qwen25VLPreprocessing, smart_resize
from tests.helpers.hf_greedy import hf_vision_model, hf_vision_tokens
from tests.helpers.mmproj_refs import causal_greedy, our_prompt, ours_from_folder
from tests.helpers.pictures import picture, pictures_of
from tests.helpers.tiny_qwen25vl import image_only_processor, make_tiny_qwen25vl

transformers = pytest.importorskip("transformers")
STEPS = 24
MARKED = "<|vision_start|><|image_pad|><|vision_end|>"  # what the processor's prompt holds for one picture
CASES = {
    "none": ("<|user|>\nWhat is in the picture?<|end|>\n<|assistant|>\n", []),
    "one": ("<|user|>\n<image>What is in the picture?<|end|>\n<|assistant|>\n", [(40, 24)]),
    "two": ("<|user|>\n<image>and<image> which is wider?<|end|>\n<|assistant|>\n", [(60, 14), (100, 90)]),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen25vl(tmp_path_factory.mktemp("qwen25vl"))


@pytest.fixture(scope="module")
def ours(folder: Path) -> tuple[Any, VisionModel]:
    return ours_from_folder(folder)


@pytest.fixture(scope="module")
def theirs(folder: Path) -> tuple[Any, Any]:
    return hf_vision_model(transformers.Qwen2_5_VLForConditionalGeneration, folder, image_only_processor())


def case(name: str, vision: VisionModel, processor: Any) -> tuple[list[int], list[DecodedImage], Any]:
    """Our ids for a case, its pictures, and the processor's inputs for the same prompt."""
    text, sizes = CASES[name]
    pictures = pictures_of(sizes)
    inputs = processor(
        text=text.replace("<image>", MARKED), images=[p.image for p in pictures] or None, return_tensors="pt"
    )
    return vision.encode_prompt(text, pictures), pictures, inputs


def assert_positions_are_transformers(vision: VisionModel, ids: list[int], hf_model: Any, inputs: Any) -> None:
    """Each token's three rotary positions (its place plus our offsets) are transformers' get_rope_index."""
    with torch.no_grad():
        want, _ = hf_model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
        )
    offsets = vision.position_offsets(ids)
    assert offsets is not None
    assert torch.equal((torch.arange(len(ids))[:, None] + offsets).T, want[:, 0])


def slot_greedy(backend: Backend, memory: Memory, ids: list[int], n: int, chunk: int) -> list[int]:
    logits = prefill(backend, memory, ids, chunk)
    assert logits is not None
    out = [int(logits.argmax())]
    while len(out) < n:
        out.append(int(decode_step(backend, memory, out[-1]).argmax()))
    return out


@pytest.mark.parametrize("name", ["one", "two"])
def test_patches_grids_and_prompt_equal_the_processor(
    name: str, ours: tuple[Any, VisionModel], theirs: tuple[Any, Any]
) -> None:
    _, vision = ours
    text, _ = CASES[name]
    _, pictures, inputs = case(name, vision, theirs[1])
    ids, plain, frames = our_prompt(vision, text, pictures)
    pixels = np.concatenate([f.pixels.reshape(-1, f.pixels.shape[-1]) for f in frames])
    assert np.array_equal(pixels, inputs["pixel_values"].numpy())
    assert isinstance(vision.preprocessing, Qwen25VLPreprocessing)
    merge = vision.preprocessing.merge
    assert [[1, f.rows * merge, f.cols * merge] for f in frames] == inputs["image_grid_thw"].tolist()
    assert plain == inputs["input_ids"][0].tolist()
    assert len(set(ids) - set(plain)) == sum(f.rows * f.cols for f in frames)


def test_tower_rows_equal_the_image_features(ours: tuple[Any, VisionModel], theirs: tuple[Any, Any]) -> None:
    _, vision = ours
    hf_model, processor = theirs
    _, pictures, inputs = case("two", vision, processor)
    with torch.no_grad():
        hf = hf_model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        hf_rows = torch.cat(list(hf.pooler_output))
        rows = torch.cat(
            [vision.tower(torch.from_numpy(vision.preprocessing.frames(p.image).pixels)) for p in pictures]
        )
    assert rows.shape == hf_rows.shape
    torch.testing.assert_close(rows, hf_rows, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["one", "two"])
def test_positions_equal_get_rope_index(name: str, ours: tuple[Any, VisionModel], theirs: tuple[Any, Any]) -> None:
    _, vision = ours
    hf_model, processor = theirs
    ids, _, inputs = case(name, vision, processor)
    assert_positions_are_transformers(vision, ids, hf_model, inputs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_tokens_equal_transformers(name: str, ours: tuple[Any, VisionModel], theirs: tuple[Any, Any]) -> None:
    model, vision = ours
    ids, _, inputs = case(name, vision, theirs[1])
    assert causal_greedy(model, vision, ids, STEPS) == hf_vision_tokens(theirs[0], inputs, STEPS)


def test_the_offsets_are_what_makes_them_equal(ours: tuple[Any, VisionModel], theirs: tuple[Any, Any]) -> None:
    model, vision = ours
    ids, _, inputs = case("two", vision, theirs[1])
    assert causal_greedy(model, vision, ids, STEPS, offsets=False) != hf_vision_tokens(theirs[0], inputs, STEPS)


@pytest.fixture(scope="module")
def slot_backend(folder: Path) -> tuple[TorchBackend, VisionModel]:
    backend = TorchBackend(folder, "cpu", kv_dtype=torch.float32)  # fp32 KV: transformers' arithmetic
    vision = attach_vision(folder, Tokenizer.load(folder), backend)
    assert vision is not None
    return backend, vision


@pytest.mark.parametrize("memory_kind", ["full", "cascade"])
@pytest.mark.parametrize("name", ["one", "two"])
def test_greedy_through_the_slot_table_equals_transformers(
    name: str, memory_kind: str, slot_backend: tuple[TorchBackend, VisionModel], theirs: tuple[Any, Any]
) -> None:
    backend, vision = slot_backend
    ids, _, inputs = case(name, vision, theirs[1])
    backend.allocate(1, 512)
    memory: Memory
    if memory_kind == "full":
        memory = FullAttentionMemory(backend)
    else:  # a window holding the whole conversation: nothing is evicted
        memory = CascadeMemory(backend, CascadeConfig(sink_tokens=4, window=448, block_size=8, retrieval_blocks=2))
    # Chunks of 13 tokens: pictures' tokens arrive over several forwards.
    assert slot_greedy(backend, memory, ids, STEPS, chunk=13) == hf_vision_tokens(theirs[0], inputs, STEPS)


def test_a_restored_memory_continues_exactly(slot_backend: tuple[TorchBackend, VisionModel], folder: Path) -> None:
    backend, vision = slot_backend
    ids = vision.encode_prompt(CASES["two"][0], [picture(60, 14, 0), picture(100, 90, 1)])
    backend.allocate(1, 512)
    memory = FullAttentionMemory(backend)
    whole = slot_greedy(backend, memory, ids, STEPS, chunk=64)

    memory = FullAttentionMemory(backend)
    memory.reset()
    first = slot_greedy(backend, memory, ids, 8, chunk=64)
    meta, tensors = memory.state()

    other = TorchBackend(
        folder, "cpu", kv_dtype=torch.float32
    )  # another process's model: the same pictures registered again
    vision2 = attach_vision(folder, Tokenizer.load(folder), other)
    assert vision2 is not None
    vision2.register([picture(60, 14, 0), picture(100, 90, 1)])
    other.allocate(1, 512)
    restored = FullAttentionMemory(other)
    restored.load_state(meta, tensors)
    rest = [first[-1]]
    fed = first[-1]
    for _ in range(STEPS - 8):
        fed = int(decode_step(other, restored, fed).argmax())
        rest.append(fed)
    assert first + rest[1:] == whole


def test_smart_resize_as_transformers() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs

    for h, w in [(24, 40), (14, 60), (90, 100), (3, 500), (1000, 7), (57, 57)]:
        assert smart_resize(h, w, 4, 64, 1920) == theirs(h, w, factor=4, min_pixels=64, max_pixels=1920)
    with pytest.raises(PictureShapeError, match="elongated"):
        smart_resize(2, 500, 4, 64, 1920)


class Counting(BackendWrapper):
    """Counts the tokens its forwards read."""

    fed = 0

    def forward(
        self,
        tokens: torch.Tensor,
        batch: SlotBatch,
        last_only: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        self.fed += int(tokens.numel())
        return self.inner.forward(tokens, batch, last_only, should_stop)


def test_a_prefix_restored_from_the_cache_continues_exactly(
    slot_backend: tuple[TorchBackend, VisionModel], theirs: tuple[Any, Any], tmp_path: Path
) -> None:
    backend, vision = slot_backend
    ids, _, inputs = case("two", vision, theirs[1])
    want = hf_vision_tokens(theirs[0], inputs, STEPS)
    cfg = CascadeConfig(sink_tokens=4, window=448, block_size=8, retrieval_blocks=2)
    counting = Counting(backend)
    for _ in range(2):  # the second time the same prompt's prefix comes from the persistent cache
        backend.allocate(1, 512)
        store = PersistentStore(tmp_path / "l3", backend.fingerprint, backend.numerics, cfg.persistent_budget_bytes)
        memory = CascadeMemory(counting, cfg, store=store)
        counting.fed = 0
        assert slot_greedy(counting, memory, ids, STEPS, chunk=32) == want
    assert counting.fed < STEPS + len(ids) // 2  # most of the prompt, pictures included, was not read again


def test_beams_after_pictures_equal_transformers(
    slot_backend: tuple[TorchBackend, VisionModel], theirs: tuple[Any, Any]
) -> None:
    backend, vision = slot_backend
    ids, _, inputs = case("two", vision, theirs[1])
    with torch.no_grad():
        out = theirs[0].generate(
            **inputs, max_new_tokens=12, num_beams=3, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    backend.allocate(1, 512)
    settings = GenerationSettings(
        max_tokens=12, sampling=SamplingSettings(greedy=True), beam=BeamSettings(beams=3), ignore_eos=True
    )
    events = stream_generate(backend, FullAttentionMemory(backend), vision.tokenizer, ids, settings)
    assert [e.token for e in events if e.token is not None] == out[0, len(ids) :].tolist()


def test_the_offsets_of_a_conversations_tail_are_those_of_the_whole(ours: tuple[Any, VisionModel]) -> None:
    _, vision = ours
    ids = vision.encode_prompt(CASES["two"][0], [picture(60, 14, 0), picture(100, 90, 1)])
    whole = vision.position_offsets(ids)
    assert whole is not None and bool(whole.any())
    for start in range(0, len(ids), 7):
        tail = vision.position_offsets(ids, start)
        assert tail is not None and torch.equal(tail, whole[start:])
    assert vision.position_offsets(ids[:3]) is None  # no picture yet


def test_offsets_name_pictures_no_longer_held(ours: tuple[Any, VisionModel], theirs: tuple[Any, Any]) -> None:
    """A long conversation's early pictures leave the tower's held features; their positions still count."""
    _, vision = ours
    hf_model, processor = theirs
    pictures = [picture(8 + 4 * (n % 3), 8 + 4 * (n % 2), 100 + n) for n in range(MAX_HELD_IMAGES + 2)]
    text = "".join(f"{n}<image>" for n in range(len(pictures))) + " which?"
    ids = vision.encode_prompt(text, pictures)
    assert vision.embedding is not None and pictures[0].sha256 not in vision.embedding.held
    inputs = processor(text=text.replace("<image>", MARKED), images=[p.image for p in pictures], return_tensors="pt")
    assert_positions_are_transformers(vision, ids, hf_model, inputs)
