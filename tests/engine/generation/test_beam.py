"""Beam search: equal to transformers' `generate(num_beams=N, do_sample=False)` token for token (tiny checkpoints at
N = 2 and 4 under its length penalties and early stopping, the default model over 24 tokens); forks share the
memory's slots instead of copying them; beams on the cascade after an eviction; the memory afterwards holds the
reply as plain decoding leaves it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from engine.backends.torch_backend import TorchBackend
from engine.errors import InputTooLarge
from engine.generation.beam import BeamForks, BeamSearch, BeamSettings, EarlyStopping, Step
from engine.generation.loop import FinishReason, GenerationEvent, GenerationSettings, prefill, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory
from engine.memory.cascade import CascadeConfig, CascadeMemory
from engine.model.slots import ForkTable, KVCache
from tests.helpers.real_model import real_model_dir
from tests.helpers.tiny import make_tiny_model
from tests.helpers.tiny_families import make_tiny_family

HF_EARLY = {EarlyStopping.HEURISTIC: False, EarlyStopping.DONE: True, EarlyStopping.NEVER: "never"}


class EosAs:
    """The tokenizer, with `eos` as its only end-of-reply token (a random tiny model hardly ever picks its own)."""

    def __init__(self, tok: Tokenizer, eos: int) -> None:
        self.tok, self.eos_ids = tok, frozenset({eos})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("beam"), layers=2)


def hf_beams(
    d: Path, prompt: list[int], n: int, max_tokens: int, eos: int | list[int] | None, returned: int = 1, **kw: Any
) -> list[list[int]]:
    """transformers' `returned` best beams, each cut after its end token (rows are padded with it)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    inp = torch.tensor([prompt])
    ends = [] if eos is None else [eos] if isinstance(eos, int) else eos
    with torch.no_grad():
        out = model.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=max_tokens,
            num_beams=n,
            num_return_sequences=returned,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=ends[0] if ends else 0,
            **kw,
        )
    rows = []
    for row in out[:, len(prompt) :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
        rows.append(row[:cut])
    return rows


def beam_run(
    backend: TorchBackend, memory: Memory, tok: Any, prompt: list[int], settings: GenerationSettings
) -> list[GenerationEvent]:
    return list(stream_generate(backend, memory, tok, prompt, settings))


def beam_settings(n: int, max_tokens: int, **kw: Any) -> GenerationSettings:
    return GenerationSettings(
        max_tokens=max_tokens, sampling=SamplingSettings(greedy=True), beam=BeamSettings(beams=n, **kw)
    )


def fp32_backend(d: Path, slots: int = 256) -> TorchBackend:
    b = TorchBackend(d, "cpu", kv_dtype=torch.float32)  # fp32 KV: transformers' arithmetic, so ties break alike
    b.allocate(1, slots)
    return b


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    ("length_penalty", "early"),
    [
        (0.0, EarlyStopping.HEURISTIC),
        (1.0, EarlyStopping.HEURISTIC),
        (2.0, EarlyStopping.NEVER),
        (1.0, EarlyStopping.DONE),
    ],
)
def test_beams_equal_transformers_on_a_tiny_checkpoint(
    tiny_dir: Path, n: int, length_penalty: float, early: EarlyStopping
) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    prompt = tok.encode("The quick brown fox")
    backend = fp32_backend(tiny_dir)
    # An end token the beams meet within the budget but not at once: a token new after 4 of a 4-beam reply.
    scout = beam_settings(4, 16, length_penalty=2.0)
    scout.ignore_eos = True
    reply = [e.token for e in beam_run(backend, FullAttentionMemory(backend), tok, prompt, scout)]
    eos = next(t for i, t in enumerate(reply) if i >= 4 and t not in reply[:i])
    settings = beam_settings(n, 16, length_penalty=length_penalty, early_stopping=early, returned=n)
    events = beam_run(backend, FullAttentionMemory(backend), EosAs(tok, eos), prompt, settings)
    ours = [e.token for e in events if e.token is not None]
    ref = hf_beams(tiny_dir, prompt, n, 16, eos, n, length_penalty=length_penalty, early_stopping=HF_EARLY[early])
    assert ours == ref[0]
    best = events[-1].beams
    assert [list(h.tokens) for h in best] == ref  # the n best, in transformers' order
    assert len(best) == n and [h.score for h in best] == sorted((h.score for h in best), reverse=True)
    assert best[0].logprob == pytest.approx(sum(best[0].logprobs), abs=1e-4)
    assert best[0].score == pytest.approx(best[0].logprob / len(best[0].tokens) ** length_penalty, abs=1e-4)


@pytest.mark.parametrize("n", [2, 4])
def test_beams_without_an_end_token_equal_transformers(tiny_dir: Path, n: int) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    prompt = tok.encode("def main():\n    return")
    backend = fp32_backend(tiny_dir)
    settings = beam_settings(n, 12)
    settings.ignore_eos = True
    events = beam_run(backend, FullAttentionMemory(backend), tok, prompt, settings)
    assert [e.token for e in events] == hf_beams(tiny_dir, prompt, n, 12, None, length_penalty=0.0)[0]
    assert events[-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_beams_equal_transformers_on_other_families(tmp_path: Path, family: str) -> None:
    """Gemma 3's sliding layers (a window of 8, shorter than prompt and reply) see only their window in every beam."""
    d = make_tiny_family(tmp_path / family, family)
    tok = Tokenizer.from_dir(d)
    prompt = tok.encode("Python is a programming language.")
    backend = fp32_backend(d)
    settings = beam_settings(3, 12, returned=3)
    settings.ignore_eos = True
    events = beam_run(backend, FullAttentionMemory(backend), tok, prompt, settings)
    ref = hf_beams(d, prompt, 3, 12, None, 3, length_penalty=0.0)
    assert [list(h.tokens) for h in events[-1].beams] == ref


def test_beams_on_the_default_model_equal_transformers() -> None:
    d = real_model_dir()
    tok = Tokenizer.from_dir(d)
    prompt = tok.encode("The three primary colours are")
    backend = fp32_backend(d)
    ours = [e.token for e in beam_run(backend, FullAttentionMemory(backend), tok, prompt, beam_settings(4, 24))]
    greedy = GenerationSettings(max_tokens=24, sampling=SamplingSettings(greedy=True))
    plain = [e.token for e in stream_generate(backend, FullAttentionMemory(backend), tok, prompt, greedy)]
    assert ours == hf_beams(d, prompt, 4, 24, sorted(tok.eos_ids), length_penalty=0.0)[0]
    assert ours != plain  # the beams found another reply than greedy decoding (else this proves little)


def test_the_memory_holds_the_reply_as_plain_decoding_leaves_it(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    prompt = tok.encode("Memory cascade: working")
    backend = fp32_backend(tiny_dir)
    memory = FullAttentionMemory(backend)
    settings = beam_settings(3, 10)
    settings.ignore_eos = True
    reply = [e.token for e in beam_run(backend, memory, tok, prompt, settings)]
    assert memory.tokens == prompt + reply[:-1]
    # Continuing after the beams gives what a memory that read the same text gives.
    fresh = FullAttentionMemory(backend2 := fp32_backend(tiny_dir))
    plain = GenerationSettings(max_tokens=6, sampling=SamplingSettings(greedy=True), ignore_eos=True)
    cont = [e.token for e in stream_generate(backend, memory, tok, [reply[-1]], plain)]
    ref = [e.token for e in stream_generate(backend2, fresh, tok, prompt + reply, plain)]
    assert cont == ref


def test_forks_hold_fewer_bytes_than_copies(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 30)  # a long shared prompt
    n, max_tokens = 4, 16
    backend = fp32_backend(tiny_dir, slots=len(prompt))  # the forks' slots come past the memory's own
    settings = beam_settings(n, max_tokens)
    settings.ignore_eos = True
    beam_run(backend, FullAttentionMemory(backend), tok, prompt, settings)
    per_slot = KVCache.bytes_per_slot(backend.config, torch.float32, True, torch.float32)
    copies = n * (len(prompt) + max_tokens) * per_slot  # N whole memories, each holding the prompt and a reply
    assert backend.kv_resident_bytes() < copies / 2
    # ...and the fork table itself never held more than the tree's distinct tokens
    table = ForkTable(0)
    a = table.write([ForkTable.ROOT])[0]
    table.hold(a)  # two beams share `a`
    b, c = table.write([a, a])
    assert table.held == 3 and table.chain(b)[:1] == table.chain(c)[:1] == [table.slot[a]]
    table.drop(b)
    assert table.held == 2  # b's slot is free, `a` still held by c
    table.drop(c)
    assert table.held == 0 and sorted(table.free) == [0, 1, 2]


def cascade(backend_dir: Path) -> tuple[TorchBackend, CascadeMemory]:
    cfg = CascadeConfig(sink_tokens=4, window=32, block_size=8, retrieval_blocks=2)
    backend = fp32_backend(backend_dir, slots=cfg.num_slots)
    return backend, CascadeMemory(backend, cfg)


def test_beams_on_the_cascade_before_its_window_fills_equal_full_attention(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    prompt = tok.encode("Python is a programming")
    settings = beam_settings(4, 8)
    settings.ignore_eos = True
    backend, memory = cascade(tiny_dir)
    ours = [e.token for e in beam_run(backend, memory, tok, prompt, settings)]
    full = fp32_backend(tiny_dir)
    assert ours == [e.token for e in beam_run(full, FullAttentionMemory(full), tok, prompt, settings)]


def test_beams_on_the_cascade_after_an_eviction(tiny_dir: Path) -> None:
    """After the window slid, each beam's tokens get the log-probabilities a lone fork of the same memory gives them
    (beams sharing one forward never see each other's tokens), and the memory ends as plain decoding leaves it."""
    tok = Tokenizer.from_dir(tiny_dir)
    prompt = tok.encode("Python is a programming language. " * 8)
    settings = beam_settings(4, 8, returned=4)
    settings.ignore_eos = True
    backend, memory = cascade(tiny_dir)
    events = beam_run(backend, memory, tok, prompt, settings)
    reply = [e.token for e in events]
    assert memory.working.evicted > 0 and len(reply) == 8
    assert memory.tokens == prompt + reply[:-1]
    for hyp in events[-1].beams:
        twin_backend, twin = cascade(tiny_dir)
        logits = prefill(twin_backend, twin, prompt, 256)  # (V,)
        forks = BeamForks(twin_backend, twin.fork_view())
        lone = []
        for i, t in enumerate(hyp.tokens):
            lone.append(float(torch.log_softmax(logits, -1)[t]))
            if i + 1 < len(hyp.tokens):
                logits = forks.feed(Step((0,), (t,)))[0]
        assert lone == pytest.approx(list(hyp.logprobs), abs=1e-4)
    # a cancelled search ends on its best beam so far
    backend, memory = cascade(tiny_dir)
    polls = iter([False] * 3 + [True] * 100)
    stopped = list(stream_generate(backend, memory, tok, prompt, settings, should_stop=lambda: next(polls)))
    assert stopped[-1].finish_reason is FinishReason.CANCELLED and 0 < len(stopped) < 8


def test_search_rules_stop_on_done_once_n_finished() -> None:
    search = BeamSearch(BeamSettings(beams=2, early_stopping=EarlyStopping.DONE), frozenset({0}), 50)
    logits = torch.full((1, 5), -10.0)
    logits[0, 0], logits[0, 1], logits[0, 2] = 0.0, -0.1, -0.2  # EOS ranks first
    step = search.step(logits)
    assert not search.done and len(search.finished) == 1 and step.tokens == (1, 2)
    step = search.step(torch.tensor([[0.0, -5, -5, -5, -5], [0.0, -5, -5, -5, -5]]))
    assert search.done and len(search.finished) == 2 and step.tokens == ()


def test_beams_past_the_rotary_table_are_one_sentence(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    backend = fp32_backend(tiny_dir)
    memory = FullAttentionMemory(backend)
    room = memory.fork_view().max_depth
    with pytest.raises(InputTooLarge, match="Beam search can add at most"):
        beam_run(backend, memory, tok, tok.encode("The quick"), beam_settings(2, room + 1))
