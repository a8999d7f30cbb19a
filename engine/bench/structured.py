"""`bench structured`: JSON that parses and validates, with and without constrained decoding, and what the
constraint costs.

Five schemas of our own (nested objects, arrays of objects, enums, numbers with bounds, an optional field), each
with a chat prompt that shows the schema and asks for JSON only; 20 samples each (4 with --quick) at temperature
0.7, seeds 0..n-1, the same prompts and seeds with and without the grammar. A reply is valid when its text, with
a Markdown code fence around it removed, parses as JSON and `jsonschema` validates it.
  - `valid_constrained`, `valid_unconstrained`: the share of valid replies (0-1);
  - `mask_ms_per_token`: llguidance's mask computation plus applying it to the logits, per token, measured by
    replaying every constrained reply's tokens through a fresh mask, synchronously (in generation the mask is
    computed while the forward runs, so this is its cost, not necessarily the time it adds);
  - `speed_ratio`: decode tokens/s constrained ÷ unconstrained (tokens after the first ÷ time since the first,
    summed over the replies).
Default model: the default model (SmolLM2-135M-Instruct); --model for any other.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import torch

from engine.generation.constrained import Grammar, TokenMask, json_schema_grammar
from engine.generation.loop import GenerationEvent, GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.model_files import display_name, resolve_model_path
from engine.session.engine import Engine, load

SAMPLES = 20
TEMPERATURE = 0.7
MAX_TOKENS = 192


def _obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _str(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "nested",
        _obj(
            {
                "name": _str(30),
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "address": _obj({"street": _str(40), "city": _str(30), "country": _str(30)}, ["city", "country"]),
            },
            ["name", "age", "address"],
        ),
        "Describe a fictional person and where they live.",
    ),
    (
        "array",
        _obj(
            {
                "items": {
                    "type": "array",
                    "items": _obj(
                        {"name": _str(24), "quantity": {"type": "integer", "minimum": 1, "maximum": 20}},
                        ["name", "quantity"],
                    ),
                    "minItems": 1,
                    "maxItems": 5,
                }
            },
            ["items"],
        ),
        "Write a short shopping list for a pancake breakfast.",
    ),
    (
        "enum",
        _obj(
            {
                "sentiment": {"enum": ["positive", "neutral", "negative"]},
                "confidence": {"enum": ["low", "medium", "high"]},
            },
            ["sentiment", "confidence"],
        ),
        "Classify the sentiment of this review: 'The food was cold and the waiter was rude.'",
    ),
    (
        "bounded_numbers",
        _obj(
            {
                "latitude": {"type": "number", "minimum": -90, "maximum": 90},
                "longitude": {"type": "number", "minimum": -180, "maximum": 180},
                "elevation_m": {"type": "integer", "minimum": 0, "maximum": 9000},
            },
            ["latitude", "longitude", "elevation_m"],
        ),
        "Give the location of Mount Everest.",
    ),
    (
        "optional_field",
        _obj(
            {
                "title": _str(40),
                "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                "director": _str(30),
            },
            ["title", "year"],
        ),
        "Name a famous science fiction film.",
    ),
]


def valid(text: str, schema: dict[str, Any]) -> bool:
    body = text.strip()
    if body.startswith("```"):  # a fenced block: the model's habit, not a fault of the JSON inside
        body = body.split("\n", 1)[-1].rsplit("```", 1)[0]
    try:
        jsonschema.validate(json.loads(body), schema)
    except (json.JSONDecodeError, RecursionError, jsonschema.ValidationError):
        return False
    return True


@dataclass
class Side:
    """One side's totals: valid replies, and decode tokens and seconds (after each reply's first token)."""

    valid: int = 0
    replies: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    by_case: dict[str, float] = field(default_factory=dict)

    def add(self, last: GenerationEvent, ok: bool) -> None:
        self.valid += ok
        self.replies += 1
        if last.generated_tokens > 1 and last.tokens_per_s > 0:
            self.decode_tokens += last.generated_tokens - 1
            self.decode_s += (last.generated_tokens - 1) / last.tokens_per_s

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def reply(eng: Engine, prompt: str, settings: GenerationSettings) -> tuple[str, list[int], GenerationEvent]:
    events = list(eng.new_session().chat(prompt, settings))
    return "".join(e.text for e in events), [e.token for e in events if e.token is not None], events[-1]


def mask_cost(eng: Engine, grammar: Grammar, replies: list[list[int]]) -> tuple[float, int]:
    """Seconds and tokens of computing and applying the mask for every token of `replies`, synchronously."""
    logits = torch.zeros(eng.tokenizer.vocab_size)  # (V,)
    seconds, tokens = 0.0, 0
    for ids in replies:
        mask = TokenMask(grammar, eng.tokenizer)
        for t in ids:
            t0 = time.perf_counter()
            mask.apply(logits)  # waits for the mask started by the constructor / the last advance
            mask.advance(t)
            if mask.pending is not None:
                mask.pending.result()
            seconds += time.perf_counter() - t0
            tokens += 1
            if mask.finished:
                break
    return seconds, tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    samples = 4 if args.quick else SAMPLES
    model = resolve_model_path(args.model)
    eng = load(model, args.backend, quantize=args.quantize, prefix_cache=False)
    sides = {"constrained": Side(), "unconstrained": Side()}
    mask_s, mask_tokens = 0.0, 0
    for name, schema, task in CASES:
        grammar = json_schema_grammar(schema)
        prompt = f"Reply with JSON only, matching this JSON schema:\n{json.dumps(schema)}\n\n{task}"
        kept: list[list[int]] = []
        for constrained, side in ((True, sides["constrained"]), (False, sides["unconstrained"])):
            ok_before = side.valid
            for seed in range(samples):
                settings = GenerationSettings(
                    max_tokens=MAX_TOKENS,
                    sampling=SamplingSettings(temperature=TEMPERATURE, seed=seed),
                    grammar=grammar if constrained else None,
                )
                text, ids, last = reply(eng, prompt, settings)
                side.add(last, valid(text, schema))
                if constrained:
                    kept.append(ids)
            side.by_case[name] = (side.valid - ok_before) / samples
        s, n = mask_cost(eng, grammar, kept)
        mask_s, mask_tokens = mask_s + s, mask_tokens + n
    con, unc = sides["constrained"], sides["unconstrained"]
    return {
        "model": display_name(model),
        "backend": eng.backend.name,
        "samples_per_schema": samples,
        "temperature": TEMPERATURE,
        "valid_constrained": con.valid / con.replies,
        "valid_unconstrained": unc.valid / unc.replies,
        "valid_by_schema": {
            name: {"constrained": con.by_case[name], "unconstrained": unc.by_case[name]} for name, _, _ in CASES
        },
        "mask_ms_per_token": mask_s / mask_tokens * 1e3 if mask_tokens else 0.0,
        "tokens_per_s_constrained": con.tokens_per_s,
        "tokens_per_s_unconstrained": unc.tokens_per_s,
        "speed_ratio": con.tokens_per_s / unc.tokens_per_s if unc.tokens_per_s else 0.0,
    }
