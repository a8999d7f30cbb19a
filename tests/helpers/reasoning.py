"""A reasoning reply the tests force on a tiny model (a random model would never close a think block by itself)."""

from __future__ import annotations

THOUGHT, ANSWER = "The quick brown fox.", "Python is a language."
# The model's reply, forced by a grammar.
THINKING_REPLY = f'start: "<think>\\n{THOUGHT}\\n</think>\\n\\n{ANSWER}"'
