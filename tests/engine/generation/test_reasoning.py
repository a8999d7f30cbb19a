"""The split of a streamed reply into reasoning and answer, and what a chat template says about a model's thinking."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.generation.loop import GenerationSettings, Reply
from engine.generation.reasoning import (
    ReasoningFormat,
    ReasoningSplitter,
    ReasoningStyle,
    Think,
    ThinkSwitch,
    history,
    opens_in_prompt,
    reasoning_style,
    split_text,
    switched,
    think_tokens,
)
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from tests.helpers.fixtures import TinyModel


@pytest.mark.parametrize(
    ("text", "inside", "want"),
    [
        ("<think>\nI ponder.\n</think>\n\nHello there", False, ("I ponder.", "Hello there")),
        ("Hello there", False, ("", "Hello there")),
        ("<think>\n\n</think>\n\nHi", False, ("", "Hi")),  # Qwen3's empty block (thinking off)
        ("I ponder.\n</think>\n\nHi", True, ("I ponder.", "Hi")),  # R1: the prompt opened the block
        ("<think>still thinking when the budget ran out", False, ("still thinking when the budget ran out", "")),
        ("<think>a <think>b</think> c</think>done", False, ("a <think>b</think> c", "done")),  # nested: text inside
        ("Hi</think> there", False, ("", "Hi there")),  # a stray closing tag is dropped
        ("<think>x</think>", False, ("x", "")),
        ("<thin", False, ("", "<thin")),  # a tag that never completed is text
        ("<think>a < b and c </ d</think>ok", False, ("a < b and c </ d", "ok")),
    ],
)
def test_a_reply_splits_into_reasoning_and_answer(text: str, inside: bool, want: tuple[str, str]) -> None:
    assert split_text(text, ReasoningFormat(inside)) == want


@given(st.lists(st.integers(1, 7), max_size=40), st.booleans())
def test_any_chunking_splits_as_the_whole_text(cuts: list[int], inside: bool) -> None:
    text = "  <think>\nfirst <think>inner</think> thought\n\n</think>\n\nThe answer</think> is 42 <t"
    pieces, at = [], 0
    for n in cuts:
        pieces.append(text[at : at + n])
        at += n
    pieces.append(text[at:])
    s = ReasoningSplitter(ReasoningFormat(inside))
    got = [s.push(p) for p in pieces] + [s.flush()]
    assert ("".join(r for r, _ in got), "".join(a for _, a in got)) == split_text(text, ReasoningFormat(inside))


def _events(tokenizer: Tokenizer, text: str, settings: GenerationSettings) -> tuple[str, str, list[str]]:
    """Feed `text`'s tokens one by one through the loop's Reply, as a model sampling them would."""
    ids = tokenizer.encode(text, add_bos=False)
    reply = Reply(tokenizer, 3, settings)
    events = []
    for t in ids:
        events.append(reply.accept(t, 0.0))
        if events[-1].finish_reason is not None:
            break
    else:
        events.append(reply.cancel())
    answer = "".join(e.text for e in events)
    return "".join(e.reasoning for e in events), answer, [e.text for e in events]


def test_scripted_token_streams_split_with_tags_across_tokens(tiny: TinyModel) -> None:
    tok = tiny.tokenizer
    text = "<think>\nThe quick fox.\n</think>\n\nPython is a language."
    assert len(tok.encode("<think>", add_bos=False)) > 1  # the tiny vocabulary has no tag token: it spans several
    settings = GenerationSettings(max_tokens=500, sampling=SamplingSettings(greedy=True), reasoning=ReasoningFormat())
    reasoning, answer, pieces = _events(tok, text, settings)
    assert (reasoning, answer) == ("The quick fox.", "Python is a language.")
    assert not any("<" in p for p in pieces)  # no piece of a tag ever reaches the answer
    # Never closed: the budget ends the reply inside the block, and all of it is reasoning.
    n = len(tok.encode("<think>\nThe quick fox", add_bos=False))
    short = GenerationSettings(max_tokens=n, sampling=SamplingSettings(greedy=True), reasoning=ReasoningFormat())
    assert _events(tok, text, short)[:2] == ("The quick fox", "")
    # Without a reasoning format the reply is all answer, tags and all (a model that does not reason).
    plain = GenerationSettings(max_tokens=500, sampling=SamplingSettings(greedy=True))
    assert _events(tok, text, plain)[:2] == ("", text)


def test_stop_strings_are_found_in_the_whole_text(tiny: TinyModel) -> None:
    tok = tiny.tokenizer
    settings = GenerationSettings(
        max_tokens=500, stop=("lazy",), sampling=SamplingSettings(greedy=True), reasoning=ReasoningFormat(True)
    )
    reasoning, answer, _ = _events(tok, "The quick brown fox</think>jumps over the lazy dog.", settings)
    assert (reasoning, answer) == ("The quick brown fox", "jumps over the ")


def test_templates_say_how_a_model_thinks() -> None:
    qwen3 = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    qwen3 += "{{ message.reasoning_content }}"
    smol = '{% if "/no_think" in system_message %}{% set reasoning_mode = "/no_think" %}{% endif %}'
    r1 = "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
    assert reasoning_style(qwen3) == ReasoningStyle(True, ThinkSwitch.FLAG, keeps_reasoning=True)
    assert reasoning_style(smol) == ReasoningStyle(True, ThinkSwitch.COMMAND)
    assert reasoning_style(r1) == ReasoningStyle(True, ThinkSwitch.NONE)
    assert not reasoning_style("{{ messages }}").reasons and not reasoning_style(None).reasons
    assert reasoning_style("{{ messages }}", frozenset({"<think>", "</think>"})).reasons
    assert think_tokens({"<think>": 5, "</think>": 6}.get) == frozenset({"<think>", "</think>"})
    assert think_tokens({}.get) == frozenset()
    assert opens_in_prompt("<｜Assistant｜><think>\n") and not opens_in_prompt("<think>\n\n</think>\n\n")
    msgs = [{"role": "user", "content": "hi"}]
    flag = reasoning_style(qwen3)
    assert switched(flag, Think.OFF, msgs, {}) == (msgs, {"enable_thinking": False})
    assert switched(flag, Think.AUTO, msgs, {}) == (msgs, {})
    cmd = reasoning_style(smol)
    assert switched(cmd, Think.OFF, msgs, {})[0][0] == {"role": "system", "content": "/no_think"}
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    assert switched(cmd, Think.ON, sys_msgs, {})[0][0]["content"] == "Be brief.\n/think"
    past = [{"role": "assistant", "content": "4", "reasoning_content": "2+2"}]
    assert history(flag, past) == past
    assert history(reasoning_style(r1), past) == [{"role": "assistant", "content": "4"}]
