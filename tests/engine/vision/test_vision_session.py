"""Pictures through the engine's front door: a conversation about an image answers as transformers does, a second
question about the same picture encodes nothing again and restores its tokens from the prefix cache, a text-only
model refuses in one sentence, and `generate --image` does the same from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.generation.loop import GenerationSettings, PrefillProgress
from engine.generation.sampling import SamplingSettings
from engine.session.engine import Engine, Session, load
from engine.vision.images import DecodedImage
from engine.vision.model import ImageEmbedding, ImageInputError
from tests.helpers.pictures import picture, png
from tests.helpers.tiny import make_tiny_model
from tests.helpers.tiny_idefics3 import make_tiny_idefics3

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[3]
STEPS = 24
GREEDY = GenerationSettings(max_tokens=STEPS, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


def frames_encoded(engine: Engine) -> int:
    assert engine.vision is not None and isinstance(engine.vision.embedding, ImageEmbedding)
    return engine.vision.embedding.encoded_frames


def ask(session: Session, text: str, images: list[DecodedImage]) -> tuple[list[int], list[PrefillProgress]]:
    seen: list[PrefillProgress] = []
    session.on_prefill = seen.append
    tokens = [e.token for e in session.chat(text, GREEDY, images=images) if e.token is not None]
    return tokens, seen


def test_chat_about_pictures_equals_transformers(folder: Path, tmp_path: Path) -> None:
    engine = load(folder, "cpu", cache_dir=tmp_path / "cache")
    pictures = [picture(40, 24, 0), picture(60, 14, 1)]
    session = engine.new_session()
    tokens, _ = ask(session, "Which of the two is wider?", pictures)
    rendered = session._render(add_generation_prompt=False)  # the prompt as fed: the reply's text follows it
    prompt = rendered[: rendered.rindex("<|assistant|>\n") + len("<|assistant|>\n")]
    assert prompt.count("<image>") == 2

    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    inputs = processor(text=prompt, images=[p.image for p in pictures], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert tokens == out[0, inputs["input_ids"].shape[1] :].tolist()


def test_second_question_about_the_same_picture_encodes_nothing(folder: Path, tmp_path: Path) -> None:
    engine = load(folder, "cpu", cache_dir=tmp_path / "cache")
    pic = picture(40, 24, 2)
    long_question = "Describe the picture: the quick brown fox jumps over the lazy dog, twice, in Python. " * 2
    first, seen = ask(engine.new_session(), long_question, [pic])
    assert seen[-1].reused == 0 and frames_encoded(engine) == 5  # a 2 x 2 tiling and the global view

    # Another question about it in the same process: its tokens restored, nothing encoded again.
    _, seen = ask(engine.new_session(), "What else?", [pic])
    assert seen[-1].reused > 0 and frames_encoded(engine) == 5

    # A new process (a fresh engine on the same prefix cache) asked the same: the picture is neither encoded nor
    # read again, and the answer is the same.
    again = load(folder, "cpu", cache_dir=tmp_path / "cache")
    tokens, seen = ask(again.new_session(), long_question, [pic])
    assert again.vision is not None
    image_positions = 3 + 4 * 6 + 2 + 1 + 7  # bos, <|user|>, \n; 2 x 2 tiles; row ends; \n; the global view
    assert seen[-1].reused >= image_positions and frames_encoded(again) == 0
    assert tokens == first


def test_a_restored_prefix_cutting_a_picture_encodes_only_the_frames_read_again(folder: Path, tmp_path: Path) -> None:
    pic = picture(64, 40, 7)
    first = load(folder, "cpu", cache_dir=tmp_path / "cache")
    ask(first.new_session(), "Describe the picture in a few words, please.", [pic])
    assert frames_encoded(first) == 5
    # A new process asks a shorter question: the stored prefix blocks end inside the picture, so its tail is read
    # again, and only the frames that tail holds are encoded (each frame alone: the same rows as a whole encode).
    again = load(folder, "cpu", cache_dir=tmp_path / "cache")
    tokens, seen = ask(again.new_session(), "What?", [pic])
    assert 0 < seen[-1].reused < seen[-1].total and 0 < frames_encoded(again) < 5
    cold = load(folder, "cpu", prefix_cache=False)
    assert tokens == ask(cold.new_session(), "What?", [pic])[0]


def test_text_only_model_refuses_pictures(tmp_path: Path) -> None:
    engine = load(make_tiny_model(tmp_path / "text"), "cpu", prefix_cache=False)
    assert engine.vision is None
    with pytest.raises(ImageInputError, match="reads text only; choose a model that sees images"):
        engine.new_session().chat("What is this?", GREEDY, images=[picture(8, 8, 0)])


def test_marker_count_must_match_and_a_new_chat_lets_go(folder: Path) -> None:
    engine = load(folder, "cpu", prefix_cache=False)
    session = engine.new_session()
    with pytest.raises(ImageInputError, match="places 1 images but 2 were given"):
        session.chat("<image> and?", GREEDY, images=[picture(8, 8, 0), picture(9, 8, 0)])
    ask(session, "<image> what is it?", [picture(8, 8, 0)])
    with pytest.raises(ImageInputError, match="marks where a picture goes"):
        session.chat("and this <image>?", GREEDY)
    session.reset()  # a new chat lets go of the pictures
    assert session.images == []


def engine_cli(*args: str, home: Path) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "MLOT_SPARK_CACHE_DIR": str(home / "cache"), "PYTHONPATH": str(ROOT)}
    for var in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HOME"):
        env[var] = str(home)
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, env=env, cwd=ROOT, timeout=600)


def test_generate_image_flag(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png(40, 24, 3))
    (tmp_path / "bad.png").write_bytes(png(40, 24, 3)[:100])
    common = ["generate", "--model", str(folder), "--backend", "cpu", "--no-prefix-cache", "--chat", "--greedy"]
    r = engine_cli(
        *common, "--image", str(tmp_path / "a.png"), "--prompt", "What?", "--max-tokens", "8", "--json", home=tmp_path
    )
    assert r.returncode == 0, r.stderr.decode()
    out: dict[str, Any] = json.loads(r.stdout)
    engine = load(folder, "cpu", prefix_cache=False)
    settings = GenerationSettings(max_tokens=8, sampling=SamplingSettings(temperature=0.0))
    expected = [e.token for e in engine.new_session().chat("What?", settings, images=[picture(40, 24, 3)])]
    assert out["tokens"] == [t for t in expected if t is not None]

    r = engine_cli(*common, "--image", str(tmp_path / "bad.png"), "--prompt", "What?", home=tmp_path)
    assert r.returncode != 0 and b"bad.png is truncated or damaged" in r.stderr and b"Traceback" not in r.stderr
    text_model = make_tiny_model(tmp_path / "text")
    r = engine_cli(
        "generate",
        "--model",
        str(text_model),
        "--backend",
        "cpu",
        "--no-prefix-cache",
        "--chat",
        "--image",
        str(tmp_path / "a.png"),
        "--prompt",
        "What?",
        home=tmp_path,
    )
    assert r.returncode != 0 and b"reads text only" in r.stderr and b"Traceback" not in r.stderr


def test_chat_image_command(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png(40, 24, 4))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path)}
    lines = f"/image {tmp_path / 'a.png'}\nWhat is it?\n/image {tmp_path / 'missing.png'}\n/quit\n"
    common = ["--backend", "cpu", "--no-prefix-cache", "--greedy", "--max-tokens", "4"]
    r = subprocess.run(
        [sys.executable, "-m", "engine", "chat", "--model", str(folder), *common],
        input=lines.encode(),
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr.decode()
    assert b"(image a.png attached to the next message)" in r.stdout
    assert b"missing.png cannot be read" in r.stderr and b"Traceback" not in r.stderr
    text_model = make_tiny_model(tmp_path / "text")
    r = subprocess.run(
        [sys.executable, "-m", "engine", "chat", "--model", str(text_model), *common],
        input=f"/image {tmp_path / 'a.png'}\n/quit\n".encode(),
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0 and b"reads text only" in r.stderr


SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_a_template_that_reads_content_parts(tmp_path: Path) -> None:
    folder = make_tiny_idefics3(tmp_path / "smolvlm")
    (folder / "chat_template.jinja").write_text(SMOLVLM_TEMPLATE)
    pic = picture(40, 24, 6)
    engine = load(folder, "cpu", prefix_cache=False)
    session = engine.new_session()
    tokens, _ = ask(session, "What is it?", [pic])
    assert session._render(add_generation_prompt=False).startswith("<|im_start|>User:<image>What is it?")

    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[pic.image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert tokens == out[0, inputs["input_ids"].shape[1] :].tolist()
