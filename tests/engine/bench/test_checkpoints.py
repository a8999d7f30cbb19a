"""The bench's random checkpoints: a tokenizer whose vocabulary is the model's embedding rows, with merges, so that
both engines load the GGUF written from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.bench.checkpoints import BENCH_VOCAB_SPECIALS, byte_level_vocabulary, write_random_checkpoint
from engine.bench.gguf_export import export_gguf
from engine.loading.tokenizer import Tokenizer

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 66_000,  # past the 65,536 byte pairs: three-byte pieces too
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


@pytest.mark.parametrize("size", [257, 300, 66_000])
def test_vocabulary_has_exactly_the_embedding_rows_and_every_merge_makes_a_token(size: int) -> None:
    vocab, merges = byte_level_vocabulary(size)
    assert len(vocab) == size
    assert sorted(vocab.values()) == list(range(size))
    assert len(merges) == size - 257
    assert all(left in vocab and right in vocab and left + right in vocab for left, right in merges)


def test_vocabulary_smaller_than_the_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 257"):
        byte_level_vocabulary(100)


def test_checkpoint_exports_to_a_gguf_our_loader_reads(tmp_path: Path) -> None:
    model = write_random_checkpoint(tmp_path / "m", TINY)
    folder_tok = Tokenizer.load(model)
    path = export_gguf(model, tmp_path / "m.gguf", "f32")
    gguf_tok = Tokenizer.load(path)  # refused "BPE tokenizer has no merges" before
    text = "hello, world: byte pairs and triples"
    assert gguf_tok.encode(text) == folder_tok.encode(text)
    assert len(folder_tok.encode(text)) < len(text.encode())  # merges apply
    assert gguf_tok.decode(gguf_tok.encode(text)) == text
    assert BENCH_VOCAB_SPECIALS[0] not in text
