"""A GGUF from a stranger: every count, length, offset and dimension is checked against the file and the
architecture before anything is allocated, and `validate_gguf` says what is wrong in one sentence naming the key or
tensor. The classes of the hostile-model report, each on a tiny GGUF, and a hypothesis fuzz target over the
structure-aware mutations `python -m tests.fuzz_models` runs at scale."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import ModelLoadError, SparkError, TokenizerError
from engine.loading.gguf import GGUFModel
from engine.loading.gguf_header import ARRAY, STRING
from engine.loading.validate import validate_gguf
from engine.loading.weights import load_model
from tests.engine.loading.gguf_fuzzing import I32, U32, U64, Lie, Seed, mutated_file
from tests.helpers.fuzz import fuzz_examples
from tests.helpers.gguf_files import write_gguf
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Seed:
    root = tmp_path_factory.mktemp("hostile-gguf")
    model = make_tiny_model(root / "model", "llama", hidden=64, layers=2, heads=4, kv_heads=2)
    return Seed.read(write_gguf(model, root / "tiny.gguf", "q8_0"))


def refused(seed: Seed, tmp_path: Path, error: type[SparkError] = ModelLoadError) -> str:
    path = tmp_path / "mutated.gguf"
    seed.write(path)
    with pytest.raises(error) as e:
        validate_gguf(path)
    text = str(e.value)
    assert "\n" not in text and text.endswith(".") and len(text) < 400, text
    return text


def test_the_unmutated_file_validates_and_loads(seed: Seed, tmp_path: Path) -> None:
    path = tmp_path / "same.gguf"
    seed.copy().write(path)
    validate_gguf(path)
    assert load_model(path).config.num_hidden_layers == 2


@pytest.mark.parametrize("count", [2**40, 2**62, 10_000_000])
def test_an_array_count_that_lies_is_refused_naming_the_key(seed: Seed, tmp_path: Path, count: int) -> None:
    s = seed.copy()
    e = s.entry("tokenizer.ggml.token_type")
    assert e is not None
    e.value = Lie(count, list(e.value))
    assert "tokenizer.ggml.token_type" in refused(s, tmp_path)


def test_a_vocabulary_out_of_proportion_is_refused(seed: Seed, tmp_path: Path) -> None:
    s = seed.copy()
    tokens = s.entry("tokenizer.ggml.tokens")
    assert tokens is not None
    tokens.value = [*tokens.value, *(f"extra{i}" for i in range(5000))]  # more tokens than the embedding has rows
    s.entries = [e for e in s.entries if e.key != "tokenizer.ggml.token_type"]
    assert "tokenizer.ggml.tokens" in refused(s, tmp_path)
    s = seed.copy()
    merges = s.entry("tokenizer.ggml.merges")
    assert merges is not None
    merges.value = [f"q{i} z{i}" for i in range(len(merges.value) * 10 + 10_000)]
    assert "tokenizer.ggml.merges" in refused(s, tmp_path)


def test_a_merge_of_pieces_outside_the_vocabulary_is_refused(seed: Seed, tmp_path: Path) -> None:
    s = seed.copy()
    merges = s.entry("tokenizer.ggml.merges")
    assert merges is not None
    merges.value = ["zzqq xxyy", *merges.value[1:]]
    assert "tokenizer.ggml.merges item 0" in refused(s, tmp_path)


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{% if true %}" * 3000 + "x" + "{% endif %}" * 3000, "nests"),
        ("{% set a = [1, 1] %}" + "{% set a = [a, a] %}" * 60 + "{{ a | tojson }}", "tojson"),
        ("{{ x }}" * 200_000, "tokenizer.chat_template of"),
    ],
)
def test_a_template_built_to_explode_is_refused(seed: Seed, tmp_path: Path, template: str, words: str) -> None:
    s = seed.copy()
    s.set("tokenizer.chat_template", (STRING,), template)
    path = tmp_path / "t.gguf"
    s.write(path)
    with pytest.raises(SparkError) as e:
        validate_gguf(path)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("offset", [2**64 - 32, 2**63, 1, 16])
def test_a_tensor_offset_past_the_file_or_unaligned_is_refused_naming_it(
    seed: Seed, tmp_path: Path, offset: int
) -> None:
    s = seed.copy()
    t = s.tensors[-1]
    t.offset = offset if offset > 2**32 else t.offset + offset
    assert t.name in refused(s, tmp_path)


def test_dims_that_do_not_match_the_architecture_are_refused_naming_the_tensor(seed: Seed, tmp_path: Path) -> None:
    s = seed.copy()
    q = next(t for t in s.tensors if t.name == "blk.0.attn_q.weight")
    q.dims = [q.dims[0], q.dims[1] + 1]  # [64, 65]: the file is long enough, the shape is wrong
    s.tensors.sort(key=lambda t: t.offset)
    assert "blk.0.attn_q.weight" in refused(s, tmp_path)


@pytest.mark.parametrize("delta", [-1, 1])
def test_block_count_must_match_the_layers_of_tensors(seed: Seed, tmp_path: Path, delta: int) -> None:
    s = seed.copy()
    key = f"{s.arch}.block_count"
    e = s.entry(key)
    assert e is not None
    e.value += delta
    assert key in refused(s, tmp_path)


@pytest.mark.parametrize(
    ("types", "value"), [((U32,), 10**6), ((U32,), 2**32 - 1), ((I32,), -1), ((STRING,), "<s>"), ((U64,), 2**63)]
)
def test_bos_and_eos_ids_must_be_tokens_of_the_vocabulary(
    seed: Seed, tmp_path: Path, types: tuple[int, ...], value: object
) -> None:
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        s = seed.copy()
        s.set(key, types, value)
        assert key in refused(s, tmp_path)


def test_a_tokenizer_library_error_is_one_sentence(seed: Seed, tmp_path: Path) -> None:
    s = seed.copy()
    s.set("tokenizer.ggml.pre", (STRING,), "no-such-split")
    assert "splits text" in refused(s, tmp_path, TokenizerError)


def test_nested_arrays_and_unknown_types_are_refused(seed: Seed, tmp_path: Path) -> None:
    s = seed.copy()
    s.set("general.nested", (ARRAY, ARRAY), Lie(2**40, [[1], [2]]))
    assert "general.nested" in refused(s, tmp_path)
    s = seed.copy()
    s.set("general.weird", (13,), 0)
    assert "general.weird" in refused(s, tmp_path)


@settings(
    max_examples=fuzz_examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(rng=st.randoms(use_true_random=False))
def test_fuzz_gguf_mutations(seed: Seed, tmp_path: Path, rng: random.Random) -> None:
    path = tmp_path / "fuzz.gguf"
    mutated_file(seed, random.Random(rng.getrandbits(64)), path)
    try:
        validate_gguf(path)
    except SparkError as exc:
        assert "\n" not in str(exc) and str(exc).endswith(".") and len(str(exc)) <= 600, str(exc)[:1000]
        return
    model = GGUFModel(path)  # what validation accepted loads: every tensor decodes to its declared shape
    for name, tensor in model.dequantized_state():
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32, name


@pytest.mark.parametrize(("key_length", "rope_dims"), [(128, 8), (128, 64), (8, 4), (32, 16)])
def test_a_head_size_the_tensors_do_not_hold_is_refused_before_any_reshape(
    seed: Seed, tmp_path: Path, key_length: int, rope_dims: int
) -> None:
    """`attention.key_length` says one size per head where q and k hold another (16 here), with a partial rotary
    width so that loading would reorder the rows per head: refused by shape, not a numpy reshape error."""
    s = seed.copy()
    s.set(f"{s.arch}.attention.key_length", (U32,), key_length)
    s.set(f"{s.arch}.rope.dimension_count", (U32,), rope_dims)
    text = refused(s, tmp_path)
    assert "attn_q" in text or "attn_k" in text or "attention" in text or "shape" in text, text
