"""How a reply is sampled: the app's choice (Settings), a conversation's own override, and the settings they resolve
to once the model is known, with words saying where they came from.

A choice is explicit: `use_model_defaults` says whether the model's own recommended sampling answers; `own` keeps
the user's values either way, so switching the model's defaults off brings back what the user last chose. The seed
and the greedy switch are the user's in both cases. Plain data, no Qt: the window, the library and the tests share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from enum import Enum

from engine import InvalidSamplingSettings, ModelSampling, SamplingSettings


@dataclass(frozen=True)
class SamplingChoice:
    use_model_defaults: bool = True
    own: SamplingSettings = field(default_factory=SamplingSettings)  # the user's values, kept while unused


class SamplingSource(Enum):
    """Whose choice a reply followed."""

    APP = "app"
    CONVERSATION = "conversation"


@dataclass(frozen=True)
class ResolvedSampling:
    sampling: SamplingSettings  # what the sampler gets
    source: SamplingSource
    model_defaults: bool  # the model's own recommended values answered
    defaults_unknown: bool = False  # the choice asked for the model's defaults, but none are known (a server's model)


def resolve(app: SamplingChoice, conversation: SamplingChoice | None, model: ModelSampling | None) -> ResolvedSampling:
    """The sampling for a reply: the conversation's override where it has one, else the app's choice; the model's
    own defaults where that choice asks for them and the model has any (a remote server's model has none here: the
    user's values are sent)."""
    choice = conversation if conversation is not None else app
    source = SamplingSource.CONVERSATION if conversation is not None else SamplingSource.APP
    own = choice.own
    if choice.use_model_defaults and model is not None:
        theirs = SamplingSettings.from_model(model, own.seed)
        return ResolvedSampling(replace(theirs, greedy=theirs.greedy or own.greedy), source, True)
    # A copy: the settings go to the worker's thread, the choice stays with the window.
    return ResolvedSampling(replace(own), source, False, choice.use_model_defaults)


def knob_words(s: SamplingSettings | ModelSampling) -> str:
    """The sampling knobs in one phrase: "temperature 0.2, top-p 0.9, top-k off, min-p off, repetition penalty…"."""
    knobs = [
        "greedy" if s.greedy else f"temperature {s.temperature:g}",
        f"top-p {s.top_p:g}" if s.top_p < 1.0 else "top-p off",
        f"top-k {s.top_k}" if s.top_k else "top-k off",
        f"min-p {s.min_p:g}" if s.min_p else "min-p off",
        f"repetition penalty {s.repetition_penalty:g} over {s.repetition_window} tokens"
        if s.repetition_penalty != 1.0
        else "no repetition penalty",
    ]
    return ", ".join(knobs)


def resolved_words(r: ResolvedSampling) -> str:
    """Which settings, and whose: "the app setting: the model's defaults (temperature 0.2, …)"."""
    app = r.source is SamplingSource.APP
    whose = "the app setting" if app else "this conversation's setting"
    what = "the model's defaults" if r.model_defaults else "the values chosen in Settings" if app else "its own values"
    if r.defaults_unknown:
        what += ", as the model's own defaults are not known here"
    return f"{whose}: {what} ({knob_words(r.sampling)})"


def choice_from_json(raw: object) -> SamplingChoice:
    """A stored choice, checked; raises InvalidSamplingSettings (one sentence) for anything that cannot be used."""
    if not isinstance(raw, dict) or set(raw) != {"use_model_defaults", "own"}:
        raise InvalidSamplingSettings("The stored sampling is not a sampling choice.")
    flag, own = raw["use_model_defaults"], raw["own"]
    if not isinstance(flag, bool):
        raise InvalidSamplingSettings("The stored sampling's model-defaults switch is not true or false.")
    known = {f.name for f in fields(SamplingSettings)}
    if not isinstance(own, dict) or not set(own) <= known:
        raise InvalidSamplingSettings("The stored sampling holds settings Spark does not know.")
    if not all(_plain_number(v) for v in own.values()):
        raise InvalidSamplingSettings("The stored sampling holds a value that is not a usable number.")
    settings = SamplingSettings(**own)
    settings.validate()  # one sentence naming the value that is out of range
    return SamplingChoice(flag, settings)


def _plain_number(v: object) -> bool:
    """None, true/false, or a finite number short enough to name in a sentence (validate() names the bad one)."""
    if v is None or isinstance(v, bool):
        return True
    if isinstance(v, int):
        return abs(v) < 2**64
    return isinstance(v, float) and math.isfinite(v)
