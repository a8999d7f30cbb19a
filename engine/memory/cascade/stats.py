"""One typed, JSON-able snapshot of every cascade tier's counters (what the UI and `--json` read)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier. `hits`/`misses` mean, per tier:

    working:    a routed block already sat in a retrieval slot / had to be paged in (`evictions`: tokens that
                left the window)
    episodic:   a paged-in block's KV was in host memory / had to come back from disk or was gone
                (`evictions`: blocks pushed out of host memory by the byte budget)
    persistent: a lookup found a valid entry / found none or a broken one (`evictions`: entries deleted for
                the byte budget or because they were corrupt)
    """

    name: str
    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    hit_rate: float
    evictions: int

    @classmethod
    def make(
        cls, name: str, entries: int, bytes_: int, capacity_bytes: int, hits: int, misses: int, evictions: int
    ) -> TierStats:
        total = hits + misses
        return cls(name, entries, bytes_, capacity_bytes, hits, misses, hits / total if total else 0.0, evictions)


@dataclass(frozen=True)
class CascadeStats:
    working: TierStats
    episodic: TierStats
    persistent: TierStats

    def to_dict(self) -> dict[str, dict[str, object]]:
        return asdict(self)


@dataclass
class Counters:
    """Mutable hit/miss/eviction counters a tier keeps between snapshots."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> Counters:
        return cls(int(d["hits"]), int(d["misses"]), int(d["evictions"]))
