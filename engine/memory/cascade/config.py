"""Cascade geometry and budgets, with the rule that keeps every position inside the model's trained context.

The window defaults to the whole trained context less the sinks and the retrieval slots (as far as the memory
budget allows), so a conversation that fits the model is exactly full attention and the cascade extends it.
A model folder's cascade.json overrides any setting (benchmarks force a small window with it)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from engine.errors import SparkError
from engine.memory.cascade.routing import ROUTING
from engine.model.config import ModelConfig

SLOT_MULTIPLE = 32  # Core ML state dims must be multiples of 32, so the slot table is padded to one
AUTO_WINDOW = 0
# Sized per machine (engine.hw.policy sizes the episodic one from RAM): never part of what a state depends on.
BUDGETS = ("episodic_budget_bytes", "persistent_budget_bytes")
CONFIG_FILE = "cascade.json"
MAX_SETTING = 2**50  # any size or budget; a window of that many tokens is already refused by the context fit


MAX_CONFIG_BYTES = 1 << 20


def _no_constant(name: str) -> None:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


class CascadeConfigError(SparkError):
    """A cascade.json (or an explicit geometry) is invalid."""


@dataclass(frozen=True)
class CascadeConfig:
    sink_tokens: int = 4
    window: int = AUTO_WINDOW  # AUTO_WINDOW: resolved by fit_to from the trained context and the memory budget
    block_size: int = 32  # 8 x 32 retrieval slots beat 4 x 64 at equal slots (README, bench long-ppl --window 512)
    retrieval_blocks: int = 8
    layer_blocks: int = 2  # answering, the retrieval groups that hold each layer's own picks (the rest: the consensus)
    # Retrieval gate: a block is paged in only if it outscores the window's gate_rank-th best block (0: no gate).
    gate_rank: int = 8
    # Retrieved blocks sit this many tokens before the newest (just before the window, if that is shorter): as far
    # as a long window's oldest tokens, the model hardly reads them (bench passkey at the default geometry).
    retrieval_near: int = 2048
    routing: str = "hybrid"
    reroute_every: int = 64  # while generating, re-route at least every this many tokens
    reroute_drift: int = 10  # ... and sooner when the routing query's mean cosine to the routed one drops this many %
    proxy_tokens: int = 16  # the routing query: the query summaries of this many recent tokens, averaged
    episodic_budget_bytes: int = 256 * 1024**2
    persistent_budget_bytes: int = 4 * 1024**3

    def __post_init__(self) -> None:
        for f in ("block_size", "reroute_every", "proxy_tokens"):
            if getattr(self, f) < 1:
                raise CascadeConfigError(f"The cascade setting {f} must be at least 1, not {getattr(self, f)}.")
        for f in (
            "window",
            "sink_tokens",
            "retrieval_blocks",
            "layer_blocks",
            "gate_rank",
            "retrieval_near",
            "episodic_budget_bytes",
            "persistent_budget_bytes",
        ):
            if getattr(self, f) < 0:
                raise CascadeConfigError(f"The cascade setting {f} must not be negative.")
        if not 0 <= self.reroute_drift <= 100:
            raise CascadeConfigError(
                f"The cascade setting reroute_drift is a percentage (0 to 100), not {self.reroute_drift}."
            )
        if self.routing not in ROUTING:
            raise CascadeConfigError(f"Unknown routing {self.routing!r}; choose one of {', '.join(ROUTING)}.")

    @property
    def retrieval_slots(self) -> int:
        return self.retrieval_blocks * self.block_size

    @property
    def used_slots(self) -> int:
        """Slots that ever hold a token; also 1 + the largest position ever used."""
        return self.sink_tokens + self.retrieval_slots + self.window

    @property
    def num_slots(self) -> int:
        """The slot table size: used slots padded up to a multiple of SLOT_MULTIPLE (padding is never attended)."""
        return -(-self.used_slots // SLOT_MULTIPLE) * SLOT_MULTIPLE

    def state_settings(self) -> dict[str, Any]:
        """What a memory's state depends on besides the model, its numerics and the tokens: every setting but the
        budgets. The one definition used wherever states meet: session restore (engine.memory.states), the
        layout a restored state takes (CascadeMemory.load_state) and the L3 key of cascade snapshots."""
        d = self.to_dict()
        for name in BUDGETS:
            del d[name]
        return d

    def same_state(self, other: CascadeConfig) -> bool:
        """True when a state of either memory is a state of the other (they differ at most in budgets)."""
        return self.state_settings() == other.state_settings()

    def with_budgets_of(self, other: CascadeConfig) -> CascadeConfig:
        """These settings under `other`'s budgets: a saved state's geometry on this machine."""
        return replace(self, **{name: getattr(other, name) for name in BUDGETS})

    def state_tag(self) -> str:
        """A short digest of state_settings() (for L3 keys of cascade snapshots)."""
        return hashlib.sha256(json.dumps(self.state_settings(), sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CascadeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CascadeConfigError(
                f"Unknown cascade setting {unknown[0]!r}; known settings are {', '.join(sorted(known))}."
            )
        for k, v in d.items():
            # Whole numbers only (no bool, float, Infinity or list), within MAX_SETTING: a file never sizes memory.
            ok = isinstance(v, str) if k == "routing" else type(v) is int and -MAX_SETTING <= v <= MAX_SETTING
            if not ok:
                raise CascadeConfigError(
                    f"The cascade setting {k} has a value of the wrong type or size ({str(v)[:40]})."
                )
        return cls(**d)

    def picture_blocks(self, picture_tokens: int) -> int:
        """Retrieval groups a picture of `picture_tokens` tokens needs to come back whole: its blocks, and one more
        for a picture that starts inside a block (0 for no picture)."""
        return -(-picture_tokens // self.block_size) + 1 if picture_tokens > 0 else 0

    def holds_pictures(self, picture_tokens: int) -> bool:
        """Whether a picture of `picture_tokens` tokens comes back whole (else its blocks are routed one by one);
        true without retrieval, where nothing comes back."""
        return not self.retrieval_blocks or self.retrieval_blocks >= self.picture_blocks(picture_tokens)

    def fit_to(self, max_positions: int, max_slots: int | None = None, picture_tokens: int = 0) -> CascadeConfig:
        """Resolve an automatic window and shrink the geometry so sinks + retrieval + window never exceed
        `max_positions` (nor `max_slots`, what memory allows the slot table).

        An automatic window takes every position the sinks and retrieval leave. Then the window gives way first
        (down to one block), then retrieval blocks, then the window again and the sinks: a model with a short
        trained context gets less retrieval rather than positions it never saw.

        `picture_tokens` (a vision model's largest picture): retrieval gets at least picture_blocks() groups, so a
        recalled picture comes back whole, the window giving way for them, but never below one picture (a picture
        leaves the window whole only from a window that holds it); where that does not fit, the geometry is the
        one without pictures (holds_pictures() says so). With retrieval off (0 blocks) nothing is reserved.
        """
        limit = max_positions if max_slots is None else max(1, min(max_positions, max_slots))
        plain = self._fit(limit)
        need = self.picture_blocks(picture_tokens)
        if not self.retrieval_blocks or need <= plain.retrieval_blocks:
            return plain
        wide = replace(self, retrieval_blocks=need)._fit(limit)
        if wide.retrieval_blocks >= need and wide.window >= min(plain.window, picture_tokens):
            return wide
        return plain

    def _fit(self, limit: int) -> CascadeConfig:
        """fit_to's resolution without pictures, within `limit` slots."""
        c = self
        if c.window == AUTO_WINDOW:
            c = replace(c, window=max(c.block_size, limit - c.sink_tokens - c.retrieval_slots))
        want = c.window
        if c.used_slots <= limit:
            return c
        c = replace(c, window=max(min(c.window, c.block_size), limit - c.sink_tokens - c.retrieval_slots))
        while c.used_slots > limit and c.retrieval_blocks > 0:
            c = replace(c, retrieval_blocks=c.retrieval_blocks - 1)
            c = replace(c, window=max(1, min(want, limit - c.sink_tokens - c.retrieval_slots)))
        if c.used_slots > limit:  # a tiny context: at most 1/8 of it for sinks, the window takes the rest
            sinks = min(c.sink_tokens, limit // 8)
            c = replace(c, sink_tokens=sinks, window=limit - sinks)
        return c

    @classmethod
    def for_model(
        cls,
        model_dir: str | Path | None,
        config: ModelConfig,
        max_slots: int | None = None,
        picture_tokens: int = 0,
        **overrides: Any,
    ) -> CascadeConfig:
        """Defaults, then the model folder's optional cascade.json (none for a bare GGUF file: `model_dir` None),
        then `overrides`, fitted to the model's context and to `max_slots` (the slot table the memory budget and the
        backend allow; None: no limit), with retrieval room for a picture of `picture_tokens` (fit_to)."""
        values: dict[str, Any] = {}
        path = Path(model_dir).expanduser() / CONFIG_FILE if model_dir is not None else None
        if path is not None and path.is_file():
            try:
                if path.stat().st_size > MAX_CONFIG_BYTES:
                    raise CascadeConfigError(f"{path} is larger than any cascade settings file; fix or delete it.")
                data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constant)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                raise CascadeConfigError(f"{path} is not valid JSON; fix or delete it.") from None
            if not isinstance(data, dict):
                raise CascadeConfigError(f"{path} must hold a JSON object of cascade settings.")
            values.update(data)
        values.update(overrides)
        return cls.from_dict(values).fit_to(config.max_position_embeddings, max_slots, picture_tokens)
