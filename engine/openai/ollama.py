"""Ollama's `POST /api/chat` over the same service: a thin translation to and from the OpenAI request, so clients
written for Ollama (its own Python and JavaScript libraries, editors that speak only Ollama) get replies here.

Read: `model`, `messages` (role, content, `images` — base64 pictures placed before the text — and an assistant's
`thinking`), `think` (the model's thinking on or off; Ollama's "low"/"medium"/"high" mean on), `stream` (Ollama's
default: true), `format` ("json", or a JSON schema: constrained as `response_format` is), and of `options`
`temperature`, `num_predict` (-1 or -2: the server's default budget), `top_p`, `seed`, `stop`, `repeat_penalty` (none
unless sent); other options are ignored, as Ollama ignores the ones a model does not use. The reply is one JSON
object, or newline-delimited JSON chunks (`message.content` pieces and `message.thinking` ones, then a last chunk
with `done: true`, `done_reason` and the token counts). A failure is Ollama's `{"error": message}` with its status.
"""

from __future__ import annotations

import datetime
from typing import Any

from engine.generation.batch import Completion
from engine.openai import protocol
from engine.openai.errors import bad_request
from engine.openai.pool import parse_keep_alive

OPTIONS = {
    "temperature": "temperature",
    "num_predict": "max_tokens",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
}


def openai_body(body: Any) -> dict[str, Any]:
    """An Ollama chat request as the OpenAI chat request it means (checked further by protocol.parse_chat)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list of {'role': ..., 'content': ...}.", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with 'role' and 'content'.", f"messages[{i}]")
        images = m.get("images") or []
        if not isinstance(images, list) or not all(isinstance(b, str) for b in images):
            raise bad_request(f"messages[{i}].images must be a list of base64 strings.", f"messages[{i}].images")
        content = m.get("content", "")
        if images:  # OpenAI's image_url parts, pictures before the text as Ollama places them
            parts = [{"type": "image_url", "image_url": {"url": f"data:image/*;base64,{b}"}} for b in images]
            content = [*parts, {"type": "text", "text": content}] if isinstance(content, str) else content
        msg = {"role": m.get("role"), "content": content}
        if m.get("role") == "assistant" and m.get("thinking") is not None:  # an earlier turn's thinking
            msg["reasoning_content"] = m["thinking"]
        out.append(msg)
    stream = body.get("stream", True)  # Ollama streams unless told not to
    request: dict[str, Any] = {"model": body.get("model"), "messages": out, "stream": stream}
    if body.get("think") is not None:  # Ollama's switch: true/false (its "low"/"medium"/"high" mean on)
        think = body["think"]
        request["think"] = True if think in ("low", "medium", "high") else think
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad_request("'options' must be an object.", "options")
    for ours, theirs in OPTIONS.items():
        if options.get(ours) is not None:
            request[theirs] = options[ours]
    if request.get("max_tokens") in (-1, -2):  # Ollama's "no limit" / "fill the context": our default budget
        del request["max_tokens"]
    fmt = body.get("format")
    if fmt == "json":
        request["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_request("'format' must be \"json\" or a JSON schema object.", "format")
    return request


def keep_alive(body: Any) -> float | bool | None:
    """A request's `keep_alive` (engine.openai.pool.parse_keep_alive): seconds, None to stay loaded, False unsent."""
    try:
        return parse_keep_alive(body.get("keep_alive") if isinstance(body, dict) else None)
    except ValueError:
        raise bad_request(
            "'keep_alive' must be seconds or a duration such as \"5m\" (negative: stay loaded).", "keep_alive"
        ) from None


def parse_chat(body: Any, limits: protocol.Limits) -> protocol.ParsedRequest:
    return protocol.parse_chat(openai_body(body), limits)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def message(text: str, thinking: str = "") -> dict[str, Any]:
    """The reply's message: its answer, and its reasoning as Ollama's `thinking` when it thought."""
    out = {"role": "assistant", "content": text}
    if thinking:
        out["thinking"] = thinking
    return out


def chunk(model: str, text: str, thinking: str = "") -> dict[str, Any]:
    """One streamed piece of the reply."""
    return {"model": model, "created_at": now(), "message": message(text, thinking), "done": False}


def final(model: str, c: Completion, text: str, total_ns: int, thinking: str = "") -> dict[str, Any]:
    """The last chunk of a stream (`text` ""), or the whole reply: the reason it ended and the counts."""
    decode_ns = int((len(c.tokens) - 1) / c.tokens_per_s * 1e9) if c.tokens_per_s > 0 and len(c.tokens) > 1 else 0
    return {
        "model": model,
        "created_at": now(),
        "message": message(text, thinking),
        "done": True,
        "done_reason": protocol.finish_reason(c.finish_reason),
        "total_duration": total_ns,
        "prompt_eval_count": c.prompt_tokens,
        "prompt_eval_duration": int(c.ttft_s * 1e9),
        "eval_count": len(c.tokens),
        "eval_duration": decode_ns,
    }


# -- the model routes: /api/tags, /api/ps, /api/show, and /api/generate's request ------------------------------


def model_entry(name: str, size_bytes: int) -> dict[str, Any]:
    """One model as /api/tags and /api/ps list it."""
    details = {"format": "", "family": "", "families": [], "parameter_size": "", "quantization_level": ""}
    return {"name": name, "model": name, "modified_at": now(), "size": size_bytes, "digest": "", "details": details}


def expires_at(seconds: float | None) -> str:
    """Ollama's `expires_at` for a model that unloads in `seconds` (None: it stays; Ollama writes a far date)."""
    if seconds is None:
        return "2318-01-01T00:00:00Z"
    at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
    return at.isoformat().replace("+00:00", "Z")


def show(name: str, template: str | None, capabilities: list[str], context: int) -> dict[str, Any]:
    """/api/show's reply: the chat template and what the model can do."""
    return {
        "modelfile": f"FROM {name}\n",
        "parameters": "",
        "template": template or "",
        "details": {"format": "", "family": "", "families": []},
        "model_info": {"general.name": name, "context_length": context},
        "capabilities": capabilities,
    }


def generate_body(body: Any) -> tuple[dict[str, Any], bool]:
    """An Ollama /api/generate request as (the /api/chat request it means, raw): a `system` and the `prompt` as the
    user's turn, or with `raw` the prompt as it is (an OpenAI completion)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    prompt = body.get("prompt", "")
    system = body.get("system")
    if not isinstance(prompt, str) or (system is not None and not isinstance(system, str)):
        raise bad_request("'prompt' and 'system' must be strings.", "prompt")
    if body.get("images"):
        raise bad_request("'images' are not supported; this model reads text only.", "images")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise bad_request("'raw' must be true or false.", "raw")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    chat = {k: v for k, v in body.items() if k in ("model", "stream", "options", "format", "think", "keep_alive")}
    return {**chat, "messages": messages}, raw


def generate_chunk(model: str, text: str, thinking: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "created_at": now(), "response": text, "done": False}
    if thinking:
        out["thinking"] = thinking
    return out


def generate_final(model: str, c: Completion, text: str, total_ns: int, thinking: str = "") -> dict[str, Any]:
    out = final(model, c, text, total_ns, thinking)
    message = out.pop("message")
    out["response"] = message["content"]
    if message.get("thinking"):
        out["thinking"] = message["thinking"]
    return out
