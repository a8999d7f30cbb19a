"""MLoT Spark engine: model, memory cascade, generation, sessions (no Qt)."""

__version__ = "0.1.0"
