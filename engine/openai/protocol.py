"""OpenAI request bodies in, our settings out; our results in, OpenAI response and chunk objects out.

Every body is hostile: each field is type- and range-checked here, before anything is tokenized or queued, and a
bad one is a 400 naming the field. Fields OpenAI defines that change nothing here (user, metadata, store, ...) are
ignored, as OpenAI-compatible servers do; fields whose meaning we cannot honour (n > 1, top_logprobs > 0, tools) are
refused rather than silently dropped.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine.generation.batch import Completion
from engine.generation.loop import FinishReason, GenerationSettings
from engine.generation.sampling import InvalidSamplingSettings, SamplingSettings
from engine.openai.errors import bad_request

MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # each stop string is searched in every streamed piece: keep that cheap
ROLES = ("system", "user", "assistant", "developer")


@dataclass(frozen=True)
class Limits:
    max_tokens_default: int = 512  # a request without max_tokens gets this many at most
    max_tokens_limit: int = 8192  # the most one request may ask for


@dataclass
class ParsedRequest:
    """A chat or completion request reduced to what the engine needs."""

    model: str
    messages: list[dict[str, str]] | None  # chat: role/content pairs for the chat template
    prompt: str | list[int] | None  # completions: text, or token ids
    settings: GenerationSettings
    stream: bool
    include_usage: bool
    logprobs: bool


def check_text(body: Any) -> None:
    """Every string in a parsed body, keys included, is text that UTF-8 can carry: JSON's `\\ud800` escapes decode
    to lone surrogates, which no tokenizer, log or response can encode."""
    stack = [body]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = v[exc.start : exc.start + 1].encode("unicode_escape").decode()
                raise bad_request(f"The request holds a lone surrogate ({bad}), which is not text.") from None


def _num(body: dict[str, Any], name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, int) and not isinstance(v, bool) and not -(2**53) <= v <= 2**53:
        raise bad_request(f"'{name}' must be at least {lo} and at most {hi}.", name)  # beyond any float's exactness
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"'{name}' must be a number.", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad_request(
            f"'{name}' must be {'above' if lo_open else 'at least'} {lo} and at most {hi}, not {v}.", name
        )
    return float(v)


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{name}' must be an integer.", name)
    if not lo <= v <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, not {v}.", name)
    return v


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be true or false.", name)
    return v


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops)
        or len(stops) > MAX_STOPS
    ):
        raise bad_request(
            f"'stop' must be a string or a list of at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters.",
            "stop",
        )
    return tuple(s for s in stops if s)


def _logit_bias(body: dict[str, Any]) -> None:
    """OpenAI's shape ({"token id": bias from -100 to 100}) checked, then refused when non-empty: biases change the
    reply, and this server does not apply them."""
    v = body.get("logit_bias")
    if v is None:
        return
    if not isinstance(v, dict) or not all(
        isinstance(k, str)
        and k.isascii()
        and k.isdigit()
        and len(k) <= 10
        and not isinstance(b, bool)
        and isinstance(b, (int, float))
        and -100 <= b <= 100
        for k, b in v.items()
    ):
        raise bad_request("'logit_bias' must map token ids to biases from -100 to 100.", "logit_bias")
    if v:
        raise bad_request("'logit_bias' is not supported by this server.", "logit_bias")


def _content(value: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts (images and audio are refused)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{i}].content may only hold text parts; this model reads text only.",
                    f"messages[{i}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts.", f"messages[{i}].content")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects.", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request(f"messages[{i}] needs a 'role' of {', '.join(ROLES)}.", f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m.get("content"), i)})
    return out


def _common(body: dict[str, Any], limits: Limits) -> tuple[str, GenerationSettings, bool, bool]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must name the model to use (see GET /v1/models).", "model")
    if body.get("n") not in (None, 1):
        raise bad_request("'n' must be 1; this server returns one choice per request.", "n")
    if body.get("tools"):
        raise bad_request("'tools' are not supported by this server.", "tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("Only the 'text' response_format is supported by this server.", "response_format")
    max_tokens = _int(body, "max_completion_tokens", 1, limits.max_tokens_limit)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, limits.max_tokens_limit)
    temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed = _int(body, "seed", -(2**63), 2**63 - 1)
    for name in ("presence_penalty", "frequency_penalty"):
        if _num(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad_request(f"'{name}' other than 0 is not supported by this server.", name)
    _logit_bias(body)
    sampling = SamplingSettings(temperature=temperature, top_p=top_p, seed=seed, greedy=temperature == 0.0)
    try:
        sampling.validate()  # the one check the CLI, the app and sessions share (denormal temperatures...)
    except InvalidSamplingSettings as exc:
        raise bad_request(str(exc)) from None
    # ignore_eos: vLLM's and llama.cpp's extension (benchmarks want a fixed reply length).
    settings = GenerationSettings(
        max_tokens=max_tokens or limits.max_tokens_default,
        stop=_stops(body),
        sampling=sampling,
        ignore_eos=_bool(body, "ignore_eos"),
    )
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", "stream_options")
    include_usage = _bool(options or {}, "include_usage")
    return model, settings, stream, include_usage


def parse_chat(body: Any, limits: Limits) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    model, settings, stream, include_usage = _common(body, limits)
    messages = _messages(body)
    logprobs = _bool(body, "logprobs")
    if _int(body, "top_logprobs", 0, 20):
        raise bad_request(
            "'top_logprobs' above 0 is not supported; 'logprobs' gives each chosen token's logprob.", "top_logprobs"
        )
    return ParsedRequest(model, messages, None, settings, stream, include_usage, logprobs)


def parse_completion(body: Any, limits: Limits) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    model, settings, stream, include_usage = _common(body, limits)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise bad_request("'prompt' must be a string or a list of token ids (one prompt per request).", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise bad_request(
            "'prompt' must be a non-empty string or a list of token ids (one prompt per request).", "prompt"
        )
    if body.get("echo") or body.get("suffix") or body.get("best_of") not in (None, 1):
        raise bad_request("'echo', 'suffix' and 'best_of' are not supported by this server.")
    lp = _int(body, "logprobs", 0, 5)
    if lp:
        raise bad_request("'logprobs' above 0 is not supported; 0 gives each chosen token's logprob.", "logprobs")
    return ParsedRequest(model, None, prompt, settings, stream, include_usage, lp is not None)


# -- responses ----------------------------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage(c: Completion) -> dict[str, Any]:
    n = len(c.tokens)
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": c.prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
    }


# OpenAI's finish_reason for ours. A cancelled reply only reaches a client that is still there when the server
# shuts down mid-reply: "stop" is the nearest of OpenAI's words (it has none for "cancelled").
OPENAI_FINISH_REASONS: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "stop",
}


def finish_reason(reason: FinishReason) -> str:
    """The finish_reason a response carries for `reason`."""
    return OPENAI_FINISH_REASONS[reason]


def parse_finish_reason(raw: object) -> FinishReason:
    """Ours for a finish_reason an OpenAI-compatible server sent (engine.openai.client): anything but "length" (including
    "content_filter", "tool_calls", or nothing) ends the reply as a plain stop."""
    return FinishReason.LENGTH if raw == "length" else FinishReason.STOP


def chat_logprobs(entries: list[tuple[str, float]]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []} for t, lp in entries
        ]
    }


def completion_logprobs(entries: list[tuple[str, float]], offset: int = 0) -> dict[str, Any]:
    offsets, at = [], offset
    for t, _ in entries:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": [t for t, _ in entries],
        "token_logprobs": [lp for _, lp in entries],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def chat_response(rid: str, model: str, c: Completion, logprobs: list[tuple[str, float]] | None) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
        "finish_reason": finish_reason(c.finish_reason),
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(c),
    }


def completion_response(
    rid: str, model: str, c: Completion, logprobs: list[tuple[str, float]] | None
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": c.text,
        "logprobs": completion_logprobs(logprobs) if logprobs is not None else None,
        "finish_reason": finish_reason(c.finish_reason),
    }
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(c),
    }


def chat_chunk(
    rid: str, model: str, created: int, delta: dict[str, Any], reason: str | None = None, logprobs: Any = None
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def completion_chunk(
    rid: str, model: str, created: int, text: str, reason: str | None = None, logprobs: Any = None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, obj: str, c: Completion) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(c)}
