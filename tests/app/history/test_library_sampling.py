"""A conversation's own sampling in the library's index: kept across reopening, and a hostile stored value refused
in one sentence (that conversation follows the app's setting; every other row loads)."""

from __future__ import annotations

import json
from pathlib import Path

from app.history.library import ConversationLibrary
from app.settings.sampling_choice import SamplingChoice
from engine import SamplingSettings

A, B = "0123456789abcdef", "fedcba9876543210"


def test_the_choice_is_kept_and_an_index_without_it_loads(tmp_path: Path) -> None:
    lib = ConversationLibrary(tmp_path)
    lib.load()
    lib.set_sampling(A, SamplingChoice(False, SamplingSettings(temperature=0.4, seed=2)))  # not stored yet
    lib.path_for(A).write_bytes(b"x")
    lib.record(A, [("user", "hi")], "m")
    lib.record(A, [("user", "hi"), ("assistant", "hello")], "m")  # a later store keeps it
    lib.close()
    again = ConversationLibrary(tmp_path)
    again.load()
    assert again.sampling_for(A) == SamplingChoice(False, SamplingSettings(temperature=0.4, seed=2))
    index = json.loads((tmp_path / "index.json").read_text(encoding="utf-8"))
    for row in index["conversations"]:
        del row["sampling"]  # an index written before conversations had their own sampling
    (tmp_path / "index.json").write_text(json.dumps(index), encoding="utf-8")
    old = ConversationLibrary(tmp_path)
    old.load()
    assert old.get(A) is not None and old.sampling_for(A) is None and not old.load_error


def test_a_hostile_stored_choice_is_refused_in_one_sentence(tmp_path: Path) -> None:
    rows = [
        {
            "id": A,
            "title": "Bad one",
            "created": 1.0,
            "updated": 2.0,
            "model": "m",
            "sampling": {"use_model_defaults": False, "own": {"temperature": 1e308, "repetition_penalty": -3}},
        },
        {
            "id": B,
            "title": "Good one",
            "created": 1.0,
            "updated": 1.0,
            "model": "m",
            "sampling": {"use_model_defaults": True, "own": {"seed": 4}},
        },
    ]
    for cid in (A, B):
        (tmp_path / f"{cid}.spark").write_bytes(b"x")
    (tmp_path / "index.json").write_text(json.dumps({"version": 1, "conversations": rows}), encoding="utf-8")
    lib = ConversationLibrary(tmp_path)
    lib.load()
    assert lib.load_error.startswith("The sampling stored with “Bad one” could not be used (the sampling temperature")
    assert lib.load_error.endswith("it follows the app's setting now.") and "\n" not in lib.load_error
    assert lib.get(A) is not None and lib.sampling_for(A) is None
    assert lib.sampling_for(B) == SamplingChoice(True, SamplingSettings(seed=4))
