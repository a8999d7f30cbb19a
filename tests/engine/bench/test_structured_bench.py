"""`bench structured`'s parts: its five schemas are sound JSON Schemas our grammar compiler takes, and a reply
counts as valid exactly when it parses (a Markdown fence aside) and validates."""

from __future__ import annotations

import jsonschema

from engine.bench.structured import CASES, valid
from engine.generation.constrained import json_schema_grammar


def test_the_schemas_are_sound_and_compile() -> None:
    assert len(CASES) == 5
    for _, schema, _ in CASES:
        jsonschema.Draft202012Validator.check_schema(schema)
        json_schema_grammar(schema)


def test_validity() -> None:
    schema = CASES[2][1]  # enums
    good = '{"sentiment": "negative", "confidence": "high"}'
    assert valid(good, schema) and valid(f"```json\n{good}\n```", schema) and valid(f"  {good}\n", schema)
    assert not valid('{"sentiment": "angry", "confidence": "high"}', schema)
    assert not valid('{"sentiment": "negative"}', schema)
    assert not valid(good + " I hope this helps!", schema)
    assert not valid("[" * 10_000, schema)
