"""OpenAI request bodies in, our settings out; our results in, OpenAI response and chunk objects out.

Every body is hostile: each field is type- and range-checked here, before anything is tokenized or queued, and a
bad one is a 400 naming the field. Fields OpenAI defines that change nothing here (user, metadata, store, ...) are
ignored, as OpenAI-compatible servers do; fields whose meaning we cannot honour (remote images, `echo`, `best_of`) are
refused rather than silently dropped. Tools, tool messages and `response_format` are read by engine.openai.tools (over engine.tools).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.generation.batch import Completion
from engine.generation.beam import MAX_BEAMS, BeamSettings, EarlyStopping
from engine.generation.loop import FinishReason, GenerationSettings
from engine.generation.reasoning import Think
from engine.generation.sampling import MAX_PENALTY, MIN_PENALTY, InvalidSamplingSettings, SamplingSettings
from engine.generation.speculative import Speculation
from engine.openai.errors import bad_request
from engine.openai.files import check_id
from engine.openai.tools import grammar_for, parse_response_format, parse_tools
from engine.tools.calls import ToolCall, ToolSpec, finish_with_calls

MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # each stop string is searched in every streamed piece: keep that cheap
ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_CHOICES = 8  # `n`: the choices are rows of one batch, so at most the server's batch
MAX_TOP_LOGPROBS = 20  # as OpenAI (chat); completions' `logprobs` takes at most 5


@dataclass(frozen=True)
class Limits:
    max_tokens_default: int = 512  # a request without max_tokens gets this many at most
    max_tokens_limit: int = 8192  # the most one request may ask for


@dataclass
class ParsedRequest:
    """A chat or completion request reduced to what the engine needs."""

    model: str
    messages: list[dict[str, Any]] | None  # chat: role/content (+ tool_calls, tool_call_id) for the chat template
    prompt: str | list[int] | None  # completions: text, or token ids
    settings: GenerationSettings
    stream: bool
    include_usage: bool
    logprobs: bool
    n: int = 1  # choices, each its own row with its own seed
    tools: ToolSpec | None = None
    speculative: Speculation | None = None  # the request's own "speculative" (None: the server's default decides)
    files: list[str] = field(default_factory=list)  # uploaded files' ids its user messages attach, in order


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


IMAGE_MARKER = "<image>"  # where a picture sits in a message's text (engine.vision places it)


def _content(value: Any, i: int, images: list[str] | None = None, files: list[str] | None = None) -> str:
    """A message's content: a string, or a list of text parts and, when `images` collects them, `image_url` parts
    (each becomes a marker in the text; its data: or http(s) URL is read later, off the event loop), and when
    `files` collects them, `file` parts naming an uploaded file (no text: the file joins the memory). Audio is
    refused."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        parts = []
        for part in value:
            if images is not None and isinstance(part, dict) and part.get("type") == "image_url":
                parts.append(IMAGE_MARKER)
                images.append(_image_url(part.get("image_url"), i))
                continue
            if files is not None and isinstance(part, dict) and part.get("type") == "file":
                file_id = _file_id(part.get("file"), i)
                if file_id not in files:
                    files.append(file_id)
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kinds = "text, image_url and file parts" if files is not None else "text parts"
                raise bad_request(f"messages[{i}].content may only hold {kinds}.", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts.", f"messages[{i}].content")


def _file_id(value: Any, i: int) -> str:
    """A file part's uploaded file: its `file_id` (404 when it cannot be one of ours); inline `file_data` is refused."""
    field = f"messages[{i}].content"
    file_id = value.get("file_id") if isinstance(value, dict) else None
    if not isinstance(file_id, str):
        raise bad_request(
            f"{field} has a file part without a 'file_id'; upload the file with POST /v1/files and send its id.", field
        )
    return check_id(file_id)


def _image_url(value: Any, i: int) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    field = f"messages[{i}].content"
    if not isinstance(url, str):
        raise bad_request(f"{field} has an image_url part without a 'url' string.", field)
    if not url.startswith(("data:", "http://", "https://")):
        raise bad_request(f"{field} has an image URL that is neither data: nor http(s).", field)
    return url  # a remote one is fetched only where the server allows it (engine.openai.service)


def _tool_calls(value: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`: [{id, type: function, function: {name, arguments: JSON object text}}]."""
    field = f"messages[{i}].tool_calls"
    if not isinstance(value, list) or not value:
        raise bad_request(f"{field} must be a non-empty list of function calls.", field)
    calls = []
    for c in value:
        fn = c.get("function") if isinstance(c, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        parsed = None
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                parsed = None
        if not isinstance(name, str) or not name or not isinstance(parsed, dict):
            raise bad_request(
                f"Each of {field} needs a function 'name' and 'arguments' holding a JSON object as text.", field
            )
        call_id = c.get("id") if isinstance(c.get("id"), str) else ""
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    return calls


def _messages(body: dict[str, Any], files: list[str] | None = None) -> list[dict[str, Any]]:
    """The messages for the chat template; `files` collects the ids of the files user messages attach."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects.", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request(f"messages[{i}] needs a 'role' of {', '.join(ROLES)}.", f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        images: list[str] = []
        user = role == "user"
        msg: dict[str, Any] = {
            "role": role,
            "content": _content(m.get("content"), i, images if user else None, files if user else None),
        }
        if images:
            msg["images"] = images  # data URLs, decoded by the service (engine.vision.images)
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "assistant" and m.get("reasoning_content") is not None:  # llama.cpp's and vLLM's field
            if not isinstance(m["reasoning_content"], str):
                raise bad_request(
                    f"messages[{i}].reasoning_content must be a string.", f"messages[{i}].reasoning_content"
                )
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_request(
                    f"messages[{i}] is a tool result and needs the 'tool_call_id' it answers.",
                    f"messages[{i}].tool_call_id",
                )
            msg["tool_call_id"] = call_id
        out.append(msg)
    return out


def _common(body: dict[str, Any], limits: Limits) -> tuple[str, GenerationSettings, bool, bool]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must name the model to use (see GET /v1/models).", "model")
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
    # vLLM's extension; none unless the request sends one, so temperature 0 is the argmax of the model's logits.
    penalty = _num(body, "repetition_penalty", 1.0, MIN_PENALTY, MAX_PENALTY)
    sampling = SamplingSettings(
        temperature=temperature, top_p=top_p, seed=seed, greedy=temperature == 0.0, repetition_penalty=penalty
    )
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
        grammar=parse_response_format(body),
    )
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", "stream_options")
    include_usage = _bool(options or {}, "include_usage")
    return model, settings, stream, include_usage


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _think(body: dict[str, Any]) -> Think:
    """The thinking a chat request asks for, for a model that reasons: OpenAI's `reasoning_effort` ("none": off,
    any other effort: on; the model has no finer dial), vLLM's `chat_template_kwargs.enable_thinking`, or our
    `think` (true/false, as Ollama's); none of them: the model's default."""
    effort = body.get("reasoning_effort")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    flags = [("think", body.get("think")), ("chat_template_kwargs", (kwargs or {}).get("enable_thinking"))]
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}.", "reasoning_effort")
        flags.append(("reasoning_effort", effort != "none"))
    asked = {name: v for name, v in flags if v is not None}
    for name, v in asked.items():
        if not isinstance(v, bool):
            raise bad_request(f"'{name}' must turn thinking on or off with true or false.", name)
    if len(set(asked.values())) > 1:
        raise bad_request("The request asks for thinking both on and off; send one switch.", next(iter(asked)))
    if not asked:
        return Think.AUTO
    return Think.ON if next(iter(asked.values())) else Think.OFF


def parse_chat(body: Any, limits: Limits) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    model, settings, stream, include_usage = _common(body, limits)
    settings.think = _think(body)
    files: list[str] = []
    messages = _messages(body, files)
    logprobs = _bool(body, "logprobs")
    settings.top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if settings.top_logprobs and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    tools = parse_tools(body)
    if tools is not None and tools.active:
        if settings.grammar is not None:
            raise bad_request("Give either 'tools' or a JSON 'response_format' in one request, not both.", "tools")
        settings.grammar = grammar_for(tools)
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    settings.beam = _beam(body, settings, n)
    spec = _speculative(body, settings)
    return ParsedRequest(model, messages, None, settings, stream, include_usage, logprobs, n, tools, spec, files)


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
    settings.top_logprobs = lp or 0
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    settings.beam = _beam(body, settings, n)
    spec = _speculative(body, settings)
    return ParsedRequest(model, None, prompt, settings, stream, include_usage, lp is not None, n, speculative=spec)


EARLY_STOPPING = {False: EarlyStopping.HEURISTIC, True: EarlyStopping.DONE, "never": EarlyStopping.NEVER}


def _beam(body: dict[str, Any], settings: GenerationSettings, n: int) -> BeamSettings:
    """Beam search (`beam_width` > 1, with vLLM's `length_penalty` and `early_stopping`): its `n` best beams are the
    choices. Deterministic, so sampling fields do not apply; not under a grammar (tools, a JSON response_format)."""
    width = _int(body, "beam_width", 1, MAX_BEAMS) or 1
    if width == 1:
        return BeamSettings()
    if n > width:
        raise bad_request(f"'n' ({n}) must be at most 'beam_width' ({width}): the choices are the best beams.", "n")
    if settings.grammar is not None:
        raise bad_request("'beam_width' does not combine with tools or a JSON 'response_format'.", "beam_width")
    if settings.top_logprobs:
        raise bad_request("'beam_width' does not combine with 'top_logprobs'.", "beam_width")
    early = body.get("early_stopping", False)
    if not any(early is k for k in EARLY_STOPPING if isinstance(k, bool)) and early != "never":
        raise bad_request("'early_stopping' must be true, false or \"never\".", "early_stopping")
    penalty = _num(body, "length_penalty", 0.0, -10.0, 10.0)
    return BeamSettings(width, penalty, EARLY_STOPPING[early], returned=n)


def _speculative(body: dict[str, Any], settings: GenerationSettings) -> Speculation | None:
    """Our extension `"speculative"`: "auto", "off", "lookup" or "draft" (engine.generation.speculative); None when
    not sent. Refused where it cannot combine: a beam search, a grammar (tools, a JSON response_format) and top
    logprobs follow each token, which a verify of several drafts does not."""
    raw = body.get("speculative")
    if raw is None:
        return None
    modes = [m.value for m in Speculation]
    if not isinstance(raw, str) or raw not in modes:
        raise bad_request("'speculative' must be one of " + ", ".join(f'"{m}"' for m in modes) + ".", "speculative")
    mode = Speculation(raw)
    if mode is not Speculation.OFF:
        if settings.beam.beams > 1:
            raise bad_request("'speculative' does not combine with 'beam_width'; send one of them.", "speculative")
        if settings.grammar is not None:
            raise bad_request(
                "'speculative' does not combine with tools or a JSON 'response_format'; send one of them.",
                "speculative",
            )
        if settings.top_logprobs:
            raise bad_request("'speculative' does not combine with top logprobs; send one of them.", "speculative")
    settings.speculative = mode
    return mode


# -- responses ----------------------------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage(cs: list[Completion]) -> dict[str, Any]:
    """Usage of one request's choices: the prompt once (every choice reads the same one), the replies summed."""
    n = sum(len(c.tokens) for c in cs)
    out: dict[str, Any] = {
        "prompt_tokens": cs[0].prompt_tokens,
        "completion_tokens": n,
        "total_tokens": cs[0].prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": cs[0].cached_tokens},
    }
    if any(c.speculated for c in cs):  # our extension: what speculation gave (tokens per decode forward)
        forwards = sum(c.forwards for c in cs)
        out["drafted_tokens"] = sum(c.drafted_tokens for c in cs)
        out["accepted_tokens"] = sum(c.accepted_tokens for c in cs)
        out["verify_forwards"] = sum(c.verify_forwards for c in cs)
        out["accepted_per_forward"] = round(sum(len(c.tokens) - 1 for c in cs) / forwards, 3) if forwards else 0.0
    return out


# OpenAI's finish_reason for ours. A cancelled reply only reaches a client that is still there when the server
# shuts down mid-reply: "stop" is the nearest of OpenAI's words (it has none for "cancelled").
OPENAI_FINISH_REASONS: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "stop",
    FinishReason.TOOL_CALLS: "tool_calls",
}


def finish_reason(reason: FinishReason, calls: bool = False) -> str:
    """The finish_reason a choice carries for `reason` ("tool_calls" when the reply ended in tool calls)."""
    return OPENAI_FINISH_REASONS[finish_with_calls(reason, calls)]


def parse_finish_reason(raw: object) -> FinishReason:
    """Ours for a finish_reason an OpenAI-compatible server sent (engine.openai.client): anything but "length" (including
    "content_filter", "tool_calls", or nothing) ends the reply as a plain stop (the client offers no tools)."""
    return FinishReason.LENGTH if raw == "length" else FinishReason.STOP


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and, when asked, the most likely alternatives at that step."""

    text: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    def item(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.text, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries] if any(e.top for e in entries) else None,
        "text_offset": offsets,
    }


def chat_message(content: str, calls: list[ToolCall], reasoning: str = "") -> dict[str, Any]:
    """The assistant message of a reply: its text, its reasoning (`reasoning_content`, as llama.cpp and vLLM return
    it) when it thought, and its tool calls when it made any (then content may be null)."""
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        out["reasoning_content"] = reasoning
    if calls:
        out["content"] = content or None
        out["tool_calls"] = [c.as_openai() for c in calls]
    return out


def chat_choice(
    index: int, c: Completion, logprobs: list[TokenLogprob] | None, content: str, calls: list[ToolCall]
) -> dict[str, Any]:
    return {
        "index": index,
        "message": chat_message(content, calls, c.reasoning),
        "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
        "finish_reason": finish_reason(c.finish_reason, bool(calls)),
    }


def completion_choice(index: int, c: Completion, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
    return {
        "index": index,
        "text": c.text,
        "logprobs": completion_logprobs(logprobs) if logprobs is not None else None,
        "finish_reason": finish_reason(c.finish_reason),
    }


def chat_response(rid: str, model: str, choices: list[dict[str, Any]], cs: list[Completion]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(cs),
    }


def completion_response(rid: str, model: str, choices: list[dict[str, Any]], cs: list[Completion]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(cs),
    }


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    reason: str | None = None,
    logprobs: Any = None,
    index: int = 0,
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def completion_chunk(
    rid: str, model: str, created: int, text: str, reason: str | None = None, logprobs: Any = None, index: int = 0
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, obj: str, cs: list[Completion]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(cs)}
