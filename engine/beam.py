"""Beam search (width N) over the rows of the slot table: one beam per row, KV reordered between steps.

The algorithm is transformers' `generate(num_beams=N, do_sample=False)` for one prompt, step for step (its
vectorized `_beam_search`): each step keeps the top K = max(2, 1 + #eos) * N continuations of all beams, the best N
that did not just end keep running, and those that ended (EOS, or the token budget) among the top N compete for
the N finished slots with score = sum of logprobs / generated_length ** length_penalty. It stops when the finished
slots are full and (early_stopping=True) or when no running beam can still beat the worst finished one
(early_stopping=False, transformers' heuristic), or when the budget is spent.

Beams always have equal length, so there is no padding: after choosing the next beams, `Backend.copy_rows` moves
each surviving beam's KV into its new row on the device (exact, no dtype round trip), and the row memories
(full attention: token i in slot i) copy their token lists. Scores are float32 like transformers', so ties break
the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.backends.base import Backend
from engine.memory import FullAttentionMemory
from engine.model import SlotBatch

NEG = -1.0e9  # transformers' "impossible" score offset, same value so float32 sums compare the same way


@dataclass
class BeamSettings:
    num_beams: int = 4
    max_tokens: int = 64
    length_penalty: float = 1.0  # > 0 favours longer hypotheses (score is divided by length ** penalty)
    early_stopping: bool = False  # transformers' default; True stops once N hypotheses are finished
    prefill_chunk: int = 256


@dataclass
class BeamHypothesis:
    tokens: list[int]  # generated ids, the ending EOS included when it ended on one
    score: float  # sum of logprobs / len(tokens) ** length_penalty


@dataclass
class BeamResult:
    hypotheses: list[BeamHypothesis]  # best first

    @property
    def tokens(self) -> list[int]:
        return self.hypotheses[0].tokens


def _feed(backend: Backend, memories: list[FullAttentionMemory], ids: torch.Tensor) -> torch.Tensor:
    """ids (N, T), one row per beam (all rows equal length) -> last logits (N, V)."""
    plans = [m.plan(row) for m, row in zip(memories, ids.tolist())]
    batch = SlotBatch(
        torch.stack([p.positions for p in plans]),  # (N, T)
        torch.stack([p.write_slots for p in plans]),  # (N, T)
        torch.stack([p.slot_positions for p in plans]),  # (N, S')
        torch.stack([p.mask for p in plans])[:, None],  # (N, 1, T, S')
    )
    return backend.forward(ids, batch, last_only=True)[:, -1]


def beam_search(backend: Backend, prompt_ids: Sequence[int], settings: BeamSettings, eos_ids: Iterable[int]) -> BeamResult:
    """Beam search from `prompt_ids`; takes over `backend`'s slot table (pass a fork) with one row per beam."""
    n, budget = settings.num_beams, settings.max_tokens
    prompt = list(prompt_ids)
    if not prompt or n < 1 or budget < 1:
        raise ValueError("beam search needs a prompt, at least one beam and at least one token to generate")
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
    keep = max(2, 1 + len(eos)) * n  # K candidates per step, so N can keep running even if N of them end
    lp = settings.length_penalty
    backend.allocate(n, len(prompt) + budget)
    memories = [FullAttentionMemory(backend, r) for r in range(n)]
    chunk = max(1, settings.prefill_chunk)
    for at in range(0, len(prompt), chunk):  # every row reads the prompt, as transformers expands it
        logits = _feed(backend, memories, torch.tensor([prompt[at : at + chunk]] * n, dtype=torch.long))  # (N, V)

    running = torch.zeros((n, budget), dtype=torch.long)  # (N, G) generated ids of the running beams
    running_scores = torch.full((n,), NEG)  # (N,) only beam 0 is live at first: the rows are identical
    running_scores[0] = 0.0
    finished = torch.zeros((n, budget), dtype=torch.long)  # (N, G)
    finished_scores = torch.full((n,), NEG)  # (N,)
    finished_len = torch.zeros(n, dtype=torch.long)  # (N,)
    is_finished = torch.zeros(n, dtype=torch.bool)  # (N,) finished slot holds a real hypothesis
    top_n = torch.arange(keep) < n  # (K,) only the top N candidates may become finished hypotheses
    improvable = True
    cur = 0  # tokens generated so far by every running beam
    while True:
        vocab = logits.shape[-1]
        scores = torch.log_softmax(logits.float(), dim=-1) + running_scores[:, None]  # (N, V)
        cand_scores, flat = torch.topk(scores.reshape(-1), keep)  # (K,)
        src = flat // vocab  # (K,) beam each candidate extends
        cand = running[src]  # (K, G)
        cand[:, cur] = flat % vocab
        ends = torch.isin(cand[:, cur], eos) | (cur + 1 >= budget)  # (K,)

        # The best N candidates that did not end keep running.
        run_scores = cand_scores + ends.float() * NEG
        nxt = torch.topk(run_scores, n).indices  # (N,)
        running, running_scores, parents = cand[nxt], run_scores[nxt], src[nxt]

        # Ended candidates among the top N compete with the finished hypotheses for the N finished slots.
        fin = cand_scores / ((cur + 1) ** lp)
        if settings.early_stopping and bool(is_finished.all()):
            fin = fin + NEG
        if not improvable:
            fin = fin + NEG
        fin = fin + (~(ends & top_n)).float() * NEG
        merged = torch.topk(torch.cat((finished_scores, fin)), n).indices  # (N,)
        finished = torch.cat((finished, cand))[merged]
        finished_scores = torch.cat((finished_scores, fin))[merged]
        finished_len = torch.cat((finished_len, torch.full((keep,), cur + 1)))[merged]
        is_finished = torch.cat((is_finished, ends & top_n))[merged]
        cur += 1

        worst = torch.where(is_finished, finished_scores.min(), torch.tensor(NEG))  # (N,)
        improvable = improvable and bool((running_scores[0] / (cur**lp) > worst).any())
        all_done = settings.early_stopping and bool(is_finished.all())
        if not improvable or all_done or bool(ends.all()):
            break
        backend.copy_rows(parents)
        tokens = [memories[int(p)].tokens for p in parents]
        for m, t in zip(memories, tokens):
            m.tokens = list(t)
        logits = _feed(backend, memories, running[:, cur - 1 : cur])  # (N, V)

    order = torch.argsort(finished_scores, descending=True, stable=True)
    return BeamResult(
        [BeamHypothesis(finished[i, : finished_len[i]].tolist(), float(finished_scores[i])) for i in order.tolist() if is_finished[i]]
    )
