"""Chat templates rendered exactly the way transformers renders them, without importing transformers.

A model's `chat_template` (Jinja, from `tokenizer_config.json` or `chat_template.jinja`) is untrusted code from
the internet, so it runs in Jinja's immutable sandbox with the same options, globals and filters transformers
gives it (`trim_blocks`, `lstrip_blocks`, `loopcontrols`, `raise_exception`, `strftime_now`, a `tojson` that does
not HTML-escape, an underscore-safe `namespace`, and a no-op `{% generation %}` tag). Matching transformers
byte for byte matters: the model was fine-tuned on exactly that text.

`template=None` (a model without a chat template, e.g. a base model) uses `FALLBACK_TEMPLATE`, a plain transcript:

    {bos_token}System: ...\\n\\nUser: ...\\n\\nAssistant: ...\\n\\nAssistant:

Each message is "Role: content" followed by a blank line; with `add_generation_prompt` it ends in "Assistant:"
(no trailing space, because BPE vocabularies carry the space on the next word's token).

Rendering is bounded (engine.loading.template_limits): a time limit, an output size limit, and a size limit on every
value the template builds; past one, one sentence says which, and nothing is sent to the model.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InputTooLarge, TokenizerError
from engine.loading.template_limits import (
    MAX_INPUT_CHARS,
    MAX_RENDER_CHARS,
    MAX_TEMPLATE_CHARS,
    Deadline,
    RenderLimits,
    TemplateLimitExceeded,
    bounded_call,
    check_args,
    check_result,
)

FALLBACK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)

# transformers appends this to the final message to find where it ends after rendering (`continue_final_message`).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension declares `tags` an instance attribute; it is only read

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so a template cannot reach interpreter internals through it."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as Jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, check_result(value, MAX_RENDER_CHARS))

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store the attribute {name!r} on a namespace"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own `tojson` HTML-escapes `<`, `>`, `&` and `'`, which would change the prompt; transformers' does not.
    _check_json_size(x, MAX_RENDER_CHARS)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _check_json_size(x: Any, limit: int) -> None:
    """Refuse a value whose JSON would pass `limit` characters before encoding it: a list holding the same list
    twice, sixty levels deep, is a few bytes in memory and 2^60 items as text. Shared values are sized once."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(v: Any, depth: int) -> int:
        if isinstance(v, str):
            return len(v) + 2
        if not isinstance(v, (list, tuple, dict)):
            return len(str(v)) if isinstance(v, (int, float)) else 4
        key = id(v)
        if key in sizes:
            return sizes[key]
        if key in active or depth > 200:
            raise TemplateLimitExceeded("it asked tojson for a value nested without end")
        active.add(key)
        total = 2
        for item in v.items() if isinstance(v, dict) else v:
            total += (
                (size(item[0], depth + 1) + size(item[1], depth + 1) + 4)
                if isinstance(v, dict)
                else size(item, depth + 1) + 2
            )
            if total > limit:
                raise TemplateLimitExceeded(f"it asked tojson for a text of over {limit:,} characters")
        active.discard(key)
        sizes[key] = total
        return total

    size(x, 0)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


DEFAULT_LIMITS = RenderLimits()
MAX_LIPSUM_PARAGRAPHS = 100
MAX_EXPONENT = 4096  # `**`: a power beyond this is no prompt, only a way to burn CPU
MAX_INT_BITS = 1 << 20


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every call and size-changing operator checked against the output limit."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        check_args(args, kwargs, MAX_RENDER_CHARS)
        return check_result(super().call(context, obj, *args, **kwargs), MAX_RENDER_CHARS)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        limit = MAX_RENDER_CHARS
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise TemplateLimitExceeded(f"it raised a number to the power {right}")
        if operator == "*":
            sized, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(sized, (str, list, tuple)) and isinstance(count, int) and len(sized) * count > limit:
                raise TemplateLimitExceeded(f"it repeated a value {count} times, over the {limit:,} limit")
            if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitExceeded("it multiplied numbers too large for a prompt")
        if operator == "%" and isinstance(left, str):
            check_args(right if isinstance(right, tuple) else (right,), {}, limit)
        return check_result(super().call_binop(context, operator, left, right), limit)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    if not (0 <= n <= MAX_LIPSUM_PARAGRAPHS and 0 <= min <= max <= 1000):
        raise TemplateLimitExceeded(f"it asked lipsum for {n} paragraphs of up to {max} words")
    return str(jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max))


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: bounded_call(f, MAX_RENDER_CHARS) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    env.globals["lipsum"] = _lipsum
    return env


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """Parse a chat template once; a session renders the same template for every turn."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TokenizerError(
            f"The model's chat template is {len(template):,} characters long, over the {MAX_TEMPLATE_CHARS:,} a chat template may have."
        )
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(
            f"The model's chat template is not valid Jinja (line {exc.lineno}: {_clause(exc.message)}); "
            "fix the model's chat template."
        ) from None
    except (RecursionError, MemoryError, SyntaxError):  # nesting deeper than Jinja's parser or Python's compiler
        raise TokenizerError("The model's chat template nests its blocks too deeply to be compiled.") from None


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    bos_token: str = "",
    eos_token: str = "",
    continue_final_message: bool = False,
    limits: RenderLimits = DEFAULT_LIMITS,
    **extra: Any,
) -> str:
    """Render `messages` ({"role", "content", ...} dicts) into the prompt text the model expects.

    Like transformers: message keys whose value is None are dropped (templates handle a missing key better than
    a None), `tools` and `documents` are passed as None unless given in `extra`, and `continue_final_message`
    leaves the last message open (no end-of-turn text) so the model extends it.
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    size = sum(len(m["content"]) for m in chat if isinstance(m.get("content"), str))
    if size > MAX_INPUT_CHARS:
        raise InputTooLarge(
            f"The conversation holds {size:,} characters, more than the {MAX_INPUT_CHARS:,} a prompt may have; shorten it."
        )
    final = ""
    if continue_final_message:
        if not chat or not isinstance(chat[-1].get("content"), str):
            raise TokenizerError("There is no final message with text content to continue.")
        final = chat[-1]["content"]
        chat[-1]["content"] = final + _CONTINUE_TAG
    compiled = compile_template(template if template is not None else FALLBACK_TEMPLATE)
    context = {"tools": None, "documents": None, **extra}
    try:
        text = _render_bounded(
            compiled,
            limits,
            messages=chat,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **context,
        )
    except TemplateLimitExceeded as exc:
        raise TokenizerError(
            f"The model's chat template was stopped because {exc}; the template, not the conversation, is at fault."
        ) from None
    except jinja2.TemplateError as exc:  # includes the template's own raise_exception(...) and sandbox refusals
        raise TokenizerError(
            f"The model's chat template rejected the conversation: {_clause(exc.message or str(exc))}."
        ) from None
    except Exception as exc:  # the template is third-party code; any failure in it is a template problem, not ours
        raise TokenizerError(
            f"The model's chat template failed ({exc.__class__.__name__}: {_clause(str(exc))})."
        ) from None
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise TokenizerError(
                "The model's chat template drops part of the final message, so it cannot be continued."
            )
        loc = text.rindex(tag)
        # The template kept the tag's trailing space: the message text is intact. Otherwise it trimmed whitespace.
        text = text[:loc] if text[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:loc].rstrip()
    return text


def _render_bounded(compiled: jinja2.Template, limits: RenderLimits, **context: Any) -> str:
    """Render as a stream, counting, under the deadline: stops at the limit instead of after the whole output."""
    parts: list[str] = []
    total = 0
    with Deadline(limits):
        for part in compiled.generate(**context):
            total += len(part)
            if total > limits.max_chars:
                raise TemplateLimitExceeded(f"its output passed {limits.max_chars:,} characters")
            parts.append(part)
    return "".join(parts)


def _clause(message: str | None) -> str:
    """An error message as a clause inside our one sentence: one line, bounded, no trailing period."""
    flat = " ".join((message or "unknown error").split())
    return (flat[:200] + "…" if len(flat) > 200 else flat).rstrip(".")
