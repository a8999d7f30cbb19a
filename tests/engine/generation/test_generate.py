"""The one generation loop: a request ends the same way (EOS, stop string, max tokens, cancel) and streams the same
events whether it runs alone (`stream_generate`), in a static batch (`generate_batch`) or on the scheduler; every
final event carries the text still held back, so a reply's events always add up to the decoded tokens.

A scripted backend makes the model's next token a function of the last token fed, so each case is an exact
token sequence on every path, including byte tokens that split a character (held back by the detokenizer).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tokenizers
import torch

from engine.backends.torch_backend import TorchBackend
from engine.generation.batch import generate_batch
from engine.generation.loop import (
    FinishReason,
    GenerationEvent,
    GenerationSettings,
    PrefillProgress,
    Reply,
    stream_generate,
)
from engine.generation.sampling import SamplingSettings
from engine.generation.scheduler import Request, Scheduler, SchedulerConfig
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory
from tests.helpers.tiny import make_tiny_model

GREEDY = SamplingSettings(greedy=True)
Events = list[tuple[str, int | None, FinishReason | None]]


class Scripted:
    """The tiny model's backend, except that each row's last logits favour `script[last token fed]` by far."""

    def __init__(self, inner: TorchBackend, script: dict[int, int]) -> None:
        self._inner = inner
        self.script = script

    def forward(
        self, tokens: torch.Tensor, batch: Any, last_only: bool = False, should_stop: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        out = self._inner.forward(tokens, batch, last_only=last_only, should_stop=should_stop).clone()  # (B, T, V)
        fed = tokens[:, -out.shape[1] :]  # the tokens whose logits came back (all of them for a verify forward)
        for r, row in enumerate(fed.tolist()):
            for t, token in enumerate(row):
                if token in self.script:
                    out[r, t] = 0.0
                    out[r, t, self.script[token]] = 50.0
        return out

    def fork(self) -> Scripted:
        return Scripted(self._inner.fork(), self.script)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Scripted, Tokenizer, dict[str, int]]:
    d = make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=1)
    tok = Tokenizer.from_dir(d)
    vocab = tokenizers.Tokenizer.from_file(str(Path(d) / "tokenizer.json")).get_vocab()
    # Byte-level tokens: "Ã" is the byte 0xC3 and "©" 0xA9, the two halves of "é" in UTF-8.
    ids = {c: vocab[c] for c in ("x", "Ã", "©", "p", "a", "b", "c", "q", "d")}
    ids["eos"] = min(tok.eos_ids)
    script = {
        ids["x"]: ids["Ã"],
        ids["Ã"]: ids["©"],
        ids["©"]: ids["Ã"],  # x → é é é … split over two tokens each
        ids["p"]: ids["a"],
        ids["a"]: ids["b"],
        ids["b"]: ids["c"],
        ids["c"]: ids["a"],  # p → a b c a b c …
        ids["q"]: ids["d"],
        ids["d"]: ids["eos"],  # q → d EOS
    }
    return Scripted(TorchBackend(d), script), tok, ids


def alone(
    backend: Scripted, tok: Tokenizer, prompt: list[int], settings: GenerationSettings, **kw: Any
) -> list[GenerationEvent]:
    b = backend.fork()
    b.allocate(1, 64)
    return list(stream_generate(b, FullAttentionMemory(b), tok, prompt, settings, **kw))  # type: ignore[arg-type]  # a Backend stand-in


def shape(events: list[GenerationEvent]) -> Events:
    return [(e.text, e.token, e.finish_reason) for e in events]


def cases(ids: dict[str, int]) -> dict[str, tuple[list[int], GenerationSettings]]:
    return {
        "eos": ([ids["q"]], GenerationSettings(max_tokens=8, sampling=GREEDY)),
        "stop": ([ids["p"]], GenerationSettings(max_tokens=8, stop=("bc",), sampling=GREEDY)),
        "length": ([ids["x"]], GenerationSettings(max_tokens=3, sampling=GREEDY)),
    }


def test_each_ending_on_a_single_request(model: tuple[Scripted, Tokenizer, dict[str, int]]) -> None:
    backend, tok, ids = model
    c = cases(ids)
    eos = alone(backend, tok, *c["eos"])
    assert shape(eos) == [("d", ids["d"], None), ("", ids["eos"], FinishReason.STOP)]
    stop = alone(backend, tok, *c["stop"])  # "b" is held back as the start of "bc", then dropped with it
    assert shape(stop) == [("a", ids["a"], None), ("", ids["b"], None), ("", ids["c"], FinishReason.STOP)]
    length = alone(backend, tok, *c["length"])  # the last byte of a split "é" is flushed with the final event
    assert shape(length) == [("", ids["Ã"], None), ("é", ids["©"], None), ("\ufffd", ids["Ã"], FinishReason.LENGTH)]


def test_batches_and_the_scheduler_end_each_request_as_it_ends_alone(
    model: tuple[Scripted, Tokenizer, dict[str, int]],
) -> None:
    backend, tok, ids = model
    for prompt, settings in cases(ids).values():
        want = alone(backend, tok, prompt, settings)
        (batched,) = generate_batch(backend.fork(), tok, [prompt], settings)  # type: ignore[arg-type]  # a Backend stand-in
        assert (batched.tokens, batched.text, batched.finish_reason) == (
            [e.token for e in want],
            "".join(e.text for e in want),
            want[-1].finish_reason,
        )
    with Scheduler(backend.fork(), tok, SchedulerConfig(max_batch=3, num_slots=64)) as sched:  # type: ignore[arg-type]  # a Backend stand-in
        runs: dict[str, tuple[list[GenerationEvent], list[int], GenerationSettings]] = {
            name: ([], *case) for name, case in cases(ids).items()
        }
        futures = {name: sched.submit(Request(p, s, on_event=got.append)) for name, (got, p, s) in runs.items()}
        for name, f in futures.items():
            f.result(timeout=60)
            got, prompt, settings = runs[name]
            assert shape(got) == shape(alone(backend, tok, prompt, settings)), name


class _NoPause:
    def prefill_chunk(self, requested: int) -> int:
        return requested

    def before_step(self, should_stop: object) -> None:
        pass


def test_cancel_between_steps_flushes_the_held_back_text_alone_and_on_the_scheduler(
    model: tuple[Scripted, Tokenizer, dict[str, int]],
) -> None:
    """Stopped after the first half of "é": the final event carries the detokenizer's pending text (as U+FFFD),
    so the reply's text is the decoded tokens on both paths."""
    backend, tok, ids = model
    settings = GenerationSettings(max_tokens=8, sampling=GREEDY)
    want = [("", ids["Ã"], None), ("\ufffd", None, FinishReason.CANCELLED)]
    seen: list[GenerationEvent] = []

    def consume() -> list[GenerationEvent]:
        b = backend.fork()
        b.allocate(1, 64)
        gen = stream_generate(
            b, FullAttentionMemory(b), tok, [ids["x"]], settings, should_stop=lambda: bool(seen), pacer=_NoPause()
        )  # type: ignore[arg-type]  # a Backend stand-in
        for ev in gen:
            seen.append(ev)
        return seen

    assert shape(consume()) == want
    with Scheduler(backend.fork(), tok, SchedulerConfig(max_batch=2, num_slots=64)) as sched:  # type: ignore[arg-type]  # a Backend stand-in
        got: list[GenerationEvent] = []
        request = Request([ids["x"]], settings)

        def cancel_after(ev: GenerationEvent) -> None:
            got.append(ev)
            request.cancel()

        request.on_event = cancel_after
        completion = sched.submit(request).result(timeout=60)
    assert shape(got) == want
    assert (completion.text, completion.finish_reason) == ("\ufffd", FinishReason.CANCELLED)
    assert completion.text == tok.decode(completion.tokens)


def test_cancel_seen_after_sampling_ends_with_that_token_and_its_held_back_text(
    model: tuple[Scripted, Tokenizer, dict[str, int]],
) -> None:
    backend, tok, ids = model
    read: list[PrefillProgress] = []
    events = alone(
        backend,
        tok,
        [ids["x"]],
        GenerationSettings(max_tokens=8, sampling=GREEDY),
        should_stop=lambda: bool(read) and read[-1].done == read[-1].total,
        on_prefill=read.append,
    )
    assert shape(events) == [("\ufffd", ids["Ã"], FinishReason.CANCELLED)]


def test_reply_asks_should_stop_only_when_nothing_else_ended_it(
    model: tuple[Scripted, Tokenizer, dict[str, int]],
) -> None:
    _, tok, ids = model
    reply = Reply(tok, 1, GenerationSettings(max_tokens=1, sampling=GREEDY))
    asked: list[bool] = []
    ev = reply.accept(ids["d"], -0.1, lambda: asked.append(True) or True)  # type: ignore[func-returns-value]  # records, then True
    assert ev.finish_reason is FinishReason.LENGTH and not asked


def test_the_repetition_penalty_looks_at_the_reply_only(model: tuple[Scripted, Tokenizer, dict[str, int]]) -> None:
    """The loop guard penalises what the reply said, never the prompt (the question's words, the template's
    end-of-turn token), as llama.cpp's sampler does."""
    _, tok, ids = model
    penalty = SamplingSettings(temperature=0.2, repetition_penalty=2.0, repetition_window=4)
    reply = Reply(tok, 12, GenerationSettings(max_tokens=8, sampling=penalty))
    logits = torch.ones(tok.vocab_size)  # (V,)
    assert torch.equal(reply.process(logits), logits)  # nothing said yet: nothing penalised, whatever the prompt
    reply.accept(ids["a"], -0.1)
    out = reply.process(logits, ahead=[ids["b"]])  # a draft ahead counts as said
    assert out[ids["a"]] == out[ids["b"]] == 0.5 and out[ids["c"]] == 1.0
    for t in ("c", "d", "q", "p"):
        reply.accept(ids[t], -0.1)
    assert reply.process(logits)[ids["a"]] == 1.0  # out of the 4-token window again


def test_finish_reasons_are_the_api_words() -> None:
    from engine.openai.protocol import finish_reason, parse_finish_reason

    assert [finish_reason(r) for r in FinishReason] == ["stop", "length", "stop", "tool_calls"]
    assert [parse_finish_reason(w) for w in ("stop", "length", "content_filter", None)] == [
        FinishReason.STOP,
        FinishReason.LENGTH,
        FinishReason.STOP,
        FinishReason.STOP,
    ]
