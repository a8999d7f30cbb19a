"""Latency profiler: where each millisecond of a generation step goes.

A step is one pass of the generate loop, from resuming the generator to its next event: memory paging
(`Memory.reuse_prefix` / `plan` / `after_forward`), the backend call (embedding, each layer's attention and MLP,
final norm + LM head, and the backend's own overhead: rope lookup, transfers, dtype casts), sampling and
detokenizing. Spans nest; each part is a span's *exclusive* time (its duration minus its children's), so the parts
of a step add up to the step exactly except for loop glue no span covers (event construction, stop-string check).
`sum_error` = |sum of parts − total| ÷ total is that uncovered share, measured, not forced to zero.

Off by default and zero cost when off: nothing in engine.generation.loop knows about it. `Profiler.stream_generate` runs
the ordinary generate loop over thin wrappers of the backend, memory, sampler and tokenizer, and registers torch
forward hooks on the model only for the duration of the profiled run (removed when the generator ends).
Module boundaries are taken from pre-hooks on the norms, so a layer's attention part is input norm + attention +
residual add and its MLP part is post-attention norm + MLP + residual add: contiguous, nothing falls between.
A decoding step on the native CPU kernels (engine.backends.native) runs all layers and the head in one call: `native_step`.
On a GPU pass `sync=torch.cuda.synchronize` so spans measure the kernels, not their launch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.backends.base import Backend, BackendWrapper
from engine.generation.loop import GenerationEvent, GenerationSettings, stream_generate
from engine.generation.sampling import make_sampler
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import Memory
from engine.model.slots import SlotBatch

PART_NAMES = {"backend": "backend_overhead"}  # a span whose exclusive time has a clearer name as a part


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # time.perf_counter() seconds
    duration: float
    exclusive: float  # duration minus the durations of its direct children
    depth: int  # 0 for a step
    step: int  # index of the step it belongs to


def _category(part: str) -> str:
    """layer.3.attention -> attention; other parts are their own category."""
    return part.rsplit(".", 1)[1] if part.startswith("layer.") else part


@dataclass
class Breakdown:
    """Parts of every step of one kind, summed over those steps (seconds)."""

    kind: str
    steps: int
    total_s: float
    parts: dict[str, float]

    @property
    def sum_error(self) -> float:
        return abs(sum(self.parts.values()) - self.total_s) / self.total_s if self.total_s > 0 else 0.0

    def categories(self) -> dict[str, float]:
        """Parts rolled up across layers: embedding, attention, mlp, lm_head, paging, backend_overhead, ..."""
        out: dict[str, float] = {}
        for name, s in self.parts.items():
            out[_category(name)] = out.get(_category(name), 0.0) + s
        return out

    def bottlenecks(self, n: int = 3, *, by_category: bool = True) -> list[tuple[str, float]]:
        """The n slowest (name, seconds), slowest first."""
        items = self.categories() if by_category else self.parts
        return sorted(items.items(), key=lambda kv: kv[1], reverse=True)[:n]

    def as_dict(self) -> dict[str, Any]:
        per = 1000.0 / max(1, self.steps)
        return {
            "kind": self.kind,
            "steps": self.steps,
            "total_ms_per_step": self.total_s * per,
            "parts_ms_per_step": {k: v * per for k, v in self.parts.items()},
            "categories_ms_per_step": {k: v * per for k, v in self.categories().items()},
            "sum_error": self.sum_error,
            "slowest": self.bottlenecks(1)[0][0] if self.parts else None,
        }


class Profiler:
    """Collects nested spans; see the module doc. Not thread-safe: one profiled generation at a time."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.spans: list[Span] = []
        self._stack: list[list[Any]] = []  # [name, start, children's total duration]
        self._steps = 0
        self._module_open = False
        self._sync = sync

    # -- spans -------------------------------------------------------------------------------------------------
    def push(self, name: str) -> None:
        if self._sync is not None:
            self._sync()
        self._stack.append([name, time.perf_counter(), 0.0])

    def pop(self) -> None:
        if self._sync is not None:
            self._sync()
        end = time.perf_counter()
        name, start, children = self._stack.pop()
        duration = end - start
        if self._stack:
            self._stack[-1][2] += duration
        self.spans.append(Span(name, start, duration, duration - children, len(self._stack), self._steps))

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        self.push(name)
        try:
            yield
        finally:
            self.pop()

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.span(name):
                return fn(*args, **kwargs)

        return run

    # -- model hooks -------------------------------------------------------------------------------------------
    def _open_module(self, name: str) -> None:
        if not self._stack:
            return  # a forward outside a profiled step
        if self._module_open:
            self.pop()
        self.push(name)
        self._module_open = True

    def _close_module(self) -> None:
        if self._module_open:
            self.pop()
            self._module_open = False

    @contextmanager
    def _native_step(self) -> Iterator[None]:
        self._open_module("native_step")
        try:
            yield
        finally:
            self._close_module()

    @contextmanager
    def attach(self, backend: Backend) -> Iterator[None]:
        """Time the parts of the backend's forwards for the duration of the block (the backend reports them through
        `Backend.timed_parts`; one whose forward is opaque is one part)."""
        try:
            with backend.timed_parts(self):
                yield
        finally:
            self._module_open = False

    def open_part(self, name: str) -> None:
        self._open_module(name)

    def close_part(self) -> None:
        self._close_module()

    def native_step(self) -> AbstractContextManager[object]:
        return self._native_step()

    # -- profiled generation -----------------------------------------------------------------------------------
    def stream_generate(
        self,
        backend: Backend,
        memory: Memory,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        settings: GenerationSettings,
        **kwargs: Any,
    ) -> Iterator[GenerationEvent]:
        """`engine.generation.loop.stream_generate`, same arguments and events, with every step profiled."""
        sampler = kwargs.pop("sampler", None) or make_sampler(settings.sampling)
        gen = stream_generate(
            _TimedBackend(backend, self),
            _Timed(memory, self, {"plan": "paging", "after_forward": "paging", "reuse_prefix": "paging"}),
            _ProfiledTokenizer(tokenizer, self),  # type: ignore[arg-type]  # a timing proxy, as above
            prompt_ids,
            settings,
            sampler=self.timed("sampling", sampler),
            **kwargs,
        )
        kind = "prefill_step"
        with self.attach(backend):
            while True:
                self.push(kind)
                try:
                    event = next(gen)
                except StopIteration:
                    self._stack.pop()  # the generator's return after its final event is not a step
                    return
                self.pop()
                self._steps += 1
                yield event  # the consumer's time between events belongs to no step
                kind = "decode_step"

    # -- results -----------------------------------------------------------------------------------------------
    def breakdown(self, kind: str = "decode") -> Breakdown:
        """The parts of all `kind` ("prefill" | "decode") steps."""
        root = f"{kind}_step"
        steps = {s.step for s in self.spans if s.depth == 0 and s.name == root}
        total = sum(s.duration for s in self.spans if s.depth == 0 and s.name == root)
        parts: dict[str, float] = {}
        for s in self.spans:
            if s.depth > 0 and s.step in steps:
                name = PART_NAMES.get(s.name, s.name)
                parts[name] = parts.get(name, 0.0) + s.exclusive
        return Breakdown(kind, len(steps), total, parts)

    def bottlenecks(self, n: int = 3, kind: str = "decode") -> list[tuple[str, float]]:
        """The n slowest categories of `kind` steps, (name, seconds summed over steps), slowest first."""
        return self.breakdown(kind).bottlenecks(n)

    def chrome_trace(self) -> dict[str, Any]:
        """The spans as Chrome trace events (chrome://tracing, Perfetto): complete ("X") events in microseconds."""
        origin = min((s.start for s in self.spans), default=0.0)
        events = [
            {
                "name": s.name,
                "cat": "step" if s.depth == 0 else _category(PART_NAMES.get(s.name, s.name)),
                "ph": "X",
                "ts": (s.start - origin) * 1e6,
                "dur": s.duration * 1e6,
                "pid": 1,
                "tid": 1,
                "args": {"exclusive_us": s.exclusive * 1e6, "step": s.step},
            }
            for s in sorted(self.spans, key=lambda s: (s.start, -s.duration))
        ]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def export_chrome_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.chrome_trace()))
        return path


class _TimedBackend(BackendWrapper):
    """The backend with every forward inside the profiler's "backend" span."""

    def __init__(self, inner: Backend, profiler: Profiler) -> None:
        super().__init__(inner)
        self._profiler = profiler

    def forward(
        self,
        tokens: torch.Tensor,
        batch: SlotBatch,
        last_only: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        with self._profiler.span("backend"):
            return self.inner.forward(tokens, batch, last_only, should_stop)


class _Timed:
    """Forwards every attribute to `inner`; the listed methods run inside a span of the given name."""

    def __init__(self, inner: Any, profiler: Profiler, methods: dict[str, str]) -> None:
        self._inner = inner
        for method, span in methods.items():
            setattr(self, method, profiler.timed(span, getattr(inner, method)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _ProfiledTokenizer:
    """A tokenizer whose stream decoders time `add` and `flush` as detokenizing."""

    def __init__(self, inner: Tokenizer, profiler: Profiler) -> None:
        self._inner, self._profiler = inner, profiler

    def stream_decoder(self, *args: Any, **kwargs: Any) -> _Timed:
        return _Timed(
            self._inner.stream_decoder(*args, **kwargs), self._profiler, {"add": "detokenize", "flush": "detokenize"}
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def cuda_sync_for(backend: Backend) -> Callable[[], None] | None:
    """The sync a profiler needs on this backend's device (None on the CPU, where ops are synchronous)."""
    device = getattr(backend, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.cuda.synchronize
    if isinstance(device, torch.device) and device.type == "mps":
        return torch.mps.synchronize
    return None
