"""The converter's own errors; the ones the runtime shares (`CoreMLError`, `ConversionError`, `PackageError`) are in
engine.backends.coreml.errors."""

from __future__ import annotations

from engine.backends.coreml.errors import CoreMLError


class UnsupportedOp(CoreMLError):
    """The reference interpreter met an op (or an op variant) it does not implement; never skipped silently."""


class ConversionCancelled(CoreMLError):
    """The user cancelled a conversion; nothing was written."""
