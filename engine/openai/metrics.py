"""Server counters and histograms, rendered in Prometheus' text exposition format (version 0.0.4).

Written by hand (a few counters and histograms) rather than pulling in prometheus_client. Updated from the
event loop only, so no locks; gauges that belong to other objects (queue, rows, cache tiers) are read at render
time through the `sources` callables.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.generation.loop import FinishReason

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_BUCKETS = (1.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def render(self, name: str) -> list[str]:
        lines, running = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            running += count
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        lines += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6g}", f"{name}_count {self.n}"]
        return lines


class Metrics:
    """What `/metrics` reports: requests by endpoint and status, tokens, TTFT and decode speed, cache reuse."""

    def __init__(self, sources: dict[str, Callable[[], float]] | None = None) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.disconnects: dict[str, int] = {}  # by endpoint: clients that left before their reply ended
        self.reasons: dict[FinishReason, int] = {}  # finished generations by finish reason (cancelled: the client left)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tokens_per_s = Histogram(RATE_BUCKETS)
        # Speculation (requests that ran with a speculator): drafts verified and accepted, verify forwards, and
        # the decode forwards and the tokens after the first they gave (accepted per forward).
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.verify_forwards = 0
        self.speculative_forwards = 0
        self.speculative_tokens = 0
        # Files attached to chat requests (engine.openai.documents): their tokens, and those the model computed to
        # read them (capsules found in the persistent store cost none).
        self.document_tokens = 0
        self.document_read_tokens = 0
        self.sources = sources or {}  # gauge name -> reader (help text is the name's own description below)
        # Models loaded and unloaded by name (engine.openai.pool), and the seconds each load took.
        self.loads: dict[str, int] = {}
        self.unloads: dict[str, int] = {}
        self.load_seconds: dict[str, float] = {}

    def request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def disconnected(self, endpoint: str) -> None:
        self.disconnects[endpoint] = self.disconnects.get(endpoint, 0) + 1

    def finished(
        self,
        reason: FinishReason,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        ttft_s: float,
        tokens_per_s: float,
    ) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.completion_tokens += completion_tokens
        if completion_tokens:
            self.ttft.observe(ttft_s)
        if completion_tokens > 1:
            self.tokens_per_s.observe(tokens_per_s)

    def speculated(self, drafted: int, accepted: int, verifies: int, forwards: int, completion_tokens: int) -> None:
        """A finished request that ran with a speculator: its drafts, verifies and decode forwards."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.verify_forwards += verifies
        self.speculative_forwards += forwards
        self.speculative_tokens += max(0, completion_tokens - 1)  # the first token comes from the prompt's forward

    def documents(self, tokens: int, read_tokens: int) -> None:
        self.document_tokens += tokens
        self.document_read_tokens += read_tokens

    def model_loaded(self, model: str, seconds: float) -> None:
        self.loads[model] = self.loads.get(model, 0) + 1
        self.load_seconds[model] = self.load_seconds.get(model, 0.0) + seconds

    def model_unloaded(self, model: str) -> None:
        self.unloads[model] = self.unloads.get(model, 0) + 1

    def render(self) -> str:
        out = [
            "# HELP spark_requests_total HTTP requests answered, by endpoint and status.",
            "# TYPE spark_requests_total counter",
        ]
        for (endpoint, status), n in sorted(self.requests.items()):
            out.append(f'spark_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        out += [
            "# HELP spark_client_disconnects_total Clients that left before their reply ended, by endpoint.",
            "# TYPE spark_client_disconnects_total counter",
        ]
        for endpoint, n in sorted(self.disconnects.items()):
            out.append(f'spark_client_disconnects_total{{endpoint="{endpoint}"}} {n}')
        out += [
            "# HELP spark_generations_total Generations finished, by reason.",
            "# TYPE spark_generations_total counter",
        ]
        for reason, n in sorted(self.reasons.items()):
            out.append(f'spark_generations_total{{reason="{reason}"}} {n}')
        for name, value, text in (
            ("spark_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
            (
                "spark_prompt_cached_tokens_total",
                self.cached_tokens,
                "Prompt tokens restored from memory instead of computed.",
            ),
            ("spark_completion_tokens_total", self.completion_tokens, "Tokens generated."),
            ("spark_speculative_drafted_tokens_total", self.drafted_tokens, "Drafted tokens verified."),
            ("spark_speculative_accepted_tokens_total", self.accepted_tokens, "Drafted tokens the model accepted."),
            ("spark_speculative_verify_forwards_total", self.verify_forwards, "Forwards that verified drafts."),
            ("spark_document_tokens_total", self.document_tokens, "Tokens of the files chat requests attached."),
            (
                "spark_document_read_tokens_total",
                self.document_read_tokens,
                "Tokens the model computed to read attached files (none for a file read before).",
            ),
        ):
            out += [f"# HELP {name} {text}", f"# TYPE {name} counter", f"{name} {value}"]
        out += [
            "# HELP spark_prompt_cache_hit_ratio Share of prompt tokens restored from memory.",
            "# TYPE spark_prompt_cache_hit_ratio gauge",
        ]
        out.append(
            f"spark_prompt_cache_hit_ratio {self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0:.6g}"
        )
        per_forward = self.speculative_tokens / self.speculative_forwards if self.speculative_forwards else 0.0
        out += [
            "# HELP spark_speculative_accepted_per_forward Tokens a decode forward gave, in speculating requests.",
            "# TYPE spark_speculative_accepted_per_forward gauge",
            f"spark_speculative_accepted_per_forward {per_forward:.6g}",
        ]
        out += [
            "# HELP spark_ttft_seconds Time from arrival to the first token.",
            "# TYPE spark_ttft_seconds histogram",
        ]
        out += self.ttft.render("spark_ttft_seconds")
        out += [
            "# HELP spark_decode_tokens_per_second Decode speed per request.",
            "# TYPE spark_decode_tokens_per_second histogram",
        ]
        out += self.tokens_per_s.render("spark_decode_tokens_per_second")
        for name, values, text, kind in (
            ("spark_model_loads_total", self.loads, "Models loaded, by name.", "counter"),
            (
                "spark_model_unloads_total",
                self.unloads,
                "Models unloaded (idle, least recently used), by name.",
                "counter",
            ),
            ("spark_model_load_seconds_total", self.load_seconds, "Seconds spent loading each model.", "counter"),
        ):
            out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            out += [f'{name}{{model="{_label(model)}"}} {value:.6g}' for model, value in sorted(values.items())]
        for name, read in sorted(self.sources.items()):
            out += [f"# TYPE {name} gauge", f"{name} {read():.6g}"]
        return "\n".join(out) + "\n"


def _label(value: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
