"""A reasoning model's turns (a tiny Qwen3 with Qwen3's own chat template): thinking switched on and off renders as
transformers renders it, the transcript and session files keep the reasoning apart from the answer, and earlier
thinking goes back to the model only as the template asks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.generation.constrained import grammar_from_file_text
from engine.generation.loop import GenerationSettings
from engine.generation.reasoning import Think, ThinkSwitch
from engine.generation.sampling import SamplingSettings
from engine.session.engine import Engine, memory_factory_for
from tests.helpers.reasoning import ANSWER, THINKING_REPLY, THOUGHT
from tests.helpers.tiny_families import make_tiny_qwen3


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "m", think_tokens=False)


@pytest.fixture
def engine(qwen3: Path, tmp_path: Path) -> Engine:
    return Engine.load(qwen3, "cpu", memory_factory=memory_factory_for(qwen3, cache_dir=tmp_path / "l3"))


def hf_render(model: Path, messages: list[dict[str, Any]], **extra: Any) -> str:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model)
    text: str = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    return text


def settings(think: Think = Think.AUTO, grammar: str | None = THINKING_REPLY) -> GenerationSettings:
    g = grammar_from_file_text(grammar, "test grammar") if grammar else None
    return GenerationSettings(max_tokens=64, sampling=SamplingSettings(greedy=True), grammar=g, think=think)


def test_the_template_says_qwen3_reasons_with_a_switch(engine: Engine) -> None:
    style = engine.reasoning
    assert style.reasons and style.switch is ThinkSwitch.FLAG and style.keeps_reasoning


@pytest.mark.parametrize(("think", "extra"), [(Think.AUTO, {}), (Think.ON, {"enable_thinking": True}),
                                              (Think.OFF, {"enable_thinking": False})])  # fmt: skip
def test_thinking_on_and_off_render_as_transformers_renders_them(
    engine: Engine, qwen3: Path, think: Think, extra: dict[str, Any]
) -> None:
    session = engine.new_session()
    session.system_prompt = "Be brief."
    list(session.chat("Hello?", GenerationSettings(max_tokens=1, think=think)))
    want = hf_render(
        qwen3, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}], **extra
    )
    assert session.known_text.startswith(want)
    assert want.endswith("<think>\n\n</think>\n\n") == (think is Think.OFF)


def test_the_transcript_keeps_reasoning_apart_and_the_next_turn_renders_as_transformers(
    engine: Engine, qwen3: Path, tmp_path: Path
) -> None:
    session = engine.new_session()
    events = list(session.chat("What is Python?", settings()))
    assert "".join(e.reasoning for e in events) == THOUGHT
    assert "".join(e.text for e in events) == ANSWER
    assert (session.messages[-1].content, session.messages[-1].reasoning) == (ANSWER, THOUGHT)
    list(session.chat("And the fox?", settings(grammar='start: "ok"')))
    # Qwen3's template reads `reasoning_content` and drops thinking before the last user query.
    turns = [
        {"role": "user", "content": "What is Python?"},
        {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
        {"role": "user", "content": "And the fox?"},
    ]
    want = hf_render(qwen3, turns)
    assert session.known_text.startswith(want) and THOUGHT not in want
    # A session file keeps the reasoning apart, and it comes back.
    path = tmp_path / "t.spark"
    session.save(path, compact=True)
    other = engine.new_session()
    other.load(path)
    assert [(m.content, m.reasoning) for m in other.messages if m.role == "assistant"] == [
        (ANSWER, THOUGHT),
        ("ok", ""),
    ]


def test_generate_think_and_json_reasoning(qwen3: Path, tmp_path: Path) -> None:
    from tests.helpers.engine_cli import engine_cli

    grammar = tmp_path / "reply.lark"
    grammar.write_text(THINKING_REPLY)
    common = ["generate", "--model", str(qwen3), "--prompt", "Hi", "--chat", "--grammar", str(grammar), "--json"]
    r = engine_cli(*common, "--think", "on", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["reasoning"], out["text"]) == (THOUGHT, ANSWER)
    r = engine_cli(*common[:-3], "--think", "off", "--max-tokens", "2", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    r = engine_cli("generate", "--model", str(qwen3), "--prompt", "Hi", "--think", "off", cache=tmp_path)
    assert r.returncode == 2 and "--chat" in r.stderr


def test_think_tokens_of_the_vocabulary_split_as_spelled_ones(tmp_path: Path) -> None:
    """Qwen3's vocabulary holds `<think>` and `</think>` as tokens of their own: a scripted reply through a session
    (the sampler replaced by the script) splits the same."""
    from engine.generation.sampling import Sample

    model = make_tiny_qwen3(tmp_path / "m")
    engine = Engine.load(model, "cpu", memory_factory=memory_factory_for(model, cache_dir=tmp_path / "l3"))
    tok = engine.tokenizer
    script = tok.encode(f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}", add_bos=False) + [*tok.eos_ids][:1]
    assert tok.encode("<think>", add_bos=False) == [tok.token_to_id("<think>")]
    assert engine.reasoning.reasons  # the template says so, and so does the vocabulary
    session = engine.new_session()
    steps = iter(script)
    session._sampler_for = lambda s: lambda logits: Sample(next(steps), 0.0)  # type: ignore[method-assign,assignment,misc]
    events = list(session.chat("Hi", GenerationSettings(max_tokens=100)))
    assert ("".join(e.reasoning for e in events), "".join(e.text for e in events)) == (THOUGHT, ANSWER)
