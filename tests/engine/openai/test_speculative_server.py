"""The server's speculation: per request (`"speculative"`) and a server default, greedy replies equal to plain
decoding through the official `openai` client, acceptance in `usage` and `/metrics`, and refusals where it does not
combine (beams, a grammar, top logprobs) or needs what the server lacks (a draft model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.generation.speculative import Speculation
from tests.helpers.http_clients import closed_after_test
from tests.helpers.server import KEY, Served, start_server

# Repeats, so that prompt lookup finds n-grams to draft from.
PROMPT = "one two three four one two three four one two three four five six seven one two three"


@pytest.fixture(scope="module")
def speculating(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server whose default is `--speculative lookup`, with the model drafting for itself for "draft" requests."""
    s = start_server(tiny_dir, tmp_path_factory.mktemp("kv-spec"), draft=tiny_dir, speculative=Speculation.LOOKUP)
    yield s
    s.server.stop()


def client(served: Served) -> openai.OpenAI:
    return closed_after_test(openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=120))


def complete(served: Served, **extra: Any) -> openai.types.Completion:
    return client(served).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra or None
    )


def test_greedy_replies_equal_plain_decoding_and_report_acceptance(speculating: Served) -> None:
    plain = complete(speculating, speculative="off")
    assert plain.usage is not None and "accepted_per_forward" not in (plain.usage.model_extra or {})
    auto = complete(speculating, speculative="auto")  # the tiny fp32 model on PyTorch: verifying does not pay
    assert auto.choices[0].text == plain.choices[0].text
    assert auto.usage is not None and "accepted_per_forward" not in (auto.usage.model_extra or {})
    for mode in ("lookup", "draft", None):  # asked for, and the server's default
        got = complete(speculating, **({"speculative": mode} if mode else {}))
        assert got.choices[0].text == plain.choices[0].text
        assert got.usage is not None
        extra = got.usage.model_extra or {}
        assert extra["verify_forwards"] > 0 and extra["drafted_tokens"] >= extra["accepted_tokens"] >= 0
        assert extra["accepted_per_forward"] >= 1.0
    auth = {"Authorization": f"Bearer {KEY}"}
    metrics = httpx.get(speculating.url.removesuffix("/v1") + "/metrics", headers=auth, timeout=30).text
    values = {
        line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("spark_speculative")
    }
    assert values["spark_speculative_verify_forwards_total"] > 0
    assert values["spark_speculative_drafted_tokens_total"] >= values["spark_speculative_accepted_tokens_total"]
    assert values["spark_speculative_accepted_per_forward"] >= 1.0


def test_streamed_chat_speculates_as_asked(served: Served) -> None:
    """A server whose default is off speculates for the request that asks; the streamed text is plain decoding's."""
    messages: Any = [{"role": "user", "content": PROMPT}]
    c = client(served)
    plain = c.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0)
    chunks = c.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculative": "lookup"},
    )
    text, usage = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
        usage = chunk.usage or usage
    assert text == plain.choices[0].message.content
    assert usage is not None and "accepted_per_forward" in (usage.model_extra or {})


@pytest.mark.parametrize(
    "extra",
    [
        {"speculative": "sometimes"},
        {"speculative": 1},
        {"speculative": "lookup", "beam_width": 2},
        {"speculative": "auto", "response_format": {"type": "json_object"}},
        {"speculative": "lookup", "logprobs": True, "top_logprobs": 2},
        {"speculative": "draft"},  # this server has no draft model
    ],
)
def test_speculation_that_cannot_run_is_400(served: Served, extra: dict[str, object]) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(served.url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
    assert r.json()["error"]["message"].count(".") == 1  # one sentence


def test_the_server_default_leaves_beams_and_grammars_plain(speculating: Served) -> None:
    """Under a default of auto, a beam search or a JSON response_format runs as it would without speculation."""
    c = client(speculating)
    beams = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, extra_body={"beam_width": 2})
    assert beams.usage is not None and "accepted_per_forward" not in (beams.usage.model_extra or {})
    fmt: Any = {"type": "json_object"}
    out = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, response_format=fmt
    )
    assert out.usage is not None and "accepted_per_forward" not in (out.usage.model_extra or {})
