"""Static batching gives the tokens each prompt gets alone (greedy and seeded), whatever the length mix."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.backends.torch_backend import TorchBackend
from engine.generation.batch import RowBatcher, RowView, generate_batch
from engine.generation.loop import GenerationSettings, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory
from tests.helpers.fixtures import TinyModel
from tests.helpers.tiny import make_tiny_model

GREEDY = SamplingSettings(greedy=True)


def alone(backend: TorchBackend, tok: Tokenizer, ids: list[int], settings: GenerationSettings) -> list[int]:
    b = backend.fork()
    b.allocate(1, len(ids) + settings.max_tokens)
    return [ev.token for ev in stream_generate(b, FullAttentionMemory(b), tok, ids, settings) if ev.token is not None]


def prompts(tok: Tokenizer) -> list[list[int]]:
    text = "The quick brown fox jumps over the lazy dog. Python is a programming language. def main(): return 42"
    ids = tok.encode(text)
    return [ids[:n] for n in (1, 3, 7, 12, len(ids), 5, 2, 9)]


def test_batched_equals_alone_greedy(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    settings = GenerationSettings(max_tokens=12, sampling=GREEDY, prefill_chunk=4)
    ps = prompts(tok)
    got = generate_batch(backend.fork(), tok, ps, settings, max_batch=8)
    for p, c in zip(ps, got, strict=True):
        assert c.tokens == alone(backend, tok, p, settings)
        assert c.prompt_tokens == len(p)
        assert c.finish_reason in ("stop", "length")


def test_bucketed_groups_and_text_prompts(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    settings = GenerationSettings(max_tokens=6, sampling=GREEDY, prefill_chunk=256)
    texts = ["Memory cascade", "def main():", "The quick brown fox jumps over", "Python"]
    got = generate_batch(backend.fork(), tok, texts, settings, max_batch=3)  # two buckets: 3 + 1 rows
    assert [c.tokens for c in got] == [alone(backend, tok, tok.encode(t), settings) for t in texts]
    assert [c.text for c in got] == [tok.decode(c.tokens) for c in got]


def test_seeded_rows_draw_their_own_streams(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    settings = GenerationSettings(max_tokens=8, sampling=SamplingSettings(temperature=1.5, seed=7), prefill_chunk=3)
    ps = prompts(tok)[:4]
    got = generate_batch(backend.fork(), tok, ps, settings)
    assert [c.tokens for c in got] == [alone(backend, tok, p, settings) for p in ps]


def test_padding_is_harmless(tiny: TinyModel) -> None:
    """Rows fed nothing or fewer tokens stay finite and leave other rows' logits unchanged."""
    backend = tiny.backend
    b = backend.fork()
    b.allocate(3, 17)
    view = RowView(b)
    mems = [FullAttentionMemory(view, r) for r in range(3)]  # type: ignore[arg-type]
    assert mems[0].backend.num_slots == 16
    feeds = [[5, 6, 7, 8], [9], []]
    plans = [m.plan(f) if f else None for m, f in zip(mems, feeds, strict=True)]
    logits = RowBatcher(b).forward(feeds, plans)
    assert torch.isfinite(logits).all()
    solo = backend.fork()
    solo.allocate(1, 16)
    m = FullAttentionMemory(solo)
    ref = solo.forward(torch.tensor([[9]]), m.plan([9]).as_batch(), last_only=True)[0, -1]
    torch.testing.assert_close(logits[1], ref, rtol=1e-5, atol=1e-5)


def test_batched_cascade_equals_alone(tiny: TinyModel) -> None:
    """Each row's own cascade (evicting, paging episodic blocks) gives the tokens of a lone cascade run."""
    from engine.memory.cascade.config import CascadeConfig
    from engine.memory.cascade.core import CascadeMemory

    backend, tok = tiny.backend, tiny.tokenizer
    cfg = CascadeConfig(
        sink_tokens=2, window=16, block_size=4, retrieval_blocks=2, routing="hybrid", proxy_tokens=4, reroute_every=4
    )
    settings = GenerationSettings(max_tokens=14, sampling=GREEDY, prefill_chunk=8)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Python is a programming language. " * 2)
    ps = [ids[:n] for n in (40, 9, 27, 3)]
    got = generate_batch(
        backend.fork(), tok, ps, settings, lambda b, r: CascadeMemory(b, cfg, row=r), num_slots=cfg.num_slots
    )
    for p, c in zip(ps, got, strict=True):
        b = backend.fork()
        b.allocate(1, cfg.num_slots)
        want = [ev.token for ev in stream_generate(b, CascadeMemory(b, cfg), tok, p, settings) if ev.token is not None]
        assert c.tokens == want


def test_bench_batch_smoke(tmp_path: Path) -> None:
    import argparse

    from engine.bench import batch as bench

    d = make_tiny_model(tmp_path / "m", layers=1)
    out = bench.run(argparse.Namespace(model=d, backend="cpu", threads=None, quick=True, json=True, requests=4))
    # The speed figures are measurements (README); what the smoke run can check is that every path did the work
    # it reports: these prompts, 8 tokens each, and exactly the tokens of a lone greedy run on both batched paths.
    vocab = TorchBackend(d).config.vocab_size
    assert out["requests"] == 4 and out["tokens_per_request"] == 8
    assert out["prompt_tokens"] == sum(len(p) for p in bench.prompts(vocab, 4))
    assert out["same_tokens"] == 1.0 and out["same_tokens_continuous"] == 1.0


class _RecordingBackend:
    """A backend that records how many rows each forward ran (and otherwise is the backend it wraps)."""

    def __init__(self, inner: TorchBackend) -> None:
        self._inner = inner
        self.rows_run: list[int] = []

    def forward(self, tokens: torch.Tensor, batch, last_only: bool = False, should_stop=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        self.rows_run.append(tokens.shape[0])
        return self._inner.forward(tokens, batch, last_only=last_only, should_stop=should_stop)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._inner, name)


def test_forwards_run_only_up_to_the_last_busy_row(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    b = backend.fork()
    b.allocate(4, 65)
    view = RowView(b)
    memories = [FullAttentionMemory(view, r) for r in range(4)]  # type: ignore[arg-type]
    spy = _RecordingBackend(b)
    batcher = RowBatcher(spy)  # type: ignore[arg-type]
    ids = prompts(tok)[0]
    got = []
    for feeds in ([ids, [], [], []], [[], [], ids, []]):  # row 0 alone, then row 2 alone
        plans = [memories[r].plan(f) if f else None for r, f in enumerate(feeds)]
        logits = batcher.forward(feeds, plans)  # (4, V)
        assert logits.shape[0] == 4
        got.append(logits[next(r for r, f in enumerate(feeds) if f)])
    assert spy.rows_run == [1, 3]
    # Same logits as a lone run of the prompt, whichever rows ran (the view switch re-derived the read copies).
    lone = backend.fork()
    lone.allocate(1, len(ids))
    want = stream_generate(
        lone,
        FullAttentionMemory(lone),
        tok,
        ids,
        GenerationSettings(max_tokens=1, sampling=SamplingSettings(greedy=True)),
    )
    token = next(want).token
    assert [int(g.argmax()) for g in got] == [token, token]
    torch.testing.assert_close(got[0], got[1])
