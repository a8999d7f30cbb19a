"""Choosing the next token: logits processors and samplers, composed like mlx-lm's `make_logits_processors` and
`make_sampler` (plain callables built once per request, so the decode loop does no dispatch per token).

Order of operations per step, as in transformers' `generate`:
  1. logits processors (repetition penalty) see the history and the raw logits;
  2. the sampler reports the chosen token's logprob from the log-softmax of the logits it is given
     (mlx-lm's convention: the model's distribution after processors, before temperature and truncation);
  3. greedy: argmax. Otherwise the warpers — temperature, then top-k, top-p, min-p masks (transformers' warpers,
     same order and tie rules), each a `scores -> scores` callable composed once — then one categorical draw from
     the sampler's own seeded generator.

Draws happen on the CPU with a CPU `torch.Generator`, so a seed gives the same tokens on every backend (for equal
logits) and the RNG state saved in a session file is one format everywhere.

Shapes: V vocab, B batch, N history length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.errors import SessionFileError, SparkError
from engine.loading.sampling_defaults import ModelSampling

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class InvalidSamplingSettings(SparkError, ValueError):
    """A sampling setting is out of range (e.g. a negative temperature)."""


MIN_TEMPERATURE = 1e-6  # fp32 logits (~1e4 at most) stay finite when divided by it; below, use 0 (greedy)
MAX_TEMPERATURE = 100.0  # already uniform noise
MIN_PENALTY, MAX_PENALTY = 1e-3, 1e3
MAX_TOP_K = 1 << 24


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_whole(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SamplingSettings:
    temperature: float = 0.7
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    repetition_window: int = 64  # how many recent tokens the penalty looks at; 0 = the whole history
    seed: int | None = None  # None = a fresh random seed
    greedy: bool = False

    @classmethod
    def from_model(cls, m: ModelSampling, seed: int | None = None) -> SamplingSettings:
        """A model's own recommended sampling (engine.loading.sampling_defaults)."""
        return cls(
            temperature=m.temperature,
            top_k=m.top_k,
            top_p=m.top_p,
            min_p=m.min_p,
            repetition_penalty=m.repetition_penalty,
            repetition_window=m.repetition_window,
            seed=seed,
            greedy=m.greedy,
        )

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidSamplingSettings (one sentence) for a value that cannot be used: the one check the CLI, the
        app, the server and session files share. Bounds are where the arithmetic stays finite in fp32: logits
        divided by a temperature of 5e-324 (a denormal) are infinite, and their softmax NaN."""
        num, whole = _is_number, _is_whole
        checks = (
            (
                num(self.temperature)
                and (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE),
                f"temperature must be 0 (greedy) or from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}, not {self.temperature}",
            ),
            (
                whole(self.top_k) and 0 <= self.top_k <= MAX_TOP_K,
                f"top-k must be 0 (off) or a positive number of tokens, not {self.top_k}",
            ),
            (num(self.top_p) and 0.0 < self.top_p <= 1.0, f"top-p must be in (0, 1], not {self.top_p}"),
            (num(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min-p must be in [0, 1], not {self.min_p}"),
            (
                num(self.repetition_penalty) and MIN_PENALTY <= self.repetition_penalty <= MAX_PENALTY,
                f"repetition penalty must be from {MIN_PENALTY:g} to {MAX_PENALTY:g}, not {self.repetition_penalty}",
            ),
            (
                whole(self.repetition_window) and 0 <= self.repetition_window <= MAX_TOP_K,
                f"repetition window must be 0 (whole history) or more, not {self.repetition_window}",
            ),
            (
                self.seed is None or (whole(self.seed) and -(2**63) <= self.seed < 2**64),
                f"seed must be a whole number that fits in 64 bits, not {str(self.seed)[:40]}",
            ),
            (isinstance(self.greedy, bool), f"greedy must be true or false, not {str(self.greedy)[:40]}"),
        )
        for ok, message in checks:
            if not ok:
                raise InvalidSamplingSettings(f"The sampling {message}.")


def make_repetition_penalty(penalty: float, window: int) -> LogitsProcessor:
    """transformers' RepetitionPenaltyLogitsProcessor over the last `window` tokens (0 = all): a token already
    seen has its logit divided by `penalty` when positive and multiplied by it when negative."""

    def apply(history: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        # history (N,) or (B, N) long; logits (V,) or (B, V) float
        recent = history[..., -window:] if window > 0 else history
        if recent.shape[-1] == 0:
            return logits
        recent = recent.to(logits.device)
        seen = logits.gather(-1, recent)  # (N,) / (B, N)
        seen = torch.where(seen < 0, seen * penalty, seen / penalty)
        return logits.scatter(-1, recent, seen)

    return apply


def make_logits_processors(s: SamplingSettings) -> list[LogitsProcessor]:
    """Processors to apply, in order, to each step's logits before the sampler: `logits = p(history, logits)`."""
    s.validate()
    processors: list[LogitsProcessor] = []
    if s.repetition_penalty != 1.0:
        processors.append(make_repetition_penalty(s.repetition_penalty, s.repetition_window))
    return processors


Warper = Callable[[torch.Tensor], torch.Tensor]  # scores (B, V) -> (B, V), removed tokens at -inf


def make_temperature(temperature: float) -> Warper:
    return lambda scores: scores / temperature


def make_top_k(k: int) -> Warper:
    def apply(scores: torch.Tensor) -> torch.Tensor:
        if k >= scores.shape[-1]:
            return scores
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]  # (B, 1)
        return scores.masked_fill(scores < kth, -math.inf)  # ties with the k-th survive, as in transformers

    return apply


def make_top_p(p: float) -> Warper:
    def apply(scores: torch.Tensor) -> torch.Tensor:
        ascending, order = torch.sort(scores, dim=-1)  # (B, V)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1.0 - p)
        drop_sorted[..., -1:] = False  # the most likely token always stays
        return scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -math.inf)

    return apply


def make_min_p(p: float) -> Warper:
    log_min_p = math.log(p)

    def apply(scores: torch.Tensor) -> torch.Tensor:
        # p < min_p * p_max  <=>  log p < log p_max + log min_p; the softmax normaliser cancels on both sides.
        top = scores.amax(dim=-1, keepdim=True)  # (B, 1)
        return scores.masked_fill(scores < top + log_min_p, -math.inf)

    return apply


def make_warpers(s: SamplingSettings) -> list[Warper]:
    """Temperature, top-k, top-p, min-p (transformers' warpers, same order), only those that are on. Every mask
    keeps at least the most likely token. Empty for greedy settings."""
    s.validate()
    if s.is_greedy:
        return []
    warpers: list[Warper] = []
    if s.temperature != 1.0:
        warpers.append(make_temperature(s.temperature))
    if s.top_k > 0:
        warpers.append(make_top_k(s.top_k))
    if s.top_p < 1.0:
        warpers.append(make_top_p(s.top_p))
    if s.min_p > 0.0:
        warpers.append(make_min_p(s.min_p))
    return warpers


class Sample(NamedTuple):
    token: int
    logprob: float  # of `token` under the log-softmax of the logits the sampler was given


class Sampler:
    """Picks a token from one step's logits: `(V,) -> Sample(token, logprob)`.

    Build it with `make_sampler(settings)`: its warpers are composed once. It owns a CPU generator: the same seed
    gives the same tokens, and `get_state()` / `set_state()` save and restore it (as JSON-able ints) so a restored
    session continues exactly where it stopped.
    """

    def __init__(self, s: SamplingSettings) -> None:
        s.validate()
        self.settings = s
        self._warpers = make_warpers(s)
        self._greedy = s.is_greedy
        self._generator = torch.Generator(device="cpu")
        if s.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(s.seed)

    def __call__(self, logits: torch.Tensor) -> Sample:
        scores = logits.float().unsqueeze(0)  # (1, V)
        logprobs = torch.log_softmax(scores, dim=-1)  # (1, V)
        if self._greedy:
            token = int(logprobs[0].numpy().argmax())  # numpy's: a tenth of torch's time over a 128k vocabulary
        else:
            # Warp the raw logits, as transformers does: log-softmax in float32 can merge near-equal logits.
            probs = torch.softmax(self.warp(scores), dim=-1)  # (1, V)
            token = int(torch.multinomial(probs.cpu(), 1, generator=self._generator)[0, 0])
        return Sample(token, float(logprobs[0, token]))

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (V,) -> (V,) float32: the probabilities this sampler draws from (one-hot on the argmax when
        greedy), after its warpers."""
        scores = logits.float().unsqueeze(0)  # (1, V)
        if self._greedy:
            return torch.nn.functional.one_hot(scores.argmax(dim=-1)[0], scores.shape[-1]).float()
        return torch.softmax(self.warp(scores), dim=-1)[0]

    def verify(self, logits: torch.Tensor, draft: int, draft_probs: torch.Tensor | None) -> tuple[Sample, bool]:
        """Speculative sampling's rule for one drafted token (Leviathan et al. 2023, Chen et al. 2023): with p this
        sampler's distribution over `logits` (V,) and q the drafter's (`draft_probs` (V,), or None for a drafter that
        proposes one token for sure), keep `draft` with probability min(1, p/q), else draw from max(0, p - q)
        normalised. The token that comes out is distributed as p exactly, whatever q was. Greedy keeps the draft
        when it is the argmax, else gives the argmax: the token plain decoding takes. Returns (sample, kept)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (V,)
        if self._greedy:
            token = int(logprobs.numpy().argmax())  # as __call__'s
            return Sample(token, float(logprobs[token])), token == draft
        p = self.distribution(logits)  # (V,)
        q = draft_probs.float() if draft_probs is not None else None
        q_draft = float(q[draft]) if q is not None else 1.0
        u = float(torch.rand((), generator=self._generator))
        if q_draft > 0.0 and u * q_draft < float(p[draft]):
            return Sample(draft, float(logprobs[draft])), True
        residual = (p - q).clamp_(min=0.0) if q is not None else p.clone()  # (V,)
        if q is None:
            residual[draft] = 0.0
        if float(residual.sum()) <= 0.0:  # p == q to rounding: any draw from p will do
            residual = p
        token = int(torch.multinomial(residual[None], 1, generator=self._generator)[0, 0])
        return Sample(token, float(logprobs[token])), False

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """scores (B, V) float -> (B, V) float through this sampler's warpers, in order."""
        for warper in self._warpers:
            scores = warper(scores)
        return scores

    def get_state(self) -> list[int]:
        """The generator state as a list of byte values (JSON-able, for session files)."""
        state: list[int] = self._generator.get_state().tolist()
        return state

    def set_state(self, state: bytes | list[int]) -> None:
        """Restore a state from `get_state()` (a list of byte values, or the same as bytes)."""
        try:
            self._generator.set_state(torch.tensor(list(state), dtype=torch.uint8))
        except (RuntimeError, TypeError, ValueError, OverflowError):
            raise SessionFileError(
                "The saved sampler state is damaged, so the conversation cannot continue exactly."
            ) from None


def make_sampler(s: SamplingSettings) -> Sampler:
    return Sampler(s)


def sample_greedy(logits: torch.Tensor) -> list[Sample]:
    """logits (B, V) -> one greedy Sample per row, the same numbers a greedy `Sampler` gives each row alone."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    tokens = logprobs.argmax(dim=-1)  # (B,)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]  # (B,)
    return [Sample(t, lp) for t, lp in zip(tokens.tolist(), chosen.tolist(), strict=True)]
