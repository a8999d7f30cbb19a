"""Routing strategies: when to re-score episodic blocks against the model's queries.

The query routed with is the backends' query summary (engine.backends.base.Backend.query_summary: per layer, the
mean pre-RoPE query of each KV-head group), averaged over the last `proxy_tokens` tokens; the memory computes
it and the drift since the last routing decision, and asks the strategy only *whether* to route now. Routing
pages blocks in only where a layer's selection changed. Each strategy is a small class in an explicit registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass
class RouteContext:
    """What a strategy may look at before a forward."""

    prefill: bool  # a multi-token plan (part of a prompt) rather than one decode step
    tokens_since_route: int  # tokens fed since the last routing decision
    reroute_every: int
    drift: float  # 1 - mean cosine (over layers and KV heads) of the routing query now to the last one routed with
    drift_limit: float  # reroute_drift as a fraction


class RoutingStrategy:
    name: ClassVar[str]

    def should_route(self, ctx: RouteContext) -> bool:
        raise NotImplementedError


class SequenceRouting(RoutingStrategy):
    """Route before each prompt chunk; keep that selection while generating."""

    name = "sequence"

    def should_route(self, ctx: RouteContext) -> bool:
        return ctx.prefill


class RollingRouting(RoutingStrategy):
    """Route when the query has drifted from the one routed with, or at the latest every `reroute_every` tokens."""

    name = "rolling"

    def should_route(self, ctx: RouteContext) -> bool:
        return ctx.drift >= ctx.drift_limit or ctx.tokens_since_route >= ctx.reroute_every


class TokenRouting(RoutingStrategy):
    """Before every plan (the most adaptive, the most paging)."""

    name = "token"

    def should_route(self, ctx: RouteContext) -> bool:
        return True


class HybridRouting(RoutingStrategy):
    """`sequence` while reading a prompt, `rolling` while generating (the default)."""

    name = "hybrid"

    def should_route(self, ctx: RouteContext) -> bool:
        return ctx.prefill or RollingRouting.should_route(RollingRouting(), ctx)


ROUTING: dict[str, type[RoutingStrategy]] = {
    "sequence": SequenceRouting,
    "rolling": RollingRouting,
    "token": TokenRouting,
    "hybrid": HybridRouting,
}
