"""The product's version: written into session files and shown in the About box."""

__version__ = "0.1.0"
