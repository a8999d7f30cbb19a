"""How many examples a hypothesis fuzz target runs: a bounded number in `make test`, many in `make fuzz`
(SPARK_FUZZ_EXAMPLES=N)."""

from __future__ import annotations

import os


def fuzz_examples(default: int) -> int:
    """`default` unless SPARK_FUZZ_EXAMPLES asks for more (the long runs of `make fuzz`)."""
    value = os.environ.get("SPARK_FUZZ_EXAMPLES", "")
    return int(value) if value.isdigit() and int(value) > 0 else default
