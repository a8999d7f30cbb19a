"""The real thing on the default model: a pass key said in an earlier conversation many windows long is answered
from that conversation's stored memory (a full .spark) recalled into a new one, with nothing read through the model
(engine.documents.recall)."""

from __future__ import annotations

from pathlib import Path

from engine.documents.attach import Attachments
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.session.engine import Engine, memory_factory_for
from tests.helpers.default_model import default_model_dir

FILL = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
# "Hello there." places the key's sentence inside one block of the conversation's own block grid (where a block
# boundary splits "The pass key is" from "48213", retrieval pages in the filler instead: a limit of the blocks).
TEXT = FILL * 60 + "Hello there. The pass key is 48213. Remember it. 48213 is the pass key. " + FILL * 60


def test_the_default_model_answers_from_a_recalled_conversations_memory(tmp_path: Path) -> None:
    model = default_model_dir()
    factory = memory_factory_for(model, cache_dir=tmp_path / "cache", window=512)
    engine = Engine.load(model, "cpu", memory_factory=factory, quantize="auto")
    earlier = engine.new_session()
    for _ in earlier.complete(TEXT, GenerationSettings(max_tokens=1, sampling=SamplingSettings(greedy=True))):
        pass
    assert len(earlier.memory.tokens) > 4 * 512
    saved = tmp_path / "earlier.spark"
    earlier.save(saved)  # full: its memory is in the file
    session = engine.new_session()
    attachments = Attachments(session.memory, engine.tokenizer)
    item = attachments.recall_session(saved)
    assert item.capsule.read_tokens == 0 and session.computed.count == 0 and not attachments.notes
    settings = GenerationSettings(max_tokens=8, sampling=SamplingSettings(greedy=True))
    answer = []
    prompt = FILL * 4 + "\nWhat is the pass key? The pass key is"
    for i, ev in enumerate(session.complete(prompt, settings)):
        if i == 0:
            attachments.observe()
        answer.append(ev.text)
    assert "48213" in "".join(answer)
    assert any("48213" in c.text for c in attachments.recalled)
    assert session.computed.count < len(engine.tokenizer.encode(prompt)) + 8  # the question and answer only
