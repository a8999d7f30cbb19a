"""Requests built to break the server: every malformed or out-of-range value is a 400 (413 for size) with one
sentence, never a 500; a client that leaves is counted as a disconnect; the slot table is sized to the memory the
process may still take. Plus a hypothesis fuzz target over raw request bodies at the HTTP door."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import InsufficientMemory
from engine.openai.service import fit_rows, out_of_memory
from tests.helpers.fuzz import fuzz_examples
from tests.helpers.server import KEY, Served

AUTH = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
CHAT = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]%s}'


def post(served: Served, raw: str | bytes, path: str = "/chat/completions") -> httpx.Response:
    return httpx.post(served.url + path, content=raw, headers=AUTH, timeout=120)


def refusal(response: httpx.Response, status: int = 400) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert isinstance(message, str) and "\n" not in message and message.endswith("."), message
    return str(message)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (', "max_tokens": ' + "9" * 5000, "number too long"),
        (', "temperature": ' + "1" * 5000, "number too long"),
        (', "temperature": 1' + "0" * 400, "temperature"),
        (', "temperature": 5e-324', "temperature"),
        (', "temperature": 2.0e-310', "temperature"),
        (', "top_p": 1e-400', "top_p"),
        (', "presence_penalty": "high"', "presence_penalty"),
        (', "frequency_penalty": [1]', "frequency_penalty"),
        (', "frequency_penalty": 1.5', "frequency_penalty"),
        (', "logit_bias": "x"', "logit_bias"),
        (', "logit_bias": {"50": 1000}', "logit_bias"),
        (', "logit_bias": {"50": 5}', "not supported"),
        (', "seed": 1' + "0" * 30, "seed"),
        (', "max_tokens": 2.5', "max_tokens"),
    ],
)
def test_out_of_range_and_mistyped_values_are_400(served: Served, extra: str, words: str) -> None:
    assert words in refusal(post(served, CHAT % ('"hi"', extra)))


@pytest.mark.parametrize("text", ['"\\ud800"', '"a\\udfffb"', '[{"type": "text", "text": "\\udbff"}]'])
def test_a_lone_surrogate_is_400(served: Served, text: str) -> None:
    assert "surrogate" in refusal(post(served, CHAT % (text, "")))


def test_a_too_large_message_says_the_request_is_the_problem(served: Served) -> None:
    message = refusal(post(served, CHAT % (json.dumps("x" * 1_100_000), "")), 413)
    assert "conversation" in message and "tokenizer_config" not in message and "template" not in message


def metric(served: Served, name: str) -> float:
    text = httpx.get(served.url.removesuffix("/v1") + "/metrics", headers=AUTH).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_a_disconnect_is_counted_as_one_not_as_a_500(served: Served) -> None:
    before_gone = metric(served, "spark_client_disconnects_total")
    before_500 = metric(served, 'spark_requests_total{endpoint="completions",status="500"}')
    body = json.dumps({"model": "tiny", "prompt": "The quick", "max_tokens": 4000, "ignore_eos": True}).encode()
    host, port = served.url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port))) as s:  # a plain request, then the client hangs up mid-reply
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 60  # a bound on waiting, not a speed requirement
        while not served.service.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.02)
    while metric(served, "spark_client_disconnects_total") == before_gone and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(served, "spark_client_disconnects_total") == before_gone + 1
    assert metric(served, 'spark_requests_total{endpoint="completions",status="500"}') == before_500


def test_a_stream_left_mid_reply_is_counted_as_a_disconnect(served: Served) -> None:
    before = metric(served, 'spark_client_disconnects_total{endpoint="completions"}')
    body = {"model": "tiny", "prompt": "The quick", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served.url + "/completions", json=body, headers=AUTH, timeout=120) as r:
        next(line for line in r.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 60  # a bound on waiting, not a speed requirement
    while metric(served, 'spark_client_disconnects_total{endpoint="completions"}') == before:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_an_allocation_failure_is_told_from_other_errors() -> None:
    assert out_of_memory(MemoryError())
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"))
    assert not out_of_memory(RuntimeError("shape mismatch"))


def test_the_slot_table_takes_the_rows_that_fit_or_says_why_not() -> None:
    assert fit_rows(8, 100, 10_000) == 8
    assert fit_rows(8, 1000, 4000) == 2  # half of what may be allocated, for two rows
    with pytest.raises(InsufficientMemory) as e:
        fit_rows(8, 1 << 30, 1 << 30)
    assert "\n" not in str(e.value) and str(e.value).endswith(".")


# -- the fuzz target: raw bodies at the HTTP door ----------------------------------------------------------------

RAW = st.sampled_from(
    [
        "1" + "0" * 5000,
        "-" + "9" * 4400,
        "1e999",
        "-1e999",
        "NaN",
        "Infinity",
        "5e-324",
        "2.5",
        "-0.0",
        '"\\ud800"',
        '"\\udfff\\ud800"',
        "true",
        "null",
        "[]",
        "{}",
        '"x"',
        "[[[[[[[[[[]]]]]]]]]]",
        "1" * 30,
        '{"50": 1e9}',
        "0",
    ]
)
FIELDS = st.sampled_from(
    [
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "response_format",
        "messages",
        "model",
        "prompt",
        "ignore_eos",
        "tools",
        "user",
    ]
)


@settings(max_examples=fuzz_examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(FIELDS, RAW, max_size=4), path=st.sampled_from(["/chat/completions", "/completions"]))
def test_fuzz_request_bodies(served: Served, fields: dict[str, str], path: str) -> None:
    base = {"model": '"tiny"', "max_tokens": "2", "prompt": '"hi"', "messages": '[{"role": "user", "content": "hi"}]'}
    body = "{" + ", ".join(f'"{k}": {v}' for k, v in {**base, **fields}.items()) + "}"
    r = post(served, body, path)
    assert r.status_code != 500, r.text
    if r.status_code != 200:
        refusal(r, r.status_code)


def _deep_schema(levels: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


RECURSIVE_SCHEMAS = [
    {
        "$defs": {
            "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
            "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]},
        },
        "$ref": "#/$defs/a",
    },
    {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
]


def test_valid_json_that_is_merely_too_deep_is_said_to_be_too_deep(served: Served) -> None:
    body = CHAT % ('"hi"', ', "metadata": ' + "[" * 5000 + "]" * 5000)
    assert "nests deeper than" in refusal(post(served, body))


@pytest.mark.parametrize("schema", RECURSIVE_SCHEMAS)
def test_a_schema_no_finite_reply_can_match_is_400_on_every_door(served: Served, schema: object) -> None:
    fmt = json.dumps({"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert "cannot be satisfied" in refusal(post(served, CHAT % ('"hi"', f', "response_format": {fmt}')))
    ollama = json.dumps(
        {"model": "tiny", "stream": False, "messages": [{"role": "user", "content": "hi"}], "format": schema}
    )
    root = served.url.removesuffix("/v1")
    answer = httpx.post(root + "/api/chat", content=ollama, headers=AUTH, timeout=120)
    assert answer.status_code == 400 and "cannot be satisfied" in answer.json()["error"]  # Ollama's error shape
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    tools = f', "tools": {json.dumps([tool])}, "tool_choice": "required"'
    assert "cannot be satisfied" in refusal(post(served, CHAT % ('"hi"', tools)))


def test_a_deep_tool_schema_meets_the_depth_check(served: Served) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": _deep_schema(60)}}
    tools = f', "tools": {json.dumps([tool])}, "tool_choice": "required"'
    assert "nests deeper than" in refusal(post(served, CHAT % ('"hi"', tools)))
