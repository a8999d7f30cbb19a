"""The server through the official `openai` client on a loopback port: what it answers, and how it refuses."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from engine.generation.loop import GenerationSettings, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.memory.base import FullAttentionMemory
from engine.memory.cascade.core import TAIL_STEP, TAIL_STEPS
from tests.helpers.http_clients import closed_after_test
from tests.helpers.server import KEY, Served, start_server

SYSTEM = "You are a terse assistant. The quick brown fox jumps over the lazy dog. Python is a programming language."


def client(served: Served, key: str = KEY) -> openai.OpenAI:
    return closed_after_test(openai.OpenAI(base_url=served.url, api_key=key, max_retries=0, timeout=60))


def reference(served: Served, ids: list[int], max_tokens: int) -> str:
    """The greedy reply computed alone, without the server: full attention on a fresh slot table."""
    b = served.backend.fork()
    b.allocate(1, len(ids) + max_tokens)
    s = GenerationSettings(max_tokens=max_tokens, sampling=SamplingSettings(greedy=True))
    return "".join(ev.text for ev in stream_generate(b, FullAttentionMemory(b), served.tokenizer, ids, s))


def metric(served: Served, name: str) -> float:
    text = httpx.get(served.url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_model_list_and_health(served: Served) -> None:
    assert [m.id for m in client(served).models.list().data] == ["tiny"]
    assert client(served).models.retrieve("tiny").id == "tiny"
    health = httpx.get(served.url.removesuffix("/v1") + "/health").json()  # no key needed: a liveness probe
    assert health["status"] == "ok" and health["model"] == "tiny"


def test_chat_equals_the_engine_alone_streaming_or_not(served: Served) -> None:
    messages = [{"role": "user", "content": "The quick brown fox"}]
    want = reference(served, served.tokenizer.encode_chat(messages), 12)
    whole = client(served).chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert whole.choices[0].message.content == want
    assert whole.usage is not None and whole.usage.prompt_tokens == len(served.tokenizer.encode_chat(messages))
    assert whole.usage.completion_tokens <= 12
    chunks = list(
        client(served).chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},  # type: ignore[arg-type]
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_and_stop_strings(served: Served) -> None:
    prompt = "def main():"
    want = reference(served, served.tokenizer.encode(prompt), 24)
    got = client(served).completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == want
    assert len(want) >= 6, "the tiny model's reply is too short to cut with a stop string"
    stop = want[3:5]
    cut = client(served).completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == want[: want.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client(served).completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want[: want.find(stop)]


def test_seeded_sampling_is_reproducible(served: Served) -> None:
    def sample(seed: int) -> str:
        r = client(served).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Python is"}], max_tokens=16, temperature=1.0, seed=seed
        )
        return r.choices[0].message.content or ""

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) > 1  # the seed matters


def test_logprobs(served: Served) -> None:
    r = client(served).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "fox"}], max_tokens=6, temperature=0, logprobs=True
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    assert all(e.logprob <= 0.0 for e in content)


def test_second_turn_reuses_the_first_turns_memory(served: Served) -> None:
    c = client(served)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is Python?"}]
    first = c.chat.completions.create(model="tiny", messages=turn1, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    reply = first.choices[0].message.content or ""
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And the fox?"}]
    second = c.chat.completions.create(model="tiny", messages=turn2, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    # The row kept turn 1's memory (prompt and every reply token but the last): reused as far as turn 2's ids
    # repeat it. The random model's reply is not valid UTF-8, so its text re-encodes to other ids, and the prefix
    # cache's blocks of the prompt are what matches here (tests/engine/test_scheduler.py and the real model's test
    # show the kept row continuing).
    turn1_ids = served.tokenizer.encode_chat(turn1)
    assert cached >= len(turn1_ids) // 8 * 8 > 0
    assert cached < second.usage.prompt_tokens  # type: ignore[union-attr]
    # Continued, not approximated: the reply equals one computed from scratch (all of it fits the window).
    assert second.choices[0].message.content == reference(served, served.tokenizer.encode_chat(turn2), 10)
    assert metric(served, "spark_prompt_cached_tokens_total") >= cached


def test_after_a_restart_the_prefix_cache_gives_the_memory_back(served: Served) -> None:
    c = client(served)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about the dog."}]
    first = c.chat.completions.create(model="tiny", messages=turn1, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "More."},
    ]
    restarted = start_server(served.model_dir, served.cache_dir)  # a new process's rows are empty; L3 is on disk
    try:
        second = client(restarted).chat.completions.create(model="tiny", messages=turn2, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    finally:
        restarted.server.stop()
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    fed = len(served.tokenizer.encode_chat(turn1)) + first.usage.completion_tokens - 1  # type: ignore[union-attr]
    assert cached == fed // 8 * 8  # every whole prefix block of what turn 1 fed (it all fits the window)
    assert second.choices[0].message.content == reference(served, served.tokenizer.encode_chat(turn2), 6)


def test_a_conversation_past_the_window_resumes_from_its_snapshot(served: Served) -> None:
    c = client(served)
    system = SYSTEM
    while len(served.tokenizer.encode_chat([{"role": "system", "content": system}])) < 300:
        system += " " + SYSTEM
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Summarize."}]
    n1 = len(served.tokenizer.encode_chat(turn1))
    # past sinks + window, a grid step (the window here) and the tail: a cascade snapshot, not exact blocks
    points = range(2 + 128 + 128, n1 - TAIL_STEP * TAIL_STEPS, 128)  # engine.memory.cascade.prefix
    assert points
    first = c.chat.completions.create(model="tiny", messages=turn1, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "More."},
    ]
    restarted = start_server(served.model_dir, served.cache_dir)
    try:
        second = client(restarted).chat.completions.create(model="tiny", messages=turn2, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    finally:
        restarted.server.stop()
    assert second.usage.prompt_tokens_details.cached_tokens == points[-1]  # type: ignore[union-attr]


def test_errors_have_openai_shape_and_status(served: Served) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        client(served, key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e2:  # (a request naming another model is served by this one)
        client(served).models.retrieve("gpt-9")
    assert e2.value.code == "model_not_found" and e2.value.param == "model"
    with pytest.raises(openai.APIStatusError) as e3:
        client(served).completions.create(model="tiny", prompt="fox " * 800, max_tokens=2)
    assert e3.value.status_code == 413 and e3.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e4:
        client(served).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    assert e4.value.param == "temperature"
    raw = httpx.post(
        served.url + "/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert raw.status_code == 400
    err = raw.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    huge = httpx.post(
        served.url + "/completions", content=b"x" * (9 * 1024**2), headers={"Authorization": f"Bearer {KEY}"}
    )
    assert huge.status_code == 413
    assert httpx.get(served.url + "/nothing-here").json()["error"]["message"]


def test_full_queue_is_429_with_retry_after(tiny_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import threading

    from engine.generation.scheduler import Request

    s = start_server(tiny_dir, tmp_path, max_batch=1, max_queue=1)
    gate, held = threading.Event(), threading.Event()

    def hold(ev):  # type: ignore[no-untyped-def]  # holds the scheduler thread: the row stays taken
        held.set()
        gate.wait(30)

    try:
        ids = s.tokenizer.encode("fox")
        running = s.service.scheduler.submit(Request(ids, GenerationSettings(max_tokens=2), on_event=hold))
        assert held.wait(30)
        queued = s.service.scheduler.submit(Request(ids, GenerationSettings(max_tokens=2)))  # fills the queue
        with pytest.raises(openai.RateLimitError) as e:
            client(s).completions.create(model="tiny", prompt="fox", max_tokens=2)
        assert e.value.response.headers["retry-after"] == "2"
        gate.set()
        running.result(30), queued.result(30)
        assert client(s).completions.create(model="tiny", prompt="fox", max_tokens=2).choices[0].finish_reason in (
            "stop",
            "length",
        )
    finally:
        gate.set()
        s.server.stop()


def test_a_client_that_leaves_mid_stream_frees_its_row(served: Served) -> None:
    ids = served.tokenizer.encode("The quick brown fox")
    before = metric(served, 'spark_generations_total{reason="cancelled"}')
    with httpx.stream(
        "POST",
        served.url + "/completions",
        json={"model": "tiny", "prompt": ids, "max_tokens": 4000, "ignore_eos": True, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data:"))
        assert '"text"' in first
    deadline = time.monotonic() + 60  # a bound on waiting, not a speed requirement
    while served.service.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.service.scheduler.running == 0
    while metric(served, 'spark_generations_total{reason="cancelled"}') == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(served, 'spark_generations_total{reason="cancelled"}') == before + 1
