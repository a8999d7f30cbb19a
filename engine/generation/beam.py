"""Beam search's bookkeeping: which beams run, which have finished, when the search ends (`BeamSearch`), and the
forward that feeds every running beam's next token at once over forks of one memory (`BeamForks`). The loop that
drives them is `engine.generation.loop.beam_generate`.

The rules are transformers' (`generate(num_beams=N, do_sample=False)`, its `_beam_search` as of version 5), so our
beams equal its output token for token:
  - each step ranks the running beams' continuations by their summed log-probabilities and keeps the top
    K = max(2, 1 + number of end-of-reply tokens) * N of them; the best N that did not end keep running;
  - a continuation among the best N that ends (an end-of-reply token, or the token budget) becomes a finished
    hypothesis scored `sum of log-probabilities / generated_tokens ** length_penalty` (generated tokens counted with
    the last one), and the N best finished are kept;
  - the search ends when every continuation ended, when N hypotheses have finished and `early_stopping` is DONE, or
    when no running beam can beat the worst of N finished ones: its best score so far, normalised by its length
    now (or, under NEVER with a positive penalty, by the longest length the budget allows), is no better.
Length normalisation: `length_penalty` 0 (our default) scores by the plain sum of log-probabilities, the textbook
beam search; transformers' default is 1.0, the sum divided by the generated length (favouring longer replies as the
penalty grows). Sampling settings (temperature, top-p, penalties) do not apply: beams are ranked by the model's own
log-probabilities. Stop strings end the chosen reply's text, not a beam.

Memory: the beams are forks of the conversation's memory (engine.model.slots.ForkTable): they see its slots by mask
and write their own tokens past them, sharing every token they have in common, so N beams cost the memory once
plus the distinct tokens of their tree. Each step feeds the running beams' tokens as one chunk of one row, each
token masked to its own beam. On the cascade, forks see the memory as the next token would (engine.memory.base.
ForkView); once the window is full, decoding one by one would also push the window's oldest tokens out as each
beam grows, which beams sharing one window cannot do, so they keep seeing them (at most `max_tokens` more than
plain decoding sees). When the search ends the forks are dropped and the chosen reply (but its last token, as
after plain decoding) is fed to the memory in chunks, as a prompt is: the memory's bookkeeping (window, episodic
blocks, prefix cache) then follows the reply as it follows any text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from engine.backends.base import Backend
from engine.errors import InputTooLarge
from engine.memory.base import ForkView, RowPlan, window_mask
from engine.model.slots import ForkTable

MAX_BEAMS = 16
NEG = -1.0e9  # transformers' "never chosen" score


class EarlyStopping(StrEnum):
    """When a search with N finished hypotheses stops (transformers' `early_stopping`)."""

    HEURISTIC = "heuristic"  # transformers' False: when no running beam, scored at its current length, can beat them
    DONE = "done"  # transformers' True: as soon as N have finished
    NEVER = "never"  # transformers' "never": as HEURISTIC, but a positive penalty scores at the longest length


@dataclass(frozen=True)
class BeamSettings:
    beams: int = 1  # N; 1 is plain decoding (the loop's own path)
    length_penalty: float = 0.0  # finished scores: sum of logprobs / generated_tokens ** length_penalty
    early_stopping: EarlyStopping = EarlyStopping.HEURISTIC
    returned: int = 1  # how many of the best hypotheses the caller wants (OpenAI's `n`), at most `beams`

    def __post_init__(self) -> None:
        if not 1 <= self.beams <= MAX_BEAMS:
            raise ValueError(f"beams must be between 1 and {MAX_BEAMS}, not {self.beams}")
        if not 1 <= self.returned <= self.beams:
            raise ValueError(f"the number of replies returned ({self.returned}) must be between 1 and the beams")
        EarlyStopping(self.early_stopping)


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its tokens (the end-of-reply token included when it ended on one), each one's
    log-probability, their sum, and its score (that sum, length-normalised per BeamSettings)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    logprob: float
    score: float


@dataclass(frozen=True)
class Step:
    """The running beams after one step: for each, the index of the beam it continues in the previous step's
    running list (0 at the first step) and its new token."""

    parents: tuple[int, ...]
    tokens: tuple[int, ...]


class BeamSearch:
    """transformers' beam search rules (module doc) over the running beams' log-probabilities, step by step."""

    def __init__(self, settings: BeamSettings, eos: frozenset[int], max_tokens: int) -> None:
        self.settings = settings
        self.eos = eos
        self.max_tokens = max_tokens
        self.length = 0  # tokens generated by every running beam
        self.running: list[tuple[int, ...]] = [()]  # the running beams' tokens, best first
        self.running_logprobs: list[tuple[float, ...]] = [()]  # and each token's log-probability
        self.scores = torch.zeros(1)  # (R,) float32 their summed log-probabilities
        self.finished: list[Hypothesis] = []  # best first, at most N
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = max_tokens < 1

    def step(self, logits: torch.Tensor) -> Step:
        """logits (R, V) of the running beams' next tokens -> the beams that run next (empty when done)."""
        n, lp = self.settings.beams, self.settings.length_penalty
        vocab = logits.shape[-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
        acc = (logprobs + self.scores[:, None]).reshape(-1)  # (R*V,)
        k = min(max(2, 1 + len(self.eos)) * n, acc.numel())
        top, flat = torch.topk(acc, k)  # (K,) best first
        beams, tokens = (flat // vocab).tolist(), (flat % vocab).tolist()
        own = logprobs.reshape(-1)[flat].tolist()  # (K,) each continuation's own token's log-probability
        seqs = [(*self.running[b], t) for b, t in zip(beams, tokens, strict=True)]
        seq_logprobs = [(*self.running_logprobs[b], lp_) for b, lp_ in zip(beams, own, strict=True)]
        gen = self.length + 1  # generated tokens with this one
        ends = torch.tensor([t in self.eos or gen >= self.max_tokens for t in tokens])  # (K,)
        # The best N continuations that do not end run on (transformers takes them even when all ended).
        keep = torch.topk(top + ends.float() * NEG, min(n, k)).indices.tolist()
        # Those among the best N that end may join the finished ones.
        if self.improvable and not (len(self.finished) == n and self.settings.early_stopping is EarlyStopping.DONE):
            normalised = top / (gen**lp)  # (K,)
            new = [
                Hypothesis(seqs[i], seq_logprobs[i], float(top[i]), float(normalised[i]))
                for i in range(min(n, k))
                if ends[i]
            ]
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:n]
        self.running = [seqs[i] for i in keep]
        self.running_logprobs = [seq_logprobs[i] for i in keep]
        self.scores = (top + ends.float() * NEG)[keep]
        self.length = gen
        if len(self.finished) == n:
            stopping = self.settings.early_stopping
            hyp = self.max_tokens if stopping is EarlyStopping.NEVER and lp > 0 else self.length
            best_possible = float(self.scores[0] / (hyp**lp))
            self.improvable = self.improvable and best_possible > self.finished[-1].score
        self.done = (
            not self.improvable
            or (len(self.finished) == n and self.settings.early_stopping is EarlyStopping.DONE)
            or bool(ends.all())
        )
        if self.done:
            return Step((), ())
        return Step(tuple(beams[i] for i in keep), tuple(tokens[i] for i in keep))

    def best(self) -> list[Hypothesis]:
        """The finished hypotheses, best first; when the search was stopped before any finished, the running
        beams (scored by their plain sum)."""
        if self.finished:
            return list(self.finished)
        return [
            Hypothesis(t, lps, float(s), float(s))
            for t, lps, s in zip(self.running, self.running_logprobs, self.scores.tolist(), strict=True)
        ]


class BeamForks:
    """The running beams as forks of one memory: each step feeds every beam's next token in one forward."""

    def __init__(self, backend: Backend, view: ForkView, offsets: torch.Tensor | None = None) -> None:
        """`offsets` (1, 3): the multimodal rotary offsets of a token after the memory's (every fork's token is
        text, so all have them; Backend.position_offsets), or None."""
        self.backend, self.view, self.offsets = backend, view, offsets
        self.table = ForkTable(view.slot_positions.numel())
        self.nodes = [ForkTable.ROOT]  # the node each running beam continues from

    def feed(self, step: Step) -> torch.Tensor:
        """Move the forks to `step`'s beams and feed their new tokens: logits (R, V) float32."""
        t = self.table
        old, parents = self.nodes, [self.nodes[p] for p in step.parents]
        for node in parents:  # every new beam holds the node it continues, then the old beams let go of theirs
            t.hold(node)
        for node in old:
            t.drop(node)
        self.nodes = t.write(parents)  # each beam's reference moves to its new token's node
        plan = self._plan()
        if plan.slot_positions.numel() > self.backend.num_slots:
            self.backend.widen(plan.slot_positions.numel())
        logits = self.backend.forward(torch.tensor([list(step.tokens)], dtype=torch.long), plan.as_batch())
        return logits[0]  # (R, V)

    def _plan(self) -> RowPlan:
        """Where the beams' new tokens go and what each sees: the memory's view plus its own chain."""
        v, t = self.view, self.table
        s0 = v.slot_positions.numel()
        live = s0 + t.high_water  # S': the memory's slots, then every slot a fork has used
        depth = t.depth[self.nodes[0]]  # every running beam is as deep
        slot_positions = torch.zeros(live, dtype=torch.long)  # (S',)
        slot_tokens = torch.full((live,), -1, dtype=torch.long)  # (S',)
        slot_positions[:s0], slot_tokens[:s0] = v.slot_positions, v.slot_tokens
        mask = torch.zeros(len(self.nodes), live, dtype=torch.bool)  # (R, S')
        mask[:, :s0] = v.visible
        for row, node in enumerate(self.nodes):
            chain = torch.tensor(t.chain(node))  # (depth,) oldest first
            offsets = torch.arange(chain.numel())
            slot_positions[chain] = v.position + offsets
            slot_tokens[chain] = v.index + offsets
            mask[row, chain] = True
        write = torch.tensor([t.slot[n] for n in self.nodes])  # (R,)
        positions = torch.full((len(self.nodes),), v.position + depth - 1)  # (R,)
        local = window_mask(mask, slot_tokens, positions - v.position + v.index, self.backend.config.sliding_window)
        turn = None if self.offsets is None else self.offsets.expand(len(self.nodes), 3)
        return RowPlan(positions, write, slot_positions, mask, v.frame, v.frame_start, local, turn)


def check_room(view: ForkView, max_tokens: int) -> None:
    """Beams may add at most `view.max_depth` tokens (their positions must stay in the model's rotary table)."""
    if max_tokens > view.max_depth:
        raise InputTooLarge(
            f"Beam search can add at most {view.max_depth} tokens to this conversation, not {max_tokens}; "
            "ask for fewer tokens or start a new conversation."
        )


def beams_summary(hypotheses: Sequence[Hypothesis]) -> list[dict[str, object]]:
    """JSON-able: each hypothesis's tokens, summed log-probability and score, best first."""
    return [{"tokens": list(h.tokens), "logprob": h.logprob, "score": h.score} for h in hypotheses]
