"""Tokenizer loading, encode/decode parity with transformers' fast tokenizer, and the streaming detokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, processors, trainers

from engine.errors import SparkError, TokenizerError
from engine.loading.tokenizer import StreamingDetokenizer, Tokenizer
from tests.helpers.fixtures import TinyModel
from tests.helpers.tiny import SPECIAL, TOKENIZER_TEXT

TEXTS = [
    "",
    "hello",
    "The quick brown fox 🙂🚀 jumps over 日本語 text.",
    "  leading spaces\nand\ttabs\n\n",
    "Ünïcödé and emoji 👩‍👩‍👧 family",
    "<|user|>\nhi<|end|>\n<|assistant|>\n",
    "<|bos|>already has a BOS",
]
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def hf_tiny(tiny: TinyModel):
    return transformers.AutoTokenizer.from_pretrained(str(tiny.path))


def make_byte_fallback_dir(out: Path) -> Path:
    """A Llama 2-style tokenizer: SentencePiece-like BPE (▁ for spaces) with <0xXX> byte fallback, BOS added by
    the post-processor. Trained on ASCII only, so CJK and emoji decode through byte tokens."""
    out.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator([TOKENIZER_TEXT.encode("ascii", "ignore").decode()], trainer=trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    data["model"]["fuse_unk"] = True
    data["decoder"] = json.loads(
        decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        ).__getstate__()
    )
    data["post_processor"] = json.loads(
        processors.TemplateProcessing(
            single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
        ).__getstate__()
    )
    (out / "tokenizer.json").write_text(json.dumps(data))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>", "__type": "AddedToken"},
                "eos_token": "</s>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (out / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return out


@pytest.fixture(scope="module")
def fallback_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_byte_fallback_dir(tmp_path_factory.mktemp("fallback"))


@pytest.fixture(scope="module")
def fallback(fallback_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(fallback_dir)


# --- loading and properties -----------------------------------------------------------------------------------


def test_properties(tiny: TinyModel, hf_tiny) -> None:
    assert tiny.tokenizer.bos_id == hf_tiny.bos_token_id == tiny.tokenizer.token_to_id("<|bos|>")
    # tokenizer_config eos "<|end|>" ∪ generation_config / config.json [<|eos|>, <|end|>]
    assert tiny.tokenizer.eos_ids == {tiny.tokenizer.token_to_id("<|eos|>"), tiny.tokenizer.token_to_id("<|end|>")}
    assert tiny.tokenizer.vocab_size == len(hf_tiny)
    assert tiny.tokenizer.chat_template is not None and "messages" in tiny.tokenizer.chat_template
    assert tiny.tokenizer.special_ids == {tiny.tokenizer.token_to_id(t) for t in SPECIAL}
    assert (
        len(tiny.tokenizer.content_hash) == 64
        and tiny.tokenizer.content_hash == Tokenizer.from_dir(tiny.path).content_hash
    )


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_eos_union_and_dict_tokens(tiny: TinyModel, tmp_path: Path) -> None:
    d = _copy(tiny.path, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|system|>", "lstrip": False, "__type": "AddedToken"}
    cfg["bos_token"] = {"content": "<|bos|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tok = Tokenizer.from_dir(d)
    assert tok.eos_ids == {1, 2, 5, tok.token_to_id("<|system|>")}
    assert tok.eos_token == "<|system|>" and tok.bos_id == tok.token_to_id("<|bos|>")
    assert tok.content_hash != Tokenizer.from_dir(tiny.path).content_hash


def test_chat_template_sources(tiny: TinyModel, tmp_path: Path) -> None:
    d = _copy(tiny.path, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(d).chat_template == "D"
    (d / "chat_template.jinja").write_text("J{{ messages | length }}")
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template == "J{{ messages | length }}"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "J1"


# --- errors ---------------------------------------------------------------------------------------------------


def _one_sentence(err: SparkError) -> None:
    text = str(err)
    assert text and "\n" not in text and text.endswith(".")


@pytest.mark.parametrize(
    "damage",
    [
        "no_folder",
        "no_tokenizer_json",
        "sentencepiece_only",
        "corrupt_tokenizer_json",
        "corrupt_config",
        "config_not_object",
        "bad_generation_config",
    ],
)
def test_bad_files_raise_tokenizer_error(tiny: TinyModel, tmp_path: Path, damage: str) -> None:
    d = _copy(tiny.path, tmp_path / "m")
    if damage == "no_folder":
        d = tmp_path / "missing"
    elif damage == "no_tokenizer_json":
        (d / "tokenizer.json").unlink()
    elif damage == "sentencepiece_only":
        (d / "tokenizer.json").unlink()
        (d / "tokenizer.model").write_bytes(b"\x0a\x05pickle?")
    elif damage == "corrupt_tokenizer_json":
        (d / "tokenizer.json").write_bytes((d / "tokenizer.json").read_bytes()[:500])
    elif damage == "corrupt_config":
        (d / "tokenizer_config.json").write_text("{not json")
    elif damage == "config_not_object":
        (d / "tokenizer_config.json").write_text("[1, 2]")
    elif damage == "bad_generation_config":
        (d / "generation_config.json").write_bytes(b"\xff\xfe")
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_dir(d)
    _one_sentence(err.value)
    if damage == "sentencepiece_only":
        assert "tokenizer.json" in str(err.value) and "SentencePiece" in str(err.value)


def test_tokenizer_json_wins_over_sentencepiece(tiny: TinyModel, tmp_path: Path) -> None:
    d = _copy(tiny.path, tmp_path / "m")
    (d / "tokenizer.model").write_bytes(b"never read")
    assert Tokenizer.from_dir(d).encode("hello", add_bos=False) == Tokenizer.from_dir(tiny.path).encode(
        "hello", add_bos=False
    )


def test_missing_optional_files_are_fine(tiny: TinyModel, tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny.path / "tokenizer.json", d / "tokenizer.json")
    tok = Tokenizer.from_dir(d)
    assert tok.bos_id is None and tok.eos_ids == frozenset() and tok.chat_template is None
    assert tok.encode("hi") == tok.encode("hi", add_bos=True) == tok.encode("hi", add_bos=False)


# --- encode / decode parity -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(
    tiny: TinyModel, hf_tiny, fallback: Tokenizer, fallback_dir: Path, text: str
) -> None:
    assert tiny.tokenizer.encode(text, add_bos=False) == hf_tiny.encode(text, add_special_tokens=False)
    hf_fallback = transformers.AutoTokenizer.from_pretrained(str(fallback_dir))
    assert fallback.encode(text, add_bos=False) == hf_fallback.encode(text, add_special_tokens=False)
    if not text.startswith("<s>"):
        # Post-processor BOS (Llama style): the default equals transformers' add_special_tokens=True.
        assert fallback.encode(text) == hf_fallback.encode(text, add_special_tokens=True)
        assert fallback.adds_bos


@pytest.mark.parametrize("text", TEXTS)
def test_add_bos_token_from_config(tiny: TinyModel, hf_tiny, text: str) -> None:
    # tiny's tokenizer_config says add_bos_token=true while its tokenizer.json has no post-processor; the config
    # flag decides (transformers 5 would follow the post-processor here and add nothing).
    plain = hf_tiny.encode(text, add_special_tokens=False)
    expected = plain if plain[:1] == [tiny.tokenizer.bos_id] else [tiny.tokenizer.bos_id, *plain]
    assert tiny.tokenizer.adds_bos
    assert tiny.tokenizer.encode(text) == expected == tiny.tokenizer.encode(text, add_bos=True)


def test_bos_is_never_doubled(tiny: TinyModel, fallback: Tokenizer) -> None:
    for tok, bos in ((tiny.tokenizer, "<|bos|>"), (fallback, "<s>")):
        once = tok.encode(f"{bos}hi")
        assert once[0] == tok.bos_id and once[1] != tok.bos_id
        assert tok.encode(f"{bos}hi", add_bos=True) == once


def test_add_bos_token_false_overrides_post_processor(fallback_dir: Path, tmp_path: Path) -> None:
    d = _copy(fallback_dir, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(d)
    ids = tok.encode("hello")
    assert not tok.adds_bos and ids[0] != tok.bos_id and ids[-1] == tok.token_to_id("</s>")


@HYPOTHESIS
@given(ids=st.lists(st.integers(0, 319), max_size=40), skip=st.booleans())
def test_decode_matches_transformers(tiny: TinyModel, hf_tiny, ids: list[int], skip: bool) -> None:
    assert tiny.tokenizer.decode(ids, skip_special=skip) == hf_tiny.decode(ids, skip_special_tokens=skip)


# --- streaming detokenizer ------------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    decoder = tok.stream_decoder(skip_special=skip)
    chunks = [decoder.add(i) for i in ids]
    chunks.append(decoder.flush())
    assert decoder.text == "".join(chunks)
    return chunks


@HYPOTHESIS
@given(ids=st.lists(st.integers(0, 319), max_size=60), skip=st.booleans())
def test_stream_equals_decode_random_ids(tiny: TinyModel, ids: list[int], skip: bool) -> None:
    assert "".join(_stream(tiny.tokenizer, ids, skip)) == tiny.tokenizer.decode(ids, skip_special=skip)


def _byte_token_ids(tok: Tokenizer) -> dict[int, int]:
    return {tok.token_to_id(f"<0x{b:02X}>"): b for b in range(256)}


@HYPOTHESIS
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_decode_random_ids_byte_fallback(fallback: Tokenizer, data: st.DataObject, skip: bool) -> None:
    # Random tokens, except that byte tokens come as whole UTF-8 characters: the ByteFallback decoder turns a
    # whole run of byte tokens into U+FFFDs once any byte in it is invalid, retroactively, which no stream that
    # shows text early can match (see StreamingDetokenizer); valid runs must match exactly.
    byte_ids = _byte_token_ids(fallback)
    to_byte_id = {b: i for i, b in byte_ids.items()}
    other = [i for i in range(fallback.vocab_size) if i not in byte_ids]
    unit = st.one_of(
        st.sampled_from(other).map(lambda i: [i]),
        st.characters(exclude_categories=["Cs"]).map(lambda c: [to_byte_id[b] for b in c.encode("utf-8")]),
    )
    ids = [i for u in data.draw(st.lists(unit, max_size=40)) for i in u]
    assert "".join(_stream(fallback, ids, skip)) == fallback.decode(ids, skip_special=skip)


TEXT_ALPHABET = st.sampled_from(
    sorted(set(TOKENIZER_TEXT)) + list("🙂🚀👍🏽中文字한국어é\u200d") + ["<|end|>", "<|user|>"]
)


@HYPOTHESIS
@given(parts=st.lists(TEXT_ALPHABET, max_size=40))
def test_stream_never_emits_half_a_character(tiny: TinyModel, fallback: Tokenizer, parts: list[str]) -> None:
    text = "".join(parts)
    for tok in (tiny.tokenizer, fallback):
        ids = tok.encode(text, add_bos=False)
        chunks = _stream(tok, ids, skip=False)
        assert all("\ufffd" not in c for c in chunks)
        assert "".join(chunks) == tok.decode(ids, skip_special=False)
    # ByteLevel round-trips exactly; emoji and CJK arrive whole even though they span several byte tokens.
    assert "".join(_stream(tiny.tokenizer, tiny.tokenizer.encode(text, add_bos=False), skip=False)) == text


def test_emoji_waits_for_its_last_byte(tiny: TinyModel, fallback: Tokenizer) -> None:
    for tok in (tiny.tokenizer, fallback):
        ids = tok.encode("🙂", add_bos=False)
        assert len(ids) > 1  # split over byte tokens
        decoder = tok.stream_decoder()
        assert [decoder.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]
        assert decoder.flush() == ""


def test_incomplete_character_is_flushed_as_replacement(tiny: TinyModel) -> None:
    ids = tiny.tokenizer.encode("ok🙂", add_bos=False)[:-1]
    decoder = tiny.tokenizer.stream_decoder()
    emitted = "".join(decoder.add(i) for i in ids)
    assert emitted == "ok"
    assert emitted + decoder.flush() == tiny.tokenizer.decode(ids)


def test_stream_work_per_token_is_bounded(tiny: TinyModel) -> None:
    """Each add() decodes a small window, never the whole history (the reply here is ~3000 tokens)."""

    class CountingBackend:
        def __init__(self, inner: object) -> None:
            self.inner = inner
            self.longest = 0

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tiny.tokenizer.encode(TOKENIZER_TEXT * 3, add_bos=False)
    backend = CountingBackend(tiny.tokenizer._backend)
    decoder = StreamingDetokenizer(backend, True, tiny.tokenizer.special_ids)  # type: ignore[arg-type]
    text = "".join(decoder.add(i) for i in ids) + decoder.flush()
    assert len(ids) > 2000 and text == tiny.tokenizer.decode(ids)
    assert backend.longest <= 8
