"""Core ML errors: each is a `SparkError`, so the CLI and the app show its one sentence as is."""

from __future__ import annotations

from engine.errors import SparkError


class CoreMLError(SparkError):
    """Base of every Core ML problem the user can act on."""


class ConversionError(CoreMLError):
    """The model cannot be converted (unsupported architecture, op, geometry or compression), or conversion failed."""


class PackageError(CoreMLError):
    """A .mlpackage is missing, malformed, lacks provenance or breaks an ANE rule."""
