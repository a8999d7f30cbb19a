"""Sampling: greedy, filters that never pick a removed token, seeded reproducibility and RNG state, and the
repetition penalty, checked against transformers' own logits processors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.errors import SessionFileError, SparkError
from engine.generation.sampling import (
    InvalidSamplingSettings,
    Sample,
    SamplingSettings,
    make_logits_processors,
    make_sampler,
    make_warpers,
    sample_greedy,
)

V = 50
logit_values = st.floats(-20.0, 20.0, allow_nan=False, width=32)


def test_greedy_is_argmax_with_model_logprob() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0))
    for s in (SamplingSettings(greedy=True, temperature=1.3, top_k=3), SamplingSettings(temperature=0.0)):
        token, logprob = make_sampler(s)(logits)
        assert token == int(logits.argmax())
        assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]))


def test_batched_greedy_equals_the_sampler_row_by_row() -> None:
    """The batch's one-argmax fast path gives each row exactly what a greedy Sampler gives it alone."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    sampler = make_sampler(SamplingSettings(greedy=True))
    rows = sample_greedy(logits)
    assert rows == [sampler(row) for row in logits]
    assert all(isinstance(r, Sample) and isinstance(r.token, int) and isinstance(r.logprob, float) for r in rows)
    assert [r.token for r in rows] == logits.argmax(-1).tolist()


def test_warpers_are_composed_only_when_on() -> None:
    assert make_warpers(SamplingSettings(greedy=True, top_k=5, top_p=0.5)) == []
    assert make_warpers(SamplingSettings(temperature=1.0)) == []
    assert len(make_warpers(SamplingSettings(temperature=0.5, top_k=5, top_p=0.5, min_p=0.1))) == 4


@settings(max_examples=200, deadline=None)
@given(
    logits=st.lists(logit_values, min_size=2, max_size=V),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, V),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_filtered_tokens_are_never_picked(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    x = torch.tensor(logits)  # (V,)
    sampler = make_sampler(SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed))
    token, logprob = sampler(x)
    assert logprob == pytest.approx(float(torch.log_softmax(x, -1)[token]), abs=1e-5)
    # Definitions of each filter, with a little slack for float rounding at the boundaries.
    if 0 < top_k < len(logits):
        assert x[token] >= torch.topk(x, top_k).values[-1]
    probs = torch.softmax((x / temperature).double(), -1)  # the float32 scaling the sampler (and transformers) does
    more_likely = probs[probs > probs[token]].sum()
    if top_k == 0 or top_k >= len(logits):
        assert more_likely < top_p + 1e-5  # top-p keeps the smallest set whose mass reaches p
    assert probs[token] >= min_p * probs.max() * (1 - 1e-5)


def _transformers_warp(scores: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    for warper in (
        TemperatureLogitsWarper(s.temperature),
        TopKLogitsWarper(s.top_k) if s.top_k else None,
        TopPLogitsWarper(s.top_p) if s.top_p < 1.0 else None,
        MinPLogitsWarper(s.min_p) if s.min_p > 0.0 else None,
    ):
        if warper is not None:
            scores = warper(None, scores)
    return scores


@pytest.mark.parametrize(
    "s",
    [
        SamplingSettings(temperature=0.7, top_k=10),
        SamplingSettings(temperature=1.0, top_p=0.8),
        SamplingSettings(temperature=1.5, min_p=0.1),
        SamplingSettings(temperature=0.5, top_k=20, top_p=0.9, min_p=0.05),
    ],
)
def test_filters_equal_transformers_warpers(s: SamplingSettings) -> None:
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2)) * 3  # (B, V)
    ours = make_sampler(s).warp(logits)
    theirs = _transformers_warp(logits.clone(), s)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.allclose(torch.softmax(ours, -1), torch.softmax(theirs, -1), atol=1e-6)


def test_seed_reproducibility_and_state_roundtrip() -> None:
    logits = torch.zeros(V)  # uniform: every draw depends on the RNG
    s = SamplingSettings(temperature=1.0, seed=1234)
    a, b = make_sampler(s), make_sampler(s)
    first = [a(logits)[0] for _ in range(30)]
    assert first == [b(logits)[0] for _ in range(30)]
    assert first != [make_sampler(SamplingSettings(temperature=1.0, seed=4321))(logits)[0] for _ in range(30)]

    saved = json.loads(json.dumps(a.get_state()))  # session files keep it as JSON
    expected = [a(logits)[0] for _ in range(20)]
    restored = make_sampler(SamplingSettings(temperature=1.0, seed=None))
    restored.set_state(saved)
    assert [restored(logits)[0] for _ in range(20)] == expected
    restored.set_state(bytes(saved))
    assert [restored(logits)[0] for _ in range(20)] == expected
    with pytest.raises(SessionFileError):
        restored.set_state([1, 2, 3])


def test_seeded_top_k_draws_stay_in_the_top_k_and_repeat() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3))
    s = SamplingSettings(temperature=0.9, top_k=5, seed=7)
    a, b = make_sampler(s), make_sampler(s)
    picks = [a(row) for row in logits]
    top5 = torch.topk(logits, 5, -1).indices
    assert all(p.token in top5[i].tolist() for i, p in enumerate(picks))
    assert picks == [b(row) for row in logits]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
@pytest.mark.parametrize("window", [0, 4])
def test_repetition_penalty_equals_transformers(penalty: float, window: int) -> None:
    g = torch.Generator().manual_seed(4)
    history = torch.randint(0, V, (2, 12), generator=g)  # (B, N), with repeats
    logits = torch.randn(2, V, generator=g)  # (B, V): both signs
    (process,) = make_logits_processors(SamplingSettings(repetition_penalty=penalty, repetition_window=window))
    recent = history[:, -window:] if window else history
    expected = RepetitionPenaltyLogitsProcessor(penalty)(recent, logits.clone())
    assert torch.equal(process(history, logits), expected)
    assert torch.equal(process(history[0], logits[0]), expected[0])  # (N,), (V,) form
    assert torch.equal(process(torch.empty(0, dtype=torch.long), logits[0]), logits[0])


def test_no_processors_when_off() -> None:
    assert make_logits_processors(SamplingSettings()) == []


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1.0},
        {"temperature": math.nan},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": 2.0},
        {"repetition_penalty": 0.0},
        {"repetition_window": -2},
    ],
)
def test_invalid_settings_are_one_sentence_errors(bad: dict) -> None:
    s = SamplingSettings(**bad)
    for build in (make_sampler, make_logits_processors):
        with pytest.raises(SparkError) as err:
            build(s)
        assert "\n" not in str(err.value) and str(err.value).endswith(".")


@pytest.mark.parametrize(
    "values",
    [
        {"temperature": 5e-324},
        {"temperature": 2.0e-310},
        {"temperature": 1e-7},
        {"temperature": 1e308},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.0000001},
        {"min_p": -1e-300},
        {"min_p": float("inf")},
        {"top_k": -1},
        {"top_k": 2.5},
        {"repetition_penalty": 1e-300},
        {"seed": 2**64},
        {"greedy": "yes"},
    ],
)
def test_values_whose_arithmetic_breaks_are_refused_in_one_sentence(values: dict) -> None:
    with pytest.raises(InvalidSamplingSettings) as e:
        SamplingSettings(**values).validate()
    assert "\n" not in str(e.value) and str(e.value).endswith(".")


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 0.7, 2.0, 100.0])
def test_temperatures_in_range_sample_finite_probabilities(temperature: float) -> None:
    s = SamplingSettings(temperature=temperature, seed=0)
    s.validate()
    sample = make_sampler(s)(torch.tensor([30.0, -30.0, 0.0, 29.9]))
    assert sample.token in (0, 1, 2, 3) and math.isfinite(sample.logprob)
