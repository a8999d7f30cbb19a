"""The memory cascade: working (L1) sinks + window + retrieval slots, episodic (L2) host blocks, persistent (L3)
content-addressed disk blocks. See DESIGN.md, "The memory cascade", and engine.cascade.memory."""

from engine.cascade.config import CascadeConfig, CascadeConfigError
from engine.cascade.memory import CascadeMemory
from engine.cascade.persistent import PersistentStore
from engine.cascade.stats import CascadeStats, TierStats

__all__ = ["CascadeConfig", "CascadeConfigError", "CascadeMemory", "CascadeStats", "PersistentStore", "TierStats"]
