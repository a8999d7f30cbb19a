"""Beam search equals transformers' `generate(num_beams=N, do_sample=False)` on a tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.beam import BeamSettings, beam_search
from engine.tokenizer import Tokenizer
from tests.tiny import make_tiny_model

transformers = pytest.importorskip("transformers")

TEXT = "The quick brown fox jumps over the lazy dog. Python is a programming language."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TorchBackend, Tokenizer]:
    d = make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=2, seed=3)
    return d, TorchBackend(d), Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def hf(tiny: tuple[Path, TorchBackend, Tokenizer]):  # type: ignore[no-untyped-def]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32)
    return model.eval()


def hf_beam(model, prompt: list[int], s: BeamSettings, eos: list[int]) -> tuple[list[int], float]:  # type: ignore[no-untyped-def]
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=s.num_beams,
        do_sample=False,
        max_new_tokens=s.max_tokens,
        early_stopping=s.early_stopping,
        length_penalty=s.length_penalty,
        eos_token_id=eos,
        pad_token_id=eos[0],
        return_dict_in_generate=True,
        output_scores=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), float(out.sequences_scores[0])


def frequent_tokens(backend: TorchBackend, tok: Tokenizer, prompt: list[int]) -> list[int]:
    """Two ids greedy decoding likes here: used as EOS so hypotheses end early and the finishing rules matter."""
    from engine.batch import generate_batch
    from engine.generate import GenerationSettings
    from engine.sampling import SamplingSettings

    out = generate_batch(backend.fork(), tok, [prompt], GenerationSettings(max_tokens=12, sampling=SamplingSettings(greedy=True)))[0].tokens
    return sorted(set(out[3:5]))


CASES = [
    (2, 8, 1.0, False),
    (3, 10, 1.0, True),
    (4, 9, 1.0, False),
    (4, 9, 0.5, True),
    (3, 7, 2.0, False),
]


@pytest.mark.parametrize("eos_kind", ["model", "frequent"])
@pytest.mark.parametrize("beams,max_tokens,length_penalty,early", CASES)
def test_beam_matches_transformers(tiny, hf, eos_kind: str, beams: int, max_tokens: int, length_penalty: float, early: bool) -> None:  # type: ignore[no-untyped-def]
    _, backend, tok = tiny
    ids = tok.encode(TEXT)
    prompt = ids[: 5 + beams * 3]
    eos = sorted(tok.eos_ids) if eos_kind == "model" else frequent_tokens(backend, tok, prompt)
    s = BeamSettings(num_beams=beams, max_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early, prefill_chunk=4)
    got = beam_search(backend.fork(), prompt, s, eos)
    want, want_score = hf_beam(hf, prompt, s, eos)
    n = len(got.tokens)
    assert got.tokens == want[:n]
    assert all(t == eos[0] for t in want[n:])  # transformers pads shorter winners with its fill value
    assert got.hypotheses[0].score == pytest.approx(want_score, rel=1e-4, abs=1e-4)
    scores = [h.score for h in got.hypotheses]
    assert scores == sorted(scores, reverse=True) and len(scores) <= beams


def test_copy_rows_is_exact(tiny) -> None:  # type: ignore[no-untyped-def]
    _, backend, _ = tiny
    b = backend.fork()
    b.allocate(3, 8)
    b.cache.k.normal_()
    b.cache.v.normal_()
    k, v = b.cache.k.clone(), b.cache.v.clone()
    b.copy_rows(torch.tensor([2, 0, 0]))
    assert torch.equal(b.cache.k[:, 0], k[:, 2]) and torch.equal(b.cache.k[:, 1], k[:, 0]) and torch.equal(b.cache.v[:, 2], v[:, 0])
