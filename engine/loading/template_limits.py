"""Limits on rendering an untrusted chat template: time, output size, and the size of any value it builds.

Jinja's immutable sandbox stops a template from reaching the interpreter, but not from looping or building huge
strings (nested `range` loops, a doubling `~` loop, `'x' * n`, `lipsum(n=...)`, `center(n)`). Three guards:

- `Deadline`: a per-thread trace function over the template's own frames (compiled templates are Python code);
  every line checks the clock and the size of the frame's string/list locals, so a loop that runs long or grows a
  value is stopped at its next line;
- `check_args` / `check_result`: every call, filter and operator the template makes is refused when an integer
  argument or its result exceeds the output limit (so the allocation never happens, or is dropped at once);
- the output is produced as a stream and counted (engine.loading.chat_template).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Self

MAX_RENDER_CHARS = 4_000_000  # 4x the largest prompt accepted (engine.session.engine.MAX_PROMPT_CHARS)
MAX_INPUT_CHARS = MAX_RENDER_CHARS // 4  # the conversation itself (engine.session.engine.MAX_PROMPT_CHARS)
MAX_TEMPLATE_CHARS = 1 << 17  # real chat templates are a few kB; tool-calling ones up to ~30 kB
MAX_RENDER_SECONDS = 5.0  # real templates render in milliseconds
TEMPLATE_FILENAME = "<template>"  # what Jinja names the code of a template compiled from a string


class TemplateLimitExceeded(Exception):
    """The template ran past a limit; `str()` is a clause for the user's sentence."""


@dataclass(frozen=True)
class RenderLimits:
    max_chars: int = MAX_RENDER_CHARS
    max_seconds: float = MAX_RENDER_SECONDS


def _too_big(value: Any, limit: int) -> bool:
    return isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > limit


def check_args(args: tuple[object, ...], kwargs: dict[str, object], limit: int) -> None:
    """Refuse an integer argument beyond the limit (a width, a count, a repeat) before the call allocates."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limit:
            raise TemplateLimitExceeded(f"it asked for a size of {a}, over the {limit:,} limit")


def check_result(value: Any, limit: int) -> Any:
    if _too_big(value, limit):
        raise TemplateLimitExceeded(f"it built a value of {len(value):,} items, over the {limit:,} limit")
    return value


def bounded_call(fn: Callable[..., Any], limit: int) -> Callable[..., Any]:
    """`fn` (a filter or global) with its integer arguments and its result checked; Jinja's pass-arg marker kept."""

    def call(*args: Any, **kwargs: Any) -> Any:
        check_args(args, kwargs, limit)
        return check_result(fn(*args, **kwargs), limit)

    call.__dict__.update(getattr(fn, "__dict__", {}))  # jinja_pass_arg (environment/context/eval-context filters)
    call.__name__ = getattr(fn, "__name__", "filter")
    return call


class Deadline:
    """While active (a context manager, on the current thread only): stop the template's frames at the next line
    once `max_seconds` have passed or one of their locals has grown past `max_chars`."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.end = 0.0
        self.previous: Any = None

    def __enter__(self) -> Self:
        self.end = time.monotonic() + self.limits.max_seconds
        self.previous = sys.gettrace()
        sys.settrace(self._on_call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.previous)

    def _on_call(self, frame: FrameType, event: str, arg: Any) -> Any:
        self._check_clock()
        return self._on_line if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    def _on_line(self, frame: FrameType, event: str, arg: Any) -> Any:
        self._check_clock()
        limit = self.limits.max_chars
        for value in frame.f_locals.values():
            if _too_big(value, limit):
                raise TemplateLimitExceeded(f"it built a value of {len(value):,} items, over the {limit:,} limit")
        return self._on_line

    def _check_clock(self) -> None:
        if time.monotonic() > self.end:
            raise TemplateLimitExceeded(f"it ran for more than {self.limits.max_seconds:g} seconds")
