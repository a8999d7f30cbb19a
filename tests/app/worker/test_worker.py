"""The worker on its own, through its client: the default model answers, and a Stop while a prompt is read leaves
the memory holding exactly a prefix of what the transcript says (the rest is read with the next message)."""

from __future__ import annotations

import threading
from pathlib import Path

from PySide6.QtCore import Qt

from app.worker.types import ReadProgress, TurnResult
from engine import GenerationSettings, SamplingSettings
from tests.helpers.app_window import WAIT_MS, running_client
from tests.helpers.default_model import default_model_dir

GREEDY = GenerationSettings(max_tokens=24, sampling=SamplingSettings(greedy=True))
LONG = "A long prompt is read in chunks, and Stop may come between any two of them. " * 60


def test_the_default_model_answers_paris_through_the_worker(qtbot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with running_client(qtbot, tmp_path, default_model_dir(), "auto") as client:
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS * 4) as blocker:
            client.send("What is the capital of France?", GREEDY)
        result: TurnResult = blocker.args[0]
        assert result.reason in ("stop", "length")
        assert "Paris" in result.text


def test_stop_while_reading_leaves_memory_equal_to_the_transcript(qtbot, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    with running_client(qtbot, tmp_path, tiny_model) as client:
        asked = threading.Event()

        def on_reading(p: ReadProgress) -> None:  # on the worker thread (direct): Stop while the prompt is read
            if 0 < p.done < p.total and not asked.is_set():
                asked.set()
                client.stop()

        client.worker.reading.connect(on_reading, Qt.ConnectionType.DirectConnection)
        settings = GenerationSettings(max_tokens=8, prefill_chunk=32, sampling=SamplingSettings(seed=0))
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS) as blocker:
            client.send(LONG, settings)
        result: TurnResult = blocker.args[0]
        assert asked.is_set() and result.reason == "cancelled" and result.progress.generated_tokens == 0
        session = client.worker.session
        assert session is not None
        held = session.tokenizer.decode(list(session.memory.tokens), skip_special=False)
        transcript = session.tokenizer.apply_chat_template(
            [{"role": r.role, "content": r.content} for r in session.messages], add_generation_prompt=True
        )
        assert [m.role for m in session.messages] == ["user"]  # the question stays; no empty reply
        assert 0 < len(session.memory.tokens) == result.memory_tokens
        assert transcript.startswith(held) and len(held) < len(transcript)  # a true prefix: part of it was read
        assert session.known_text == held
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS) as blocker:
            client.send("Go on.", settings)  # the rest is read now, and the conversation goes on
        assert blocker.args[0].reason in ("stop", "length")
        held = session.tokenizer.decode(list(session.memory.tokens), skip_special=False)
        assert LONG.strip() in held and "Go on." in held
