"""Reasoning models: whether a model thinks before it answers, how its thinking is switched, and the streaming split
of a reply into its reasoning and its answer.

What a model does is read off its chat template (and vocabulary), the way llama.cpp and vLLM detect it:
  - a template that reads `enable_thinking` (Qwen3) is switched by that variable; off, it closes an empty think
    block in the prompt itself;
  - a template that handles `/think` and `/no_think` (SmolLM3) is switched by that command in the system message;
  - a template that writes `<think>` (DeepSeek-R1's distills, which open the block in the prompt) reasons but has
    no switch.
Whether the reply starts inside the block is read off the rendered prompt: its last `<think>` is not closed.

The split works on the streamed text, not on token ids, so a tag split across tokens (a vocabulary without a
`<think>` token), a block never closed (the budget ran out), nested blocks and stray closing tags all come out the
same whichever tokenizer made them: the outer block is reasoning, nested tags stay text inside it, a stray `</think>`
in the answer is dropped, and whitespace around the block's edges belongs to neither part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

OPEN, CLOSE = "<think>", "</think>"


class Think(StrEnum):
    """The thinking a request asks for: the model's own default, or on or off where the model has a switch."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class ThinkSwitch(StrEnum):
    NONE = "none"  # cannot be switched (or does not reason)
    FLAG = "flag"  # the template variable `enable_thinking` (Qwen3)
    COMMAND = "command"  # "/think" or "/no_think" in the system message (SmolLM3)


@dataclass(frozen=True)
class ReasoningStyle:
    reasons: bool  # the model writes a think block before its answer
    switch: ThinkSwitch = ThinkSwitch.NONE
    keeps_reasoning: bool = False  # the template reads earlier turns' `reasoning_content` and decides what to show

    @property
    def can_switch(self) -> bool:
        return self.switch is not ThinkSwitch.NONE


NOT_REASONING = ReasoningStyle(False)


def reasoning_style(template: str | None, vocabulary: frozenset[str] = frozenset()) -> ReasoningStyle:
    """What a model with this chat template (and these vocabulary entries, e.g. its added tokens) does."""
    t = template or ""
    if "enable_thinking" in t:
        switch = ThinkSwitch.FLAG
    elif "/no_think" in t:
        switch = ThinkSwitch.COMMAND
    else:
        switch = ThinkSwitch.NONE
    reasons = switch is not ThinkSwitch.NONE or OPEN in t or (OPEN in vocabulary and CLOSE in vocabulary)
    if not reasons:
        return NOT_REASONING
    return ReasoningStyle(True, switch, "reasoning_content" in t)


def think_tokens(token_to_id: Callable[[str], int | None]) -> frozenset[str]:
    """The think tags a vocabulary holds as tokens of their own (metadata that says a model reasons)."""
    return frozenset(tag for tag in (OPEN, CLOSE) if token_to_id(tag) is not None)


def switched(
    style: ReasoningStyle, think: Think, messages: list[dict[str, Any]], extra: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The template's messages and variables with `think` applied where the model has a switch (AUTO: as they
    are, the model's own default). A model without one gets them unchanged: callers that must not guess ask
    `style.can_switch` first."""
    if think is Think.AUTO or not style.can_switch:
        return messages, extra
    if style.switch is ThinkSwitch.FLAG:
        return messages, {**extra, "enable_thinking": think is Think.ON}
    command = "/think" if think is Think.ON else "/no_think"
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        first = {**messages[0], "content": f"{messages[0]['content']}\n{command}".lstrip("\n")}
        return [first, *messages[1:]], extra
    return [{"role": "system", "content": command}, *messages], extra


def history(style: ReasoningStyle, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier turns as the template gets them: an assistant message's `reasoning_content` stays only where the
    template reads it (it then decides which turns show it); otherwise earlier thinking is not sent back."""
    if style.keeps_reasoning:
        return messages
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]


def opens_in_prompt(rendered: str) -> bool:
    """The rendered prompt leaves a think block open (R1-style templates, Qwen3's thinking variants): the reply
    starts inside it."""
    return rendered.rfind(OPEN) > rendered.rfind(CLOSE)


@dataclass(frozen=True)
class ReasoningFormat:
    """How one reply is split (GenerationSettings.reasoning): `inside` when the prompt opened the block."""

    inside: bool = False


def _held_prefix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (could still become one)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class ReasoningSplitter:
    """Streamed reply text in, (reasoning, answer) deltas out. Holds back only what could still be a tag, and
    whitespace at an edge of the block (trailing whitespace of the reasoning, leading whitespace of either part)."""

    def __init__(self, fmt: ReasoningFormat = ReasoningFormat()) -> None:
        self.depth = 1 if fmt.inside else 0
        self.pending = ""  # text not yet given out (a possible tag)
        self.trailing = ""  # the reasoning's whitespace, given out only when more reasoning follows it
        self.at_edge = True  # at the start of a part: its leading whitespace is dropped
        self.reasoned = fmt.inside  # a block was opened in this reply (or its prompt)

    def push(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning: list[str] = []
        answer: list[str] = []
        while self.pending:
            opened, closed = self.pending.find(OPEN), self.pending.find(CLOSE)
            hits = [(i, tag) for i, tag in ((opened, OPEN), (closed, CLOSE)) if i >= 0]
            if not hits:
                keep = _held_prefix(self.pending, (OPEN, CLOSE))
                self._give(self.pending[: len(self.pending) - keep], reasoning, answer)
                self.pending = self.pending[len(self.pending) - keep :]
                break
            i, tag = min(hits)
            before, self.pending = self.pending[:i], self.pending[i + len(tag) :]
            self._give(before, reasoning, answer)
            self._tag(tag, reasoning)
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """The end of the reply: what was held back is text of the part it was in (a block never closed stays
        reasoning); the reasoning's trailing whitespace is dropped."""
        reasoning: list[str] = []
        answer: list[str] = []
        self._give(self.pending, reasoning, answer)
        self.pending = self.trailing = ""
        return "".join(reasoning), "".join(answer)

    def _give(self, text: str, reasoning: list[str], answer: list[str]) -> None:
        if self.at_edge:
            text = text.lstrip()
            if not text:
                return
            self.at_edge = False
        if self.depth > 0:
            body = text.rstrip()
            if body:
                reasoning.append(self.trailing + body)
                self.trailing = text[len(body) :]
            else:
                self.trailing += text
        else:
            answer.append(text)

    def _tag(self, tag: str, reasoning: list[str]) -> None:
        if tag == OPEN:
            if self.depth > 0:  # nested: text of the outer block
                self._give(tag, reasoning, [])
            else:
                self.at_edge, self.reasoned = True, True
            self.depth += 1
        elif self.depth > 1:
            self.depth -= 1
            self._give(tag, reasoning, [])
        elif self.depth == 1:
            self.depth, self.trailing, self.at_edge = 0, "", True
        # else: a stray closing tag in the answer is dropped


def split_text(text: str, fmt: ReasoningFormat = ReasoningFormat()) -> tuple[str, str]:
    """A whole reply's (reasoning, answer)."""
    splitter = ReasoningSplitter(fmt)
    r1, a1 = splitter.push(text)
    r2, a2 = splitter.flush()
    return r1 + r2, a1 + a2
