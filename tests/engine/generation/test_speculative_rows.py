"""Speculation per row of a batch and of the scheduler: a speculating row's verify is a multi-token step of that
row, rows that do not speculate keep one-token steps, and greedy tokens per row are plain decoding's."""

from __future__ import annotations

from engine.backends.torch_backend import TorchBackend
from engine.generation.batch import generate_batch
from engine.generation.loop import GenerationSettings, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.generation.scheduler import Request, Scheduler, SchedulerConfig
from engine.generation.speculative import Speculation
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory
from tests.helpers.fixtures import TinyModel

GREEDY = SamplingSettings(greedy=True)
# Repeats, so that prompt lookup finds n-grams to draft from (the tiny model's greedy replies repeat too).
TEXT = "one two three four one two three four one two three four five six seven one two three"


def plain(n: int) -> GenerationSettings:
    return GenerationSettings(max_tokens=n, sampling=GREEDY, prefill_chunk=4)


def speculating(n: int, drafts: int = 4) -> GenerationSettings:
    """Prompt lookup with a fixed number of drafts: every match is verified, whatever it costs."""
    return GenerationSettings(
        max_tokens=n, sampling=GREEDY, prefill_chunk=4, speculative=Speculation.LOOKUP, draft_tokens=drafts
    )


def alone(backend: TorchBackend, tok: Tokenizer, ids: list[int], s: GenerationSettings) -> list[int]:
    b = backend.fork()
    b.allocate(1, len(ids) + s.max_tokens + 16)
    return [
        ev.token
        for ev in stream_generate(b, FullAttentionMemory(b), tok, ids, plain(s.max_tokens))
        if ev.token is not None
    ]


def test_batch_rows_speculate_and_give_plain_tokens(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    ids = tok.encode(TEXT)
    ps = [ids, ids[:9], ids[-7:]]
    s = speculating(24)
    got = generate_batch(backend.fork(), tok, ps, s, max_batch=3)
    for p, c in zip(ps, got, strict=True):
        assert c.tokens == alone(backend, tok, p, s)
        assert c.forwards >= 1
    assert sum(c.drafted_tokens for c in got) > 0  # verifies ran
    assert sum(c.accepted_tokens for c in got) > 0
    # A forward gave more than one token where drafts were accepted, and the counts agree with the tokens.
    for c in got:
        assert c.forwards + c.accepted_tokens == len(c.tokens) - 1 or c.finish_reason == "stop"


def test_scheduler_mixes_speculating_and_plain_rows(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    ids = tok.encode(TEXT)
    jobs = [(ids, speculating(20)), (ids[:11], plain(20)), (ids[-9:], speculating(16, drafts=7))]
    with Scheduler(backend.fork(), tok, SchedulerConfig(max_batch=3, num_slots=128)) as sched:
        futures = [sched.submit(Request(p, s)) for p, s in jobs]
        done = [f.result(timeout=120) for f in futures]
    for (p, s), c in zip(jobs, done, strict=True):
        assert c.tokens == alone(backend, tok, p, s)
        assert c.text == tok.decode(c.tokens)
    assert done[1].drafted_tokens == 0 and done[1].forwards == len(done[1].tokens) - 1  # one-token steps
    assert done[0].drafted_tokens + done[2].drafted_tokens > 0


def test_a_rows_controller_keeps_what_it_measured_for_the_next_reply(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    ids = tok.encode(TEXT)
    adaptive = GenerationSettings(max_tokens=24, sampling=GREEDY, prefill_chunk=4, speculative=Speculation.LOOKUP)
    with Scheduler(backend.fork(), tok, SchedulerConfig(max_batch=1, num_slots=128)) as sched:
        first = sched.submit(Request(ids, adaptive)).result(timeout=120)
        ctl = sched.controllers[0]
        measured = ctl.decode_s
        assert measured is not None  # the first reply measured a decode step
        costs = dict(ctl.verify_s)
        forwards = ctl.forwards
        seen: list[tuple[float | None, dict[int, float]]] = []
        second = Request(ids[:-2], adaptive)
        second.on_event = lambda ev: seen.append((ctl.decode_s, dict(ctl.verify_s))) if not seen else None
        got = sched.submit(second).result(timeout=120)
    assert seen[0] == (measured, costs)  # the second reply's first token came with the first's figures
    assert ctl.forwards > forwards  # and the second reply went on measuring into the same controller
    assert first.tokens == alone(backend, tok, ids, adaptive)
    assert got.tokens == alone(backend, tok, ids[:-2], adaptive)
