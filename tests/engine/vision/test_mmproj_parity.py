"""SmolVLM / Idefics3 from a GGUF and its llama.cpp mmproj, exported from the tiny checkpoint transformers wrote:
greedy tokens equal transformers' `generate` over 24 tokens for a prompt with one picture and with two (an f32
export exactly; a Q8_0 text model with an f16 mmproj against transformers running the very weights the files
store), through the loader directly, through the engine's front door (the mmproj found beside the model) and
through `generate --mmproj`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.weights import load_model
from engine.openai.metrics import Metrics
from engine.openai.models import LoadSettings, loader_for
from engine.openai.pool import Servable
from engine.openai.service import ServeConfig
from engine.session.engine import load
from engine.vision.mmproj import read_mmproj
from tests.helpers.hf_greedy import hf_vision_model, hf_vision_tokens
from tests.helpers.mmproj_refs import EXPORTS, causal_greedy, exported, our_prompt, ours_from_gguf
from tests.helpers.pictures import CASES, picture, pictures_of, png
from tests.helpers.tiny_idefics3 import make_tiny_idefics3

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[3]
STEPS = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3") / "SmolTiny")


@pytest.fixture(scope="module")
def exports(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    return exported(folder, tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def theirs(folder: Path) -> tuple[Any, Any]:
    return hf_vision_model(transformers.Idefics3ForConditionalGeneration, folder)


def on_stored_weights(hf_model: Any, text: Path, mmproj: Path) -> Any:
    """A copy of transformers' model holding exactly the weights the two files store (dequantized)."""
    import copy

    model = copy.deepcopy(hf_model)
    state = {
        ("lm_head.weight" if n == "lm_head.weight" else n.replace("model.", "model.text_model.", 1)): t
        for n, t in load_model(text).model.state_dict().items()
    }
    state.update(dict(read_mmproj(mmproj).state_dict()))
    params = dict(model.state_dict())
    assert set(params) <= set(state), sorted(set(params) - set(state))[:3]
    model.load_state_dict({n: state[n] for n in params}, strict=True)
    return model


@pytest.mark.parametrize("kind", sorted(EXPORTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_transformers(
    kind: str, case: str, exports: dict[str, tuple[Path, Path]], theirs: tuple[Any, Any]
) -> None:
    text_file, mmproj = exports[kind]
    prompt, sizes = CASES[case]
    pictures = pictures_of(sizes)
    model, vision = ours_from_gguf(text_file, mmproj)
    hf_model, processor = theirs
    if kind != "f32":
        hf_model = on_stored_weights(hf_model, text_file, mmproj)
    inputs = processor(text=prompt, images=[p.image for p in pictures], return_tensors="pt")

    ids, plain, frames = our_prompt(vision, prompt, pictures)
    assert np.array_equal(np.concatenate([f.pixels for f in frames]), inputs["pixel_values"][0].numpy())
    assert plain == inputs["input_ids"][0].tolist()  # the GGUF's vocabulary tokenizes as the folder's

    assert causal_greedy(model, vision, ids, STEPS) == hf_vision_tokens(hf_model, inputs, STEPS)


def test_front_door_finds_the_mmproj_beside_the_model(
    folder: Path, exports: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    settings = GenerationSettings(max_tokens=STEPS, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))
    pictures = [picture(40, 24, 0)]
    replies = []
    for model in (folder, exports["f32"][0]):
        engine = load(model, "cpu", cache_dir=tmp_path / model.name)
        assert engine.vision is not None
        session = engine.new_session()
        replies.append([e.token for e in session.chat("What is it?", settings, images=pictures) if e.token is not None])
    assert engine.mmproj == exports["f32"][1]
    assert replies[0] == replies[1] and len(replies[0]) == STEPS


def test_generate_with_mmproj_flag(exports: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    text_file, mmproj = exports["f32"]
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / text_file.name).write_bytes(text_file.read_bytes())  # no projector beside it: --mmproj names one
    (tmp_path / "pic.png").write_bytes(png(40, 24, 0))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path)}
    base = [sys.executable, "-m", "engine", "generate", "--model", str(alone / text_file.name), "--backend", "cpu"]
    args = [*base, "--chat", "--prompt", "What is it?", "--image", str(tmp_path / "pic.png")]
    args += ["--max-tokens", "4", "--greedy", "--json", "--no-prefix-cache"]
    refused = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert refused.returncode != 0 and "image" in refused.stderr.lower() and "Traceback" not in refused.stderr
    foreign = subprocess.run(  # a text model named as the projector: one line, no traceback
        [*args, "--mmproj", str(text_file)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert foreign.returncode != 0 and "is not a projector file" in foreign.stderr
    assert len(foreign.stderr.strip().splitlines()) == 1
    done = subprocess.run(
        [*args, "--mmproj", str(mmproj)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["tokens"]) == 4


@pytest.mark.parametrize("compact", [False, True])
def test_session_file_restores_and_continues(
    exports: dict[str, tuple[Path, Path]], tmp_path: Path, compact: bool
) -> None:
    settings = GenerationSettings(max_tokens=6, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))
    text_file = exports["q8_0"][0]
    session = load(text_file, "cpu", prefix_cache=False).new_session()
    list(session.chat("What is it?", settings, images=[picture(40, 24, 3)]))
    path = tmp_path / "pictures.spark"
    session.save(path, compact=compact)
    expected = [e.token for e in session.chat("And now?", settings) if e.token is not None]

    restored = load(text_file, "cpu", prefix_cache=False).new_session()  # another engine: no picture held
    assert restored.load(path).applied
    assert [e.token for e in restored.chat("And now?", settings) if e.token is not None] == expected


def test_the_servers_loader_keeps_the_named_projector(exports: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """`serve --mmproj`: a model unloaded and loaded again by the pool sees images again."""
    text_file, mmproj = exports["f32"]
    alone = tmp_path / "alone" / text_file.name
    alone.parent.mkdir()
    alone.write_bytes(text_file.read_bytes())  # no projector beside it
    settings = LoadSettings(backend="cpu", prefix_cache=False)
    config = ServeConfig(model_id="tiny")
    named = loader_for(LoadSettings(backend="cpu", prefix_cache=False, projectors=((alone, mmproj),)))
    assert named(Servable("tiny", alone, 0), config, Metrics()).vision is not None
    assert loader_for(settings)(Servable("tiny", alone, 0), config, Metrics()).vision is None
