"""Constrained decoding on the real default model: sampled replies (hot temperature, several seeds) always parse
and validate against their JSON schema, on the single-request loop and on batch rows; a GBNF grammar limits the
reply to its language; a reply ends as soon as its grammar is complete; a hostile schema or grammar is refused in
one sentence."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import engine
from engine.generation.batch import generate_batch
from engine.generation.constrained import (
    MAX_SCHEMA_DEPTH,
    GrammarError,
    GrammarKind,
    TokenMask,
    grammar_from_file_text,
    json_object_grammar,
    json_schema_grammar,
    text_grammar,
)
from engine.generation.loop import FinishReason, GenerationSettings
from engine.generation.sampling import SamplingSettings
from tests.helpers.default_model import default_model_dir

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def eng() -> Iterator[engine.Engine]:
    yield engine.load(default_model_dir(), "cpu", quantize="auto", prefix_cache=False)


def chat(eng: engine.Engine, prompt: str, settings: GenerationSettings) -> tuple[str, list[engine.GenerationEvent]]:
    events = list(eng.new_session().chat(prompt, settings))
    return "".join(e.text for e in events), events


def hot(seed: int, **kw: Any) -> GenerationSettings:
    return GenerationSettings(max_tokens=96, sampling=SamplingSettings(temperature=1.2, seed=seed), **kw)


def test_sampled_replies_validate_against_the_schema(eng: engine.Engine) -> None:
    grammar = json_schema_grammar(PERSON)
    for seed in range(4):
        text, events = chat(eng, "Describe a person.", hot(seed, grammar=grammar))
        jsonschema.validate(json.loads(text), PERSON)
        # The reply ends when the closing brace completes the grammar: no EOS is sampled, nothing follows.
        assert events[-1].finish_reason is FinishReason.STOP
        assert eng.tokenizer.eos_ids.isdisjoint(e.token for e in events)


def test_without_a_grammar_the_same_prompt_is_not_always_valid_json(eng: engine.Engine) -> None:
    """The control: the constraint is what makes the replies valid (the small model alone rarely writes them)."""
    valid = 0
    for seed in range(4):
        text, _ = chat(eng, "Describe a person.", hot(seed))
        try:
            jsonschema.validate(json.loads(text), PERSON)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    assert valid < 4


def test_batch_rows_are_constrained_each(eng: engine.Engine) -> None:
    grammar = json_object_grammar()
    prompts = [eng.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in ("Hi", "Give me data about cats")]
    done = generate_batch(eng.backend.fork(), eng.tokenizer, prompts, hot(7, grammar=grammar))
    for c in done:
        assert isinstance(json.loads(c.text), dict)


def test_gbnf_grammar_limits_the_reply_to_its_language(eng: engine.Engine, tmp_path: Path) -> None:
    grammar = grammar_from_file_text('root ::= ("yes" | "no") "." ', "grammar")
    assert grammar.kind is GrammarKind.GBNF
    for seed in range(3):
        text, _ = chat(eng, "Is the sky green?", hot(seed, grammar=grammar))
        assert text in ("yes.", "no.")
    lark = grammar_from_file_text('start: "The answer is " /[0-9]{1,3}/', "grammar")
    assert lark.kind is GrammarKind.LARK
    text, _ = chat(eng, "How many legs does a spider have?", hot(0, grammar=lark))
    assert text.startswith("The answer is ") and text[14:].isdigit()


def test_mask_reports_its_cost(eng: engine.Engine) -> None:
    mask = TokenMask(json_schema_grammar({"type": "boolean"}), eng.tokenizer)
    import torch

    logits = mask.apply(torch.zeros(eng.tokenizer.vocab_size + 64))  # a model head may be wider than the vocab
    allowed = {eng.tokenizer.decode([int(i)]) for i in torch.nonzero(logits == 0).flatten().tolist()}
    assert allowed and all("true".startswith(t) or "false".startswith(t) for t in allowed)
    assert bool(torch.isinf(logits[eng.tokenizer.vocab_size :]).all())
    assert mask.stats.masks == 1 and mask.stats.ms_per_token > 0


def test_the_mask_reuses_its_buffers_and_leaves_the_logits_alone(eng: engine.Engine) -> None:
    import torch

    mask = TokenMask(json_schema_grammar({"enum": ["yes", "no"]}), eng.tokenizer)
    logits = torch.randn(eng.tokenizer.vocab_size + 64)  # (V',)
    before = logits.clone()
    first = mask.apply(logits)
    assert torch.equal(logits, before)  # the model's row is not written to
    kept = torch.isfinite(first)
    assert torch.equal(first[kept], logits[kept]) and 0 < int(kept.sum()) < eng.tokenizer.vocab_size
    token = int(torch.argmax(first))
    mask.advance(token)
    second = mask.apply(logits)
    assert second.data_ptr() == first.data_ptr()  # the same buffer, step after step
    allowed = {eng.tokenizer.decode([int(i)]) for i in torch.nonzero(torch.isfinite(second)).flatten().tolist()}
    text = eng.tokenizer.decode([token])
    assert allowed and all(any(w.startswith(text + t) for w in ('"yes"', '"no"')) for t in allowed)


def deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        (deep_schema(MAX_SCHEMA_DEPTH), "nests deeper"),
        ({"enum": [f"value-{i}-{'x' * 24}" for i in range(10_000)]}, "larger than"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "cannot be used"),
        ({"type": "nonsense"}, "cannot be used"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_hostile_schemas_are_refused_in_one_sentence(schema: Any, words: str) -> None:
    with pytest.raises(GrammarError) as err:
        json_schema_grammar(schema)
    message = str(err.value)
    assert words in message and message.endswith(".") and "\n" not in message


def test_malformed_grammars_are_refused_in_one_sentence() -> None:
    for text, kind in (("start: (", GrammarKind.LARK), ("root ::= (", GrammarKind.GBNF)):
        with pytest.raises(GrammarError) as err:
            text_grammar(text, kind)
        assert "\n" not in str(err.value)


RECURSIVE = [
    {
        "$defs": {
            "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
            "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]},
        },
        "$ref": "#/$defs/a",
    },
    {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 2},
    {
        "allOf": [{"$ref": "#/definitions/x"}],
        "definitions": {"x": {"required": ["y"], "properties": {"y": {"$ref": "#"}}}},
    },
]
FINITE = [
    {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}}},
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # optional: {} ends it
    {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}]},
    {
        "type": "object",
        "properties": {"n": {"type": ["object", "null"], "properties": {"m": {"$ref": "#"}}}},
        "required": ["n"],
    },
]


@pytest.mark.parametrize("schema", RECURSIVE)
def test_a_schema_that_requires_itself_without_end_is_refused(schema: Any) -> None:
    with pytest.raises(GrammarError) as err:
        json_schema_grammar(schema)
    message = str(err.value)
    assert "cannot be satisfied" in message and message.endswith(".") and "\n" not in message


@pytest.mark.parametrize("schema", FINITE)
def test_recursive_schemas_with_a_way_out_are_kept(schema: Any) -> None:
    json_schema_grammar(schema)


def test_a_lark_json_directive_gets_the_schema_checks() -> None:
    deep = json.dumps(deep_schema(MAX_SCHEMA_DEPTH + 12))
    with pytest.raises(GrammarError) as err:
        text_grammar(f'start: "x" %json {deep}', GrammarKind.LARK)
    assert "nests deeper than" in str(err.value)
    looping = json.dumps(RECURSIVE[1])
    with pytest.raises(GrammarError) as err:
        text_grammar(f'start: "x" %json {looping}', GrammarKind.LARK)
    assert "cannot be satisfied" in str(err.value)
    text_grammar(f'start: "x" %json {json.dumps(FINITE[0])}', GrammarKind.LARK)
