"""The server's `beam_width`: the choices are the search's `n` best beams, the same as the engine's beam search
alone, streamed or not; `n` above the beams and beams under a grammar are refused with OpenAI's error shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.generation.beam import BeamSettings
from engine.generation.loop import GenerationSettings, stream_generate
from engine.memory.base import FullAttentionMemory
from tests.helpers.http_clients import closed_after_test
from tests.helpers.server import KEY, Served


def client(served: Served) -> openai.OpenAI:
    return closed_after_test(openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=120))


def alone(served: Served, ids: list[int], beams: int, n: int) -> list[str]:
    """The n best beams' texts from the engine alone: full attention on a fresh slot table."""
    b = served.backend.fork()
    b.allocate(1, len(ids) + 16)
    s = GenerationSettings(max_tokens=12, beam=BeamSettings(beams, returned=n))
    events = list(stream_generate(b, FullAttentionMemory(b), served.tokenizer, ids, s))
    return [served.tokenizer.decode(list(h.tokens)) for h in events[-1].beams]


def test_beam_width_choices_are_the_best_beams(served: Served) -> None:
    prompt = "The quick brown"
    want = alone(served, served.tokenizer.encode(prompt), 3, 2)
    extra = {"beam_width": 3}
    got = client(served).completions.create(model="tiny", prompt=prompt, max_tokens=12, n=2, extra_body=extra)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    assert got.usage is not None and got.usage.completion_tokens > 0
    streamed = client(served).completions.create(
        model="tiny", prompt=prompt, max_tokens=12, n=2, stream=True, extra_body=extra
    )
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"beam_width": 2, "n": 3}, "n"),
        ({"beam_width": 2, "response_format": {"type": "json_object"}}, "beam_width"),
        ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping"),
        ({"beam_width": 99}, "beam_width"),
    ],
)
def test_bad_beam_requests_are_400(served: Served, extra: dict[str, object], field: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(served.url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
