"""Tools as a Session feature: `chat(..., tools=)` offers them under the grammar the server's `tool_choice` uses, so
even a random tiny model's call parses; a reply that calls them ends in FinishReason.TOOL_CALLS and a ToolCalls event;
`tool_results` hands results back and the reply continues on the memory it has; Regenerate drops a turn's calls and
results; the settings' rules (a JSON reply keeps its schema, a thinking model stays free) hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import SparkError
from engine.generation.constrained import json_object_grammar
from engine.generation.loop import FinishReason, GenerationEvent, GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.session.engine import Engine, Session, memory_factory_for
from engine.tools.calls import Tool, ToolCalls, ToolChoice, ToolSpec
from engine.tools.grammar import tool_grammar, tool_settings
from engine.tools.template import FALLBACK_SYSTEM, TOOL_ROLE
from tests.helpers.default_model import default_model_dir
from tests.helpers.fixtures import TinyModel
from tests.helpers.tool_specs import add_tool

ADD = add_tool("add")
INTS = {"a": {"type": "integer"}, "b": {"type": "integer"}}  # unbounded: what the model picks is its own
FORCED = ToolSpec((ADD,), ToolChoice.REQUIRED, parallel=False)  # a random model calls `add`, once per reply
SETTINGS = GenerationSettings(max_tokens=160, sampling=SamplingSettings(seed=0))


@pytest.fixture
def session(tiny: TinyModel, tmp_path: Path) -> Session:
    # No prefix cache: every token the memory holds was computed by this session (so `computed` tells a re-read).
    factory = memory_factory_for(tiny.path, cache_dir=tmp_path / "l3", prefix_cache=False)
    engine = Engine.load(tiny.path, "cpu", memory_factory=factory)
    return engine.new_session()


def split(events: list[GenerationEvent | ToolCalls]) -> tuple[list[GenerationEvent], list[ToolCalls]]:
    replies = [e for e in events if isinstance(e, GenerationEvent)]
    return replies, [e for e in events if isinstance(e, ToolCalls)]


def test_a_forced_call_parses_and_its_result_continues_the_reply(session: Session) -> None:
    events = list(session.chat("Add two numbers.", SETTINGS, tools=FORCED))
    replies, calls = split(events)
    assert events[-1] is calls[0] and len(calls) == 1  # the calls come last, once the reply has ended
    assert replies[-1].finish_reason is FinishReason.TOOL_CALLS
    (call,) = calls[0].calls
    args = json.loads(call.arguments)
    assert call.name == "add" and set(args) == {"a", "b"} and all(0 <= v <= 99 for v in args.values())
    assert calls[0].content == ""  # nothing but the call
    # The transcript keeps the call as the text the model wrote; the tools were described to the model.
    assert session.messages[-1].role == "assistant" and "<tool_call>" in session.messages[-1].content
    assert session.messages[-1].content == "".join(e.text for e in replies)
    assert FALLBACK_SYSTEM.split("\n")[0] in session.known_text and '"name": "add"' in session.known_text
    held = len(session.memory.tokens)
    computed = session.computed.count

    result = json.dumps({"sum": args["a"] + args["b"]})
    more_replies, more_calls = split(list(session.tool_results([result], SETTINGS, choice=ToolChoice.REQUIRED)))
    assert [m.role for m in session.messages] == ["user", "assistant", TOOL_ROLE, "assistant"]
    assert session.messages[2].content == result  # as given: the file keeps the caller's own form
    assert f"<tool_response>\n{result}\n</tool_response>" in session.known_text  # the fallback's tool turn
    # The reply went on from the memory it had: only the result's turn and the new reply were computed.
    assert session.computed.count - computed == len(session.memory.tokens) - held
    assert more_replies[-1].finish_reason is FinishReason.TOOL_CALLS and len(more_calls) == 1  # still forced


def test_regenerate_drops_the_turns_calls_and_results(session: Session) -> None:
    list(session.chat("Add two numbers.", SETTINGS, tools=FORCED))
    list(session.tool_results(['{"sum": 1}'], SETTINGS))
    assert session.tools is not None and session.tools.choice is ToolChoice.AUTO  # results go back under `auto`
    events = list(session.regenerate(SETTINGS, tools=FORCED))
    assert [m.role for m in session.messages] == ["user", "assistant"]
    assert isinstance(events[-1], ToolCalls)


def test_without_tools_a_reply_is_only_its_events(session: Session) -> None:
    events = list(session.chat("Hello.", GenerationSettings(max_tokens=8, sampling=SamplingSettings(seed=0))))
    assert all(isinstance(e, GenerationEvent) for e in events)
    assert events[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert session.tools is None and FALLBACK_SYSTEM.split("\n")[0] not in session.known_text
    with pytest.raises(SparkError, match="no tool calls to answer"):
        session.tool_results(["{}"], SETTINGS)


def test_a_reply_offering_tools_is_held_to_their_schemas_unless_it_has_its_own_grammar() -> None:
    # `auto`: the grammar the server uses for tool_choice "auto" (free text; a started <tool_call> must be a valid
    # call of an offered tool), unless the reply already has a grammar or the model thinks in special tokens a
    # grammar cannot emit.
    spec = ToolSpec((ADD,), ToolChoice.AUTO)
    plain = GenerationSettings(max_tokens=32)
    turn = tool_settings(plain, spec, reasons=False)
    assert turn.grammar is not None and plain.grammar is None  # the caller's settings object is left as it was
    assert turn.grammar == tool_grammar(spec)
    as_json = GenerationSettings(grammar=json_object_grammar())
    assert tool_settings(as_json, spec, reasons=False) is as_json  # a JSON reply keeps its own schema
    assert tool_settings(plain, spec, reasons=True) is plain  # a thinking model's think tokens stay reachable
    # A schema that admits no grammar: an `auto` reply goes free, a forced one is refused in one sentence.
    deep: dict[str, object] = {"type": "object"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"x": deep}}
    bad = Tool("deep", "", deep)
    assert tool_settings(plain, ToolSpec((bad,), ToolChoice.AUTO), reasons=False) is plain
    with pytest.raises(SparkError, match="'deep'"):
        tool_settings(plain, ToolSpec((bad,), ToolChoice.REQUIRED), reasons=False)


def test_the_default_model_calls_a_forced_tool_with_the_numbers_asked(tmp_path: Path) -> None:
    model = default_model_dir()
    engine = Engine.load(model, "cpu", memory_factory=memory_factory_for(model, cache_dir=tmp_path / "l3"))
    session = engine.new_session()
    add = ToolSpec((Tool("add", "Add two integers.", {**ADD.parameters, "properties": INTS}),), ToolChoice.REQUIRED)
    greedy = GenerationSettings(max_tokens=64, sampling=SamplingSettings(greedy=True))
    events = list(session.chat("What is 17 plus 25?", greedy, tools=add))
    assert isinstance(events[-1], ToolCalls)
    (call,) = events[-1].calls
    assert call.name == "add" and json.loads(call.arguments) == {"a": 17, "b": 25}
    replies, _ = split(list(session.tool_results(["42"], greedy)))
    assert replies[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS)
    assert session.messages[-1].role == "assistant" and session.messages[-1].content  # it answered
