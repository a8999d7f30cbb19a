"""GGUF import: config from metadata, every tensor type we read, q/k un-permutation, the tokenizer, bad files.

The oracle for weights and config is transformers' own GGUF loader (a dev-only dependency); for the tokenizer it is
the original tokenizer.json the GGUF was written from.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from engine.backends.torch_backend import TorchBackend
from engine.bench.gguf_export import permute_for_gguf
from engine.errors import ModelLoadError, TokenizerError
from engine.loading.gguf import VOCABULARY_KEYS, GGUFModel, unpermute_rows
from engine.loading.gguf_header import read_header
from engine.loading.model_files import read_config, verify_model_file
from engine.loading.tokenizer import Tokenizer
from engine.loading.weights import load_model
from engine.memory.base import FullAttentionMemory
from tests.helpers.gguf_files import write_gguf
from tests.helpers.tiny import make_tiny_model

TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
ATOL = 5e-5


@pytest.fixture(scope="module")
def tiny256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Rows of 256 weights: a whole number of blocks for every type, K-quants included.
    return make_tiny_model(
        tmp_path_factory.mktemp("g256"), "llama", hidden=256, intermediate=512, heads=4, kv_heads=2, layers=2
    )


def our_logits(model: Path, ids: torch.Tensor) -> torch.Tensor:
    backend = TorchBackend(model, "cpu", kv_dtype=torch.float32)
    backend.allocate(1, 64)
    return backend.forward(ids, FullAttentionMemory(backend).plan(ids[0].tolist()).as_batch())[0]  # (T, V)


def hf_gguf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(ids).logits[0]


IDS = torch.randint(0, 300, (1, 21), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", TYPES)
def test_every_tensor_type_gives_the_logits_of_its_dequantized_weights(
    tiny256: Path, tmp_path: Path, dtype: str
) -> None:
    path = write_gguf(tiny256, tmp_path / f"m-{dtype}.gguf", dtype)
    ours = our_logits(path, IDS)
    ref = hf_gguf_logits(path, IDS)
    assert torch.allclose(ours, ref, atol=ATOL), (dtype, (ours - ref).abs().max())


@pytest.mark.parametrize("dtype", ["q4_1", "q6_k"])
def test_stored_blocks_are_the_files_bytes_in_hf_row_order(tiny256: Path, tmp_path: Path, dtype: str) -> None:
    path = write_gguf(tiny256, tmp_path / f"s-{dtype}.gguf", dtype)
    loaded = load_model(path)
    q = loaded.stored["model.layers.0.self_attn.q_proj.weight"]
    assert q.qtype == dtype.upper() and q.shape == (256, 256)
    kind = getattr(gguf.GGMLQuantizationType, q.qtype)
    # Dequantizing the stored (un-permuted) rows equals the weight the model computes with.
    assert np.array_equal(
        gguf.quants.dequantize(q.data, kind), loaded.model.model.layers[0].self_attn.q_proj.weight.numpy()
    )


@pytest.mark.parametrize("arch", ["qwen2", "llama3", "mistral"])
def test_families_and_tied_heads_match_the_hf_folder(tmp_path: Path, arch: str) -> None:
    # qwen2: q/k/v biases, no permutation, tied embeddings; llama3: rope scaling carried as a rope_freqs tensor.
    folder = make_tiny_model(tmp_path / arch, arch, tie=arch == "qwen2")
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", "f32")
    assert torch.allclose(our_logits(path, IDS), our_logits(folder, IDS), atol=ATOL)
    got, want = read_config(path), read_config(folder)
    # llama.cpp writes Mistral models as "llama" (the same network), so only the sizes must agree there.
    fields = ("hidden_size",) if arch == "mistral" else ("architecture", "hidden_size")
    for field in (
        *fields,
        "num_hidden_layers",
        "num_key_value_heads",
        "head_dim",
        "qkv_bias",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert getattr(got, field) == getattr(want, field), field


def test_unpermute_inverts_llama_cpps_permutation() -> None:
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 3):
        assert np.array_equal(unpermute_rows(permute_for_gguf(w, heads), heads), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_tokenizer_encodes_like_the_original_tokenizer_json(tmp_path: Path, arch: str) -> None:
    folder = make_tiny_model(tmp_path / arch, arch)
    path = write_gguf(folder, tmp_path / "t.gguf", "f32")
    ours, original = Tokenizer.load(path), Tokenizer.from_dir(folder)
    texts = [
        "The quick brown fox 🙂🚀 jumps",
        "日本語のテキスト, Ünïcödé",
        "<|user|>\nhi<|end|>\n<|assistant|>\n",
        "  two  spaces\n\n\ttab 12345",
    ]
    for text in texts:
        assert ours.encode(text) == original.encode(text), text
        assert ours.decode(ours.encode(text, add_bos=False), skip_special=False) == text
    assert ours.special_ids == original.special_ids and ours.bos_id == original.bos_id
    msgs = [{"role": "user", "content": "hello"}]
    assert ours.encode_chat(msgs) == original.encode_chat(msgs)


def test_an_opened_gguf_hands_its_vocabulary_over_instead_of_keeping_it(tmp_path: Path) -> None:
    """The per-token arrays leave the opened file's metadata: the first tokenizer takes those read at open, a later
    one reads them again, the same; the tokenizers built from either encode alike."""
    path = write_gguf(make_tiny_model(tmp_path / "m", "llama"), tmp_path / "t.gguf", "f32")
    model = GGUFModel(path)
    assert not any(key in model.metadata or key in model.header.metadata for key in VOCABULARY_KEYS)
    assert "tokenizer.ggml.model" in model.metadata and "general.architecture" in model.metadata
    first, again = model.tokenizer_metadata(), model.tokenizer_metadata()
    written = {k: v for k, v in read_header(path).metadata.items() if k.startswith("tokenizer.")}
    assert first == again == written and "tokenizer.ggml.tokens" in first and "tokenizer.ggml.merges" in first
    text = "The quick brown fox 🙂 jumps"
    assert (
        Tokenizer.from_gguf(first).encode(text)
        == Tokenizer.from_gguf(again).encode(text)
        == Tokenizer.load(path).encode(text)
    )


def test_a_folder_holding_one_gguf_is_that_model(tiny256: Path, tmp_path: Path) -> None:
    folder = tmp_path / "holder"
    folder.mkdir()
    write_gguf(tiny256, folder / "model.gguf", "q8_0")
    assert torch.equal(our_logits(folder, IDS), our_logits(folder / "model.gguf", IDS))
    write_gguf(tiny256, folder / "other.gguf", "q8_0")
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        load_model(folder)


def _rewrite(
    src: Path, dst: Path, *, arch: str | None = None, drop_tensors: bool = False, tensor_type: str | None = None
) -> Path:
    """A copy of a GGUF with its architecture renamed, its tensors dropped, or one tensor's type changed."""
    reader = gguf.GGUFReader(str(src))
    new_arch = arch or reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), new_arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, kind = field.contents(), field.types[0]
        if arch and name.startswith(reader.fields["general.architecture"].contents() + "."):
            name = arch + name[name.index(".") :]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(name, value)
        else:
            w.add_key_value(name, value, kind)
    if not drop_tensors:
        for _i, t in enumerate(reader.tensors):
            if tensor_type and t.name == "blk.0.attn_q.weight":
                kind = getattr(gguf.GGMLQuantizationType, tensor_type)
                block, size = gguf.GGML_QUANT_SIZES[kind]
                rows, cols = int(t.shape[1]), int(t.shape[0])
                w.add_tensor(t.name, np.zeros((rows, cols // block * size), np.uint8), raw_dtype=kind)
            else:
                w.add_tensor(
                    t.name,
                    np.asarray(t.data),
                    raw_dtype=t.tensor_type if t.tensor_type != gguf.GGMLQuantizationType.F32 else None,
                )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_bad_gguf_files_each_give_one_sentence(tiny256: Path, tmp_path: Path) -> None:
    good = write_gguf(tiny256, tmp_path / "good.gguf", "f32")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    cases = {
        "truncated or corrupt": truncated,
        "'falcon' model": _rewrite(good, tmp_path / "falcon.gguf", arch="falcon"),
        "vocabulary-only": _rewrite(good, tmp_path / "vocab.gguf", drop_tensors=True),
    }
    for expected, path in cases.items():
        with pytest.raises(ModelLoadError) as err:
            load_model(path)
        message = str(err.value)
        assert expected in message and "\n" not in message and message.endswith("."), message
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(not_gguf)


def test_an_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "m", "llama", hidden=256, intermediate=512, heads=4, kv_heads=2, layers=1)
    good = write_gguf(folder, tmp_path / "good.gguf", "q8_0")
    odd = _rewrite(good, tmp_path / "iq.gguf", tensor_type="IQ2_XXS")
    with pytest.raises(ModelLoadError, match="IQ2_XXS, a type MLoT Spark does not read"):
        load_model(odd)


def test_a_damaged_default_model_is_refused_with_what_to_do(tmp_path: Path) -> None:
    f = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match=r"sha256 does not match.*--force-reinstall"):
        verify_model_file(f, "0" * 64)
    verify_model_file(f, __import__("hashlib").sha256(f.read_bytes()).hexdigest())


def test_a_non_bpe_gguf_vocabulary_kind_is_refused(tiny256: Path, tmp_path: Path) -> None:
    from engine.loading.gguf_tokenizer import tokenizer_parts

    with pytest.raises(TokenizerError, match="'bert'"):
        tokenizer_parts({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError, match="'exotic' way"):
        tokenizer_parts(
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "exotic",
                "tokenizer.ggml.tokens": ["a", "b", "ab"],
                "tokenizer.ggml.merges": ["a b"],
            }
        )


def _spm_gguf(out: Path) -> Path:
    """A vocabulary-only llama (SentencePiece BPE) GGUF: scores from a BPE trained here, byte-fallback tokens."""
    from tokenizers import SentencePieceBPETokenizer

    from tests.helpers.tiny import TOKENIZER_TEXT

    sp = SentencePieceBPETokenizer(unk_token="<unk>")
    sp.train_from_iterator(
        [TOKENIZER_TEXT], vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    model = json.loads(sp._tokenizer.to_str())["model"]
    rank = {(m if isinstance(m, str) else " ".join(m)).replace(" ", ""): i for i, m in enumerate(model["merges"])}
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for tok, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        if tok not in ("<unk>", "<s>", "</s>"):
            tokens.append(tok)
            types.append(1)
            scores.append(-float(rank[tok] + 1) if tok in rank else 0.0)  # earlier merges score higher
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_sentencepiece_gguf_vocabulary_encodes_like_transformers_and_llama_cpp(tmp_path: Path) -> None:
    path = _spm_gguf(tmp_path / "spm.gguf")
    meta = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    ours = Tokenizer.from_gguf(meta)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [
        "The quick brown fox jumps",
        "日本語 🙂 Ünïcödé",
        "def main():\n    return 42",
        "two  spaces\nnew line",
    ]:
        assert ours.encode(text) == hf(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text
    # Leading spaces: llama.cpp and Llama's own tokenizer.json prepend one more "▁" (transformers' GGUF converter
    # drops it, and with it the text's first space); ours round-trips the text as llama.cpp does.
    assert ours.decode(ours.encode("  two")) == "  two"
    assert ours.bos_id == 1 and ours.eos_ids == frozenset({2}) and ours.adds_bos
