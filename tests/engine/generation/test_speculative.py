"""Speculative decoding: greedy output equals plain decoding whatever the drafts (right, wrong at any position), on
full attention and the cascade, across stop strings, EOS and a session save/restore; the memory never keeps a
rejected draft; sampled speculation draws from the target's distribution (chi-square)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine.backends.base import BackendWrapper
from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import FinishReason, GenerationEvent, GenerationSettings, stream_generate
from engine.generation.sampling import Sampler, SamplingSettings
from engine.generation.speculative import MAX_DRAFT, Controller, Draft, PromptLookup, Speculation, Speculator
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory
from engine.memory.cascade import CascadeConfig, CascadeMemory, PersistentStore
from engine.session.engine import Engine, memory_factory_for
from engine.session.replay import FeedLog, check_schedule
from tests.helpers.default_model import default_model_dir
from tests.helpers.fixtures import TinyModel

GREEDY = SamplingSettings(greedy=True)


class Oracle:
    """Drafts the reference continuation, with the draft at `wrong` (0-based within each draft) replaced by another
    token: every verify then rejects at that position (None: every draft right)."""

    def __init__(self, reference: Sequence[int], prompt_len: int, wrong: int | None) -> None:
        self.reference, self.prompt_len, self.wrong = list(reference), prompt_len, wrong
        self.proposed = 0

    def propose(self, context: Sequence[int], k: int) -> Draft:
        at = len(context) - self.prompt_len  # reply tokens so far, the last sampled one included
        tokens = self.reference[at : at + k]
        if self.wrong is not None and self.wrong < len(tokens):
            tokens[self.wrong] = (tokens[self.wrong] + 1) % 300
        self.proposed += len(tokens)
        return Draft(tokens, None)


class EosAt:
    """The tokenizer, with `eos` as its only end-of-reply token."""

    def __init__(self, tok: Tokenizer, eos: int) -> None:
        self.tok, self.eos_ids = tok, frozenset({eos})

    def __getattr__(self, name: str) -> object:
        return getattr(self.tok, name)


def run(
    backend: TorchBackend, memory: Memory, tok: Tokenizer, prompt: list[int], settings: GenerationSettings, **kw: object
) -> list[GenerationEvent]:
    return list(stream_generate(backend, memory, tok, prompt, settings, **kw))  # type: ignore[arg-type]


def cascade(backend: TorchBackend, tmp: Path) -> CascadeMemory:
    """A tiny geometry whose window fills within a short reply: 4 sinks, a 24-token window, blocks of 8, 2 retrieved."""
    cfg = CascadeConfig(sink_tokens=4, window=24, block_size=8, retrieval_blocks=2)
    store = PersistentStore(tmp / "l3", backend.fingerprint, backend.numerics, cfg.persistent_budget_bytes)
    return CascadeMemory(backend, cfg, store=store)


@pytest.mark.parametrize(
    ("kind", "wrong", "k"),
    [(kind, w, 4) for kind in ("full", "cascade") for w in (None, 0, 1, 2, 3)]
    + [(kind, w, MAX_DRAFT) for kind in ("full", "cascade") for w in (None, 9)],  # verifies wider than a small step
)
def test_greedy_equals_plain_with_a_rejection_at_every_position(
    tiny: TinyModel, tmp_path: Path, wrong: int | None, kind: str, k: int
) -> None:
    d, tok = tiny.path, tiny.tokenizer
    prompt = tok.encode("def main():\n    return 42\n")
    settings = GenerationSettings(speculative=Speculation.LOOKUP, max_tokens=40, sampling=GREEDY, ignore_eos=True)

    def memory(b: TorchBackend, tmp: Path) -> Memory:
        if kind == "full":
            b.allocate(1, 256)
            return FullAttentionMemory(b)
        return cascade(b, tmp)

    b = TorchBackend(d)
    plain_mem = memory(b, tmp_path / "plain")
    plain = run(b, plain_mem, tok, prompt, GenerationSettings(**{**vars(settings), "speculative": Speculation.OFF}))
    reference = [e.token for e in plain]
    plain_state = plain_mem.state()[0]

    b2 = TorchBackend(d)
    mem = memory(b2, tmp_path / "spec")
    oracle = Oracle(reference, len(prompt), wrong)
    spec = Speculator(oracle, Controller(max_k=k, adaptive=False))
    events = run(b2, mem, tok, prompt, settings, speculator=spec)
    assert [e.token for e in events] == reference
    assert mem.tokens == plain_mem.tokens  # no rejected draft, no token past the last sampled one
    assert oracle.proposed > 0
    if kind == "cascade":
        assert isinstance(mem, CascadeMemory)
        assert mem.working.evicted > 0  # the window filled and slid while speculating
        meta = mem.state()[0]
        for part in ("working", "prefix", "tokens"):
            assert meta[part] == plain_state[part]
    if wrong is None:
        assert events[-1].forwards < len(reference) - 1  # several tokens per forward


@pytest.mark.parametrize("wrong", [None, 1])
def test_the_routing_query_after_verifies_is_plain_decodings(
    tiny: TinyModel, tmp_path: Path, wrong: int | None
) -> None:
    """Verifies fill the window to its last slot, then plain steps evict and route: the routing query they route with
    (the query summaries of the last proxy_tokens tokens) is the one one-by-one decoding builds. A verify used to
    drop its summary when it took drafts back and keep one summary for all its tokens otherwise, so the first
    routing after the window filled used another query and the reply drifted."""
    d, tok = tiny.path, tiny.tokenizer
    prompt = tok.encode("def main():\n    return 42\n")
    fill = 4 + 24 - len(prompt)  # reply tokens that fill sinks + window (the last one sampled, not fed)
    settings = GenerationSettings(speculative=Speculation.LOOKUP, max_tokens=fill + 1, sampling=GREEDY, ignore_eos=True)
    b = TorchBackend(d)
    plain_mem = cascade(b, tmp_path / "plain")
    off = GenerationSettings(**{**vars(settings), "speculative": Speculation.OFF})
    reference = [e.token for e in run(b, plain_mem, tok, prompt, off)]
    b2 = TorchBackend(d)
    mem = cascade(b2, tmp_path / "spec")
    spec = Speculator(Oracle(reference, len(prompt), wrong), Controller(max_k=4, adaptive=False))
    assert [e.token for e in run(b2, mem, tok, prompt, settings, speculator=spec)] == reference
    assert mem.working.evicted == plain_mem.working.evicted == 0 and mem.speculation_room() == 0
    assert spec.controller.drafted > 0 and mem.retriever.recent
    assert [n for _, n in mem.retriever.recent] == [n for _, n in plain_mem.retriever.recent]
    for (q, _), (p, _) in zip(mem.retriever.recent, plain_mem.retriever.recent, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-4)  # a verify's kernels, not the decode step's
    # The window evicts from the next token on: both route their first blocks with the same query.
    for m, backend, token in ((plain_mem, b, reference[-1]), (mem, b2, reference[-1])):
        for _ in range(12):
            logits = backend.forward(torch.tensor([[token]]), m.plan([token]).as_batch(), last_only=True)
            m.after_forward()
            token = int(logits[0, -1].argmax())
    assert mem.working.groups == plain_mem.working.groups and mem.working.groups[0]
    assert mem.tokens == plain_mem.tokens


def test_cascade_never_verifies_a_chunk_that_would_evict(tiny: TinyModel, tmp_path: Path) -> None:
    d = tiny.path
    b = TorchBackend(d)
    mem = cascade(b, tmp_path)
    assert mem.speculation_room() == 24  # at most a window per plan
    mem.plan(list(range(20)))
    assert mem.speculation_room() == 8
    mem.rollback(5)  # what rollback takes back is free again
    assert mem.speculation_room() == 13 and len(mem.tokens) == 15
    mem.after_forward()
    mem.plan(list(range(13)))
    assert mem.speculation_room() == 0
    mem.plan([1, 2])  # evicts
    with pytest.raises(ValueError):
        mem.rollback(1)  # part of an evicting plan (a forward stopped midway takes back the whole of one)


@pytest.mark.parametrize("case", ["stop", "eos", "length"])
def test_stop_strings_eos_and_the_budget_inside_an_accepted_run(tiny: TinyModel, case: str) -> None:
    d, tok = tiny.path, tiny.tokenizer
    prompt = tok.encode("The quick brown fox")
    b = TorchBackend(d)
    b.allocate(1, 256)
    base = GenerationSettings(max_tokens=30, sampling=GREEDY, speculative=Speculation.OFF, ignore_eos=True)
    reference = [e.token for e in run(b, FullAttentionMemory(b), tok, prompt, base)]
    text = tok.decode(reference[:12])
    if case == "stop":  # a stop string that ends inside the 9th token's text
        settings = GenerationSettings(
            speculative=Speculation.LOOKUP, max_tokens=30, sampling=GREEDY, stop=(text[-3:],), ignore_eos=True
        )
    elif case == "eos":  # a model whose EOS is the 7th token it says
        tok = EosAt(tok, reference[6])  # type: ignore[assignment]  # a Tokenizer stand-in
        settings = GenerationSettings(speculative=Speculation.LOOKUP, max_tokens=30, sampling=GREEDY)
    else:
        settings = GenerationSettings(speculative=Speculation.LOOKUP, max_tokens=10, sampling=GREEDY, ignore_eos=True)
    plain_mem = FullAttentionMemory(b)
    plain = run(b, plain_mem, tok, prompt, GenerationSettings(**{**vars(settings), "speculative": Speculation.OFF}))
    b2 = TorchBackend(d)
    b2.allocate(1, 256)
    mem = FullAttentionMemory(b2)
    spec = Speculator(Oracle(reference, len(prompt), None), Controller(max_k=8, adaptive=False))
    events = run(b2, mem, tok, prompt, settings, speculator=spec)
    assert [(e.text, e.token, e.finish_reason) for e in events] == [(e.text, e.token, e.finish_reason) for e in plain]
    assert events[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert mem.tokens == plain_mem.tokens


def test_save_and_restore_continue_as_plain_decoding(tiny: TinyModel, tmp_path: Path) -> None:
    d = tiny.path
    prompt = "def main():\n    return 42\ndef main():\n"

    def session(name: str) -> Engine:
        factory = memory_factory_for(d, cache_dir=tmp_path / name, window=24, block_size=8, retrieval_blocks=2)
        return Engine.load(d, "cpu", memory_factory=factory)

    off = GenerationSettings(max_tokens=40, sampling=GREEDY, ignore_eos=True, speculative=Speculation.OFF)
    plain = [e.token for e in session("a").new_session().complete(prompt, off)]

    on = GenerationSettings(
        speculative=Speculation.LOOKUP, max_tokens=15, sampling=GREEDY, ignore_eos=True, draft_tokens=4
    )
    s = session("b").new_session()
    first = [e.token for e in s.complete(prompt, on)]
    s.save(tmp_path / "s.spark")
    s.save(tmp_path / "c.spark", compact=True)  # the feed recipe replays the verifies and what they took back
    for name, file in (("c", "s.spark"), ("d", "c.spark")):
        s2 = session(name).new_session()
        s2.load(tmp_path / file)
        if file == "c.spark":
            assert s2.restore_digest_ok is True  # rebuilt bit for bit
        rest = [e.token for e in s2.continue_reply(GenerationSettings(**{**vars(on), "max_tokens": 25}))]
        assert first + rest == plain


def test_the_feed_log_records_verifies_and_what_they_took_back() -> None:
    log = FeedLog()
    log.record_feed(10, 10)  # the prompt
    log.record_feed(15, 5, verify=True)  # a verify of 5: 2 drafts taken back after it
    log.record_feed(14, 1)  # a decode step
    log.record_feed(19, 5, verify=True)  # a verify that kept every token
    log.record_feed(20, 1)
    log.record_feed(25, 5, verify=True)  # a verify, 1 taken back, and the reply ends
    schedule = [["f", 10, 1], ["s", 5, 3], ["f", 1, 1], ["s", 5, 5], ["f", 1, 1], ["s", 5, 4]]
    assert log.schedule_for(24) == schedule
    assert check_schedule(log.schedule_for(24), 24)
    plain = FeedLog()
    plain.record_feed(10, 10)
    plain.record_feed(15, 5)
    plain.record_feed(13, 1)  # only a verify's drafts are ever taken back: this log no longer adds up
    assert plain.schedule_for(13) is None


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's test at p = 1e-4 (Wilson–Hilferty's quantile), over the cells the target gives any mass."""
    n = float(counts.sum())
    live = probs > 0
    if bool((counts[~live] > 0).any()):
        return False  # a token the target never draws
    expected = probs[live] * n
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    df = int(live.sum()) - 1
    z = 3.719  # the standard normal's 1 - 1e-4 quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingSettings(temperature=1.0, seed=1),
        SamplingSettings(temperature=0.7, top_k=6, seed=2),
        SamplingSettings(temperature=1.3, top_p=0.8, seed=3),
        SamplingSettings(temperature=1.0, min_p=0.05, seed=4),
    ],
)
@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_sampled_verification_keeps_the_target_distribution(sampling: SamplingSettings, drafter: str) -> None:
    vocab = 12
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, generator=g) * 2  # the target's logits (V,)
    sampler = Sampler(sampling)
    target = sampler.distribution(logits)
    q = torch.softmax(torch.randn(vocab, generator=g), -1)  # a draft model's distribution, unlike the target's
    counts = torch.zeros(vocab)
    n = 20000
    drafts = torch.multinomial(q, n, replacement=True, generator=g) if drafter == "model" else None
    for i in range(n):
        d = int(drafts[i]) if drafts is not None else int(torch.argmax(logits))  # lookup: a token for sure
        sample, _ = sampler.verify(logits, d, q if drafts is not None else None)
        counts[sample.token] += 1
    assert chi_square_ok(counts, target)


def test_prompt_lookup_drafts_the_continuation_of_the_latest_longest_match() -> None:
    lookup = PromptLookup()
    ctx = [1, 2, 3, 4, 5, 9, 9, 2, 3, 7, 8, 1, 2, 3]
    assert lookup.propose(ctx, 3).tokens == [4, 5, 9]  # "1 2 3" (longest) before 4 5 9, not "2 3" before 7 8
    lookup2 = PromptLookup()
    assert lookup2.propose([1, 2, 3, 1, 2], 2).tokens == [3, 1]
    assert lookup2.propose([1, 2, 3, 1, 2, 3, 1, 2], 4).tokens == [3, 1, 2]  # "2 3 1 2", the longest, once
    assert PromptLookup().propose([5, 6, 7], 4).tokens == []


def test_prompt_lookup_continues_a_copied_passage_past_a_phrase_the_reply_repeated() -> None:
    passage = list(range(10, 40))  # a pasted document
    reply = [10, 11, 12, 13, 14, 15, 12, 13]  # copying it, with "12 13" said twice: its latest match is 2 back
    assert PromptLookup().propose([*passage, 99, *reply], 6).tokens == [14, 15, 16, 17, 18, 19]


class VerifyPays(BackendWrapper):
    """A backend said to verify cheaply (Backend.verify_pays), to see `auto` follow that signal."""

    @property
    def verify_pays(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("pays", "sampling", "speculates"),
    [
        (False, GREEDY, False),  # verifying is not measured to pay (fp32 PyTorch): plain decoding
        (True, GREEDY, True),
        (True, SamplingSettings(temperature=0.8), False),  # sampled replies accept too few lookup drafts
        (True, SamplingSettings(temperature=0.0), True),  # greedy by its temperature
    ],
)
def test_auto_speculates_only_where_verifying_pays(
    tiny: TinyModel, pays: bool, sampling: SamplingSettings, speculates: bool
) -> None:
    d, tok = tiny.path, tiny.tokenizer
    inner = TorchBackend(d)
    backend = VerifyPays(inner) if pays else inner
    backend.allocate(1, 256)
    prompt = tok.encode("one two three one two three one two three")
    oracle = Oracle(list(range(5, 60)), len(prompt), None)  # proposes whatever it is asked for
    spec = Speculator(oracle, Controller(max_k=3, adaptive=False))
    settings = GenerationSettings(speculative=Speculation.AUTO, max_tokens=12, sampling=sampling, ignore_eos=True)
    events = list(stream_generate(backend, FullAttentionMemory(backend), tok, prompt, settings, speculator=spec))
    assert (oracle.proposed > 0) is speculates
    assert {e.speculating for e in events} == {speculates}
    lookup = Speculator(Oracle(list(range(5, 60)), len(prompt), None), Controller(max_k=3, adaptive=False))
    forced = GenerationSettings(**{**vars(settings), "speculative": Speculation.LOOKUP})  # lookup: always
    events = list(stream_generate(inner, FullAttentionMemory(inner), tok, prompt, forced, speculator=lookup))
    assert events[-1].speculating


def test_the_controller_decodes_plainly_where_verifying_does_not_pay() -> None:
    c = Controller()
    assert c.choose(8) == 0  # nothing measured yet
    c.record_decode(0.010)
    for _ in range(20):
        c.record_verify(5, 0.050, 4, 0)  # a verify costs 5 steps and nothing is accepted
    assert all(c.choose(8) == 0 for _ in range(10))
    cheap = Controller()
    cheap.record_decode(0.010)
    for _ in range(20):
        cheap.record_verify(5, 0.012, 4, 4)  # cheap verifies, every draft accepted
    assert cheap.choose(8) >= 4


def test_the_controller_keeps_a_cost_per_width() -> None:
    """A verify's cost is not linear in its width (the CPU kernels' token lanes): a wide verify measured cheaper
    than a narrower one is chosen where acceptance is high, and passed up where it is low."""
    c = Controller(max_k=15)
    c.record_decode(0.010)
    for _ in range(20):
        c.record_verify(3, 0.025, 2, 2)  # 3 tokens: 2.5 decode steps
        c.record_verify(16, 0.028, 15, 15)  # 16 tokens in one lane group: 2.8
    assert c.cost(3) == pytest.approx(0.025) and c.cost(16) == pytest.approx(0.028)
    # not measured: from width 3 up, each token at half the prior (width 3's own 0.75 steps a token is higher)
    assert c.cost(8) == pytest.approx(0.025 + 5 * 0.5 * 0.25 * 0.010)
    assert c.in_run  # the last verify kept every draft: the run's acceptance applies
    c.run_rate = 0.75  # 16 tokens give 3.96 for 2.8 steps; 3 tokens 2.31 for 2.5 (a slope from them: never)
    assert c.choose(15) == 15
    c.run_rate = 0.2  # not even the cheapest guess (width 2, 1.25 steps) pays
    assert c.choose(15) == 0


def test_an_unmeasured_width_is_guessed_from_the_widest_measured_one() -> None:
    """Where the widest measured verify costs less a token than the prior, a wider one is guessed at half that
    (a verify's cost per token falls with its width): tried, and then known."""
    c = Controller(max_k=15)
    c.record_decode(0.010)
    assert c.cost(5) == pytest.approx(0.010 * (1 + 4 * 0.25))  # nothing measured: the prior
    c.record_verify(8, 0.017, 7, 7)  # 0.1 of a decode step a token past the first
    assert c.cost(16) == pytest.approx(0.017 + 8 * 0.5 * 0.001)
    c.run_rate = 0.97
    assert c.choose(15) == 15  # the guess makes the widest pay inside a run
    c.record_verify(16, 0.040, 15, 15)  # measured dearer than guessed
    assert c.cost(16) == pytest.approx(0.040)


def test_the_controller_verifies_wide_inside_a_copying_run_and_narrow_outside_it() -> None:
    """Drafts come in runs: after a verify that kept every draft the next one is judged by the acceptance measured in
    such runs, after a rejection or a plain step by the acceptance of fresh matches."""
    c = Controller(max_k=15)
    c.record_decode(0.010)
    for _ in range(20):
        for _ in range(3):
            c.record_verify(8, 0.030, 7, 0)  # fresh matches: rejected at once
        c.record_verify(2, 0.018, 1, 1)  # kept: a run begins
        c.record_verify(16, 0.040, 15, 15)  # inside the run: every draft kept
        c.record_decode(0.010)  # the run ends
    assert c.accept_rate < 0.5 and c.run_rate > 0.99
    assert not c.in_run and c.choose(15) == 0
    c.record_verify(2, 0.018, 1, 1)
    assert c.in_run and c.choose(15) == 15
    c.record_verify(16, 0.040, 15, 3)  # a rejection ends the run
    assert not c.in_run and c.choose(15) == 0


@pytest.fixture(scope="module")
def default_model() -> tuple[Engine, list[int], list[int]]:
    """The default model on the cascade, a code-editing prompt, and its plain greedy reply."""
    d = default_model_dir()
    engine = Engine.load(d, "cpu", memory_factory=memory_factory_for(d, prefix_cache=False), quantize="auto")
    prompt = engine.tokenizer.encode_chat(
        [
            {
                "role": "user",
                "content": "Repeat this line exactly: def total(items):\n    return sum(i.price for i in items)",
            }
        ]
    )
    b = engine.backend
    off = GenerationSettings(max_tokens=24, sampling=GREEDY, ignore_eos=True, speculative=Speculation.OFF)
    reference = [e.token for e in run(b, engine.memory_factory(b), engine.tokenizer, prompt, off)]  # type: ignore[arg-type]
    return engine, prompt, reference


@pytest.mark.parametrize("wrong", [None, 0, 1, 2])
def test_default_model_greedy_equals_plain_with_a_rejection_at_every_position(
    default_model: tuple[Engine, list[int], list[int]], wrong: int | None
) -> None:
    engine, prompt, reference = default_model
    b = engine.backend
    memory = engine.memory_factory(b)
    settings = GenerationSettings(speculative=Speculation.LOOKUP, max_tokens=24, sampling=GREEDY, ignore_eos=True)
    spec = Speculator(Oracle(reference, len(prompt), wrong), Controller(max_k=3, adaptive=False))
    events = run(b, memory, engine.tokenizer, prompt, settings, speculator=spec)  # type: ignore[arg-type]
    assert [e.token for e in events] == reference
    assert memory.tokens == prompt + reference[:-1]
