"""The real thing on the default model: a pass key planted in an attached document many windows long is answered
from the capsule's blocks the question pages in (engine.documents), where the conversation's own window never held
the document."""

from __future__ import annotations

from pathlib import Path

from engine.documents.attach import Attachments
from engine.documents.extract import extract
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.session.engine import Engine, memory_factory_for
from tests.helpers.default_model import default_model_dir

FILL = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TEXT = FILL * 60 + "The pass key is 48213. Remember it. 48213 is the pass key. " + FILL * 60


def test_the_default_model_answers_from_an_attached_document(tmp_path: Path) -> None:
    model = default_model_dir()
    factory = memory_factory_for(model, cache_dir=tmp_path / "cache", window=512)
    engine = Engine.load(model, "cpu", memory_factory=factory, quantize="auto")
    session = engine.new_session()
    attachments = Attachments(session.memory, engine.tokenizer)
    item = attachments.attach_document(extract("filler.txt", TEXT.encode()))
    assert item.capsule.tokens > 4 * 512
    settings = GenerationSettings(max_tokens=8, sampling=SamplingSettings(greedy=True))
    answer = []
    for i, ev in enumerate(session.complete(FILL * 4 + "\nWhat is the pass key? The pass key is", settings)):
        if i == 0:
            attachments.observe()
        answer.append(ev.text)
    assert "48213" in "".join(answer)
    assert any("48213" in c.text for c in attachments.recalled)  # the citation shows the passage it drew on
