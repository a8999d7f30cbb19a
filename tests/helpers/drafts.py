"""A drafter for speculative-decoding tests: it proposes a known continuation, wrong where a test wants a rejection."""

from __future__ import annotations

from engine.generation.speculative import Draft


class Reference:
    """Drafts the reference continuation, wrong at one position of each draft (None: always right)."""

    def __init__(self, reference: list[int], prompt_len: int, wrong: int | None) -> None:
        self.reference, self.prompt_len, self.wrong = reference, prompt_len, wrong

    def propose(self, context: list[int], k: int) -> Draft:
        at = len(context) - self.prompt_len
        draft = self.reference[at : at + k]
        if self.wrong is not None and self.wrong < len(draft):
            draft[self.wrong] = (draft[self.wrong] + 1) % 300
        return Draft(draft, None)
