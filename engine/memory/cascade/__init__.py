"""The memory cascade: working (L1) sinks + window + retrieval slots, episodic (L2) host blocks, persistent (L3)
content-addressed disk blocks. See docs/DESIGN.md, "The memory cascade", and engine.memory.cascade.core."""

from engine.memory.cascade.budget import SharedBudget
from engine.memory.cascade.config import CascadeConfig, CascadeConfigError
from engine.memory.cascade.core import CascadeMemory
from engine.memory.cascade.persistent import PersistentStore
from engine.memory.cascade.stats import CascadeStats, TierStats

__all__ = [
    "CascadeConfig",
    "CascadeConfigError",
    "CascadeMemory",
    "CascadeStats",
    "PersistentStore",
    "SharedBudget",
    "TierStats",
]
