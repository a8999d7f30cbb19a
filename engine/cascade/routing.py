"""Routing strategies: when to re-score episodic blocks, and what stands in for the query when doing so.

The backend protocol exposes keys, not queries, so the query proxy is the mean of some *keys* (unrotated,
(L, Hkv, D)): keys of a token and the queries it issues come from the same hidden state, and tokens that are about
the same thing have similar keys — the same bet InfLLM's representative keys make. Each strategy is a small class
in an explicit registry; the memory asks it once per plan and pages blocks in only when the selection changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class RouteContext:
    """What a strategy may look at before a forward of `new_tokens` tokens."""

    prefill: bool  # a multi-token plan (part of a prompt) rather than one decode step
    tokens_since_route: int  # tokens fed since the last routing decision
    reroute_every: int
    proxy_tokens: int
    prompt_query: Callable[[], torch.Tensor | None]  # mean key of the current prompt so far, (L, Hkv, D)
    recent_query: Callable[[int], torch.Tensor | None]  # mean key of the n most recent tokens, (L, Hkv, D)


class RoutingStrategy:
    name: ClassVar[str]
    uses_prompt: ClassVar[bool] = False  # whether the memory must accumulate the prompt's keys

    def query(self, ctx: RouteContext) -> torch.Tensor | None:
        """The query proxy to route with now, or None to keep the current selection."""
        raise NotImplementedError


class SequenceRouting(RoutingStrategy):
    """Route with the mean key of the prompt, before each prompt chunk; keep that selection while generating."""

    name = "sequence"
    uses_prompt = True

    def query(self, ctx: RouteContext) -> torch.Tensor | None:
        if not ctx.prefill:
            return None
        q = ctx.prompt_query()
        return q if q is not None else ctx.recent_query(ctx.proxy_tokens)


class RollingRouting(RoutingStrategy):
    """Every `reroute_every` tokens, route with the mean key of the last `proxy_tokens` tokens."""

    name = "rolling"

    def query(self, ctx: RouteContext) -> torch.Tensor | None:
        if ctx.tokens_since_route < ctx.reroute_every:
            return None
        return ctx.recent_query(ctx.proxy_tokens)


class TokenRouting(RoutingStrategy):
    """Before every plan, route with the most recent token's key (the most adaptive, the most paging)."""

    name = "token"

    def query(self, ctx: RouteContext) -> torch.Tensor | None:
        return ctx.recent_query(1)


class HybridRouting(RoutingStrategy):
    """`sequence` while reading a prompt, `rolling` while generating (the default)."""

    name = "hybrid"
    uses_prompt = True

    def __init__(self) -> None:
        self._sequence, self._rolling = SequenceRouting(), RollingRouting()

    def query(self, ctx: RouteContext) -> torch.Tensor | None:
        return (self._sequence if ctx.prefill else self._rolling).query(ctx)


ROUTING: dict[str, type[RoutingStrategy]] = {
    "sequence": SequenceRouting,
    "rolling": RollingRouting,
    "token": TokenRouting,
    "hybrid": HybridRouting,
}
