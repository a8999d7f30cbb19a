"""What the inspector's memory panels show about a conversation: its tiers' stats, and how far back a recall reached."""

from __future__ import annotations

from app.worker_types import MemoryReport
from engine.memory.cascade import TierStats
from engine.openai.client import RemoteSession
from engine.session.engine import Session


def memory_report(session: Session | None, remote: RemoteSession | None) -> MemoryReport:
    """The tiers of `session`'s memory (a memory without tiers is shown as one flat tier); a remote one has none."""
    if remote is not None:
        return MemoryReport((), 0, remote.client.server.url)
    if session is None:
        return MemoryReport((), 0)
    memory = session.memory
    stats = session.stats()
    if stats is not None:
        return MemoryReport((stats.working, stats.episodic, stats.persistent), len(memory.tokens))
    backend = session.backend
    per_token = backend.kv_bytes_per_token()
    n = len(memory.tokens)
    row = TierStats("working", n, n * per_token, backend.num_slots * per_token, 0, 0, 0.0, 0)
    return MemoryReport((row,), n)


def episodic_hits(session: Session | None) -> int:
    """Blocks the episodic tier has paged back in so far (0 without a cascade)."""
    stats = session.stats() if session is not None else None
    return stats.episodic.hits if stats is not None else 0


def turns_ago(session: Session | None, turn_starts: list[int]) -> int:
    """How many turns back the newest turn lies that has left the exact window (so a recall reached at least that
    far); 1 when none has wholly left it yet. `turn_starts`: the memory's token count when each turn began."""
    stats = session.stats() if session is not None else None
    evicted = stats.working.evictions if stats is not None else 0
    for back in range(1, len(turn_starts)):
        if turn_starts[-back] <= evicted:  # turn -(back+1) ended where turn -back began: wholly evicted
            return back
    return 1
