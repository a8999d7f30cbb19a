"""One episodic byte budget shared by several memories: the server's rows, the app's conversations.

Whoever owns several memories (a memory factory: the server's service and the app's engine each use one) makes one
`SharedBudget` and passes it to every cascade it builds. Each cascade's episodic store (engine.memory.cascade.
episodic) keeps its own budget (`CascadeConfig.episodic_budget_bytes`) and also charges the shared one: when their
complete blocks together exceed it, the store that just grew evicts its own coldest blocks (to L3 as stubs, then
forgotten) until they fit again. No store ever evicts another's blocks, so each is touched only by the thread
that drives it; the accounting is read under a lock. So a memory that grows while the others fill the budget keeps
only what they leave it (its newest block may go to L3 at once); a memory that resets or is dropped (an idle row, a
closed conversation) frees its share for the others.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol


class Charged(Protocol):
    """A member of a shared budget: the bytes of its complete blocks (KV held on the host + key bounds)."""

    @property
    def charged_bytes(self) -> int: ...


class SharedBudget:
    """`limit_bytes` for the complete episodic blocks of every member together."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError(f"a budget is a byte count, not {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._members: weakref.WeakSet[Charged] = weakref.WeakSet()  # a dropped memory stops counting
        self._lock = threading.Lock()

    def join(self, member: Charged) -> None:
        with self._lock:
            self._members.add(member)

    def leave(self, member: Charged) -> None:
        with self._lock:
            self._members.discard(member)

    @property
    def members(self) -> int:
        with self._lock:
            return len(self._members)

    def used_bytes(self) -> int:
        with self._lock:
            return sum(m.charged_bytes for m in self._members)

    def over(self) -> bool:
        """Whether the members together hold more than the limit."""
        return self.used_bytes() > self.limit_bytes
