"""The cascade on the real default model (skipped where the model is absent): a fact pushed out of a small forced
window by later turns comes back through retrieval."""

from __future__ import annotations

from pathlib import Path

from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.session.engine import Engine, memory_factory_for
from tests.helpers.default_model import default_model_dir

GREEDY = GenerationSettings(max_tokens=24, sampling=SamplingSettings(temperature=0.0))


def test_a_fact_from_the_first_turn_comes_back_after_leaving_the_window(tmp_path: Path) -> None:
    model = default_model_dir()
    factory = memory_factory_for(
        model, prefix_cache=False, window=128, block_size=32, retrieval_blocks=4, sink_tokens=4
    )
    session = Engine.load(model, "cpu", memory_factory=factory).new_session()
    "".join(ev.text for ev in session.chat("Remember this: my cat's name is Whiskerton.", GREEDY))
    first_turn = len(session.memory.tokens)
    for question in (
        "Name a color of the sky.",
        "What is two plus two?",
        "Name a fruit that is yellow.",
        "What do bees make?",
    ):
        "".join(ev.text for ev in session.chat(question, GREEDY))
    reply = "".join(ev.text for ev in session.chat("What is my cat's name?", GREEDY))
    memory = session.memory
    assert memory.working.evicted + memory.cfg.sink_tokens > first_turn  # the whole first turn left the window
    assert "Whiskert" in reply, reply
