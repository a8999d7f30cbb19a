"""The training pipeline on a tiny config: corpus, tokenizer, steps, checkpoints, resume, export.

Seconds, not minutes: three small stdlib modules, a 2-layer 32-wide model, 64-token context. The real recipe
(`python -m engine train`) never runs in tests; the bundled model it produced is checked for shape and format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors.torch import load_file

from engine.cli import main as cli_main
from engine.train.bpe import BOS, CHAT_TEMPLATE, END, SPECIAL_TOKENS, chat_text, save_tokenizer, train_bpe
from engine.train.corpus import SIDE_EFFECT_MODULES, build_corpus, render_module, stdlib_top_modules
from engine.train.loop import (
    CASCADE_DEFAULTS,
    Data,
    TrainConfig,
    advance_progress,
    batch_at,
    build_model,
    fit_total_steps,
    loss_on,
    lr_at,
    make_optimizer,
    new_state,
    prepare_data,
    run,
    save_checkpoint,
    seq_len_at,
    train_step,
)
from engine.weights import load_model

MODULES = ["colorsys", "queue", "shlex"]  # `queue` falls in the hash-chosen held-out split
BUNDLED = Path(__file__).resolve().parents[2] / "resources" / "models" / "spark-mini"


def tiny_cfg(out: Path) -> TrainConfig:
    return TrainConfig(
        out=out,
        steps=4,
        threads=1,
        vocab_size=320,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        seq_len=64,
        short_seq_len=32,
        short_fraction=0.5,
        batch_tokens=256,
        lr=1e-2,
        warmup_steps=1,
        modules=MODULES,
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A work folder with the tiny corpus and tokenizer prepared once; tests copy its data/."""
    out = tmp_path_factory.mktemp("base")
    prepare_data(tiny_cfg(out))
    return out


def fresh(base: Path, out: Path) -> tuple[TrainConfig, Data]:
    shutil.copytree(base / "data", out / "data")
    cfg = tiny_cfg(out)
    return cfg, prepare_data(cfg)


def test_corpus_holds_out_whole_modules_and_is_deterministic() -> None:
    corpus = build_corpus(MODULES)
    assert corpus.eval_modules == ["queue"]
    assert set(corpus.train_pages) == {"colorsys", "shlex"} and set(corpus.eval_pages) == {"queue"}
    assert not any("queue" in q for q, _ in corpus.train_chats)
    assert any(q == "What does shlex.split do?" for q, _ in corpus.train_chats)
    page = corpus.train_pages["shlex"]
    assert "split(s, comments=False, posix=True)" in page and "\nFILE" not in page and "\nDATA" not in page and " at 0x" not in page
    assert build_corpus(MODULES).digest() == corpus.digest()


def test_side_effect_modules_are_never_imported() -> None:
    assert SIDE_EFFECT_MODULES.isdisjoint(stdlib_top_modules())
    assert {"antigravity", "this", "tkinter", "turtle", "idlelib"} <= SIDE_EFFECT_MODULES
    assert render_module("no_such_module_spark") == {"pages": {}, "entries": []}


def test_bpe_round_trips_and_chat_template_matches_training_format(tmp_path: Path) -> None:
    text = "def f(x):\n    return x  # Ünïcödé 日本 🙂\n" * 20
    tok = train_bpe([text, chat_text("What?", "That.")], vocab_size=300)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.decode(tok.encode(text).ids) == text
    save_tokenizer(tok, tmp_path, 1024)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["chat_template"]) == (BOS, END, CHAT_TEMPLATE)
    rendered = jinja2.Template(config["chat_template"]).render(
        bos_token=BOS, messages=[{"role": "user", "content": "What?"}, {"role": "assistant", "content": "That."}]
    )
    assert rendered == BOS + chat_text("What?", "That.")
    ids = tok.encode(rendered).ids
    assert ids.count(tok.token_to_id(END)) == 2 and ids[0] == tok.token_to_id(BOS)


def test_schedule_is_monotone_when_the_total_is_replanned(tmp_path: Path) -> None:
    cfg = TrainConfig(out=tmp_path, warmup_steps=5, short_fraction=0.5)
    # Fixed total: progress is (step + 1 - warmup) / (total - warmup) and reaches exactly 1 on the last step.
    progress = 0.0
    for step in range(20):
        progress = advance_progress(cfg, step, progress, 20)
        assert progress == pytest.approx(max(0, step + 1 - 5) / 15)
    assert progress == 1.0
    # A shared machine: the total swings up and down, as re-planning does; lr only falls, context only grows.
    totals = [60, 30, 120, 40, 200, 50]
    progress, lrs, seqs, step = 0.0, [], [], 0
    while progress < 1.0:
        total = max(step + 1, totals[(step // 7) % len(totals)])
        lrs.append(lr_at(cfg, step, progress))
        seqs.append(seq_len_at(cfg, progress))
        progress = advance_progress(cfg, step, progress, total)
        step += 1
    after_warmup = lrs[cfg.warmup_steps :]
    assert all(a >= b for a, b in zip(after_warmup, after_warmup[1:])) and seqs == sorted(seqs)
    assert seqs[0] == cfg.short_seq_len and seqs[-1] == cfg.seq_len
    # The planner fits the budget: 10 s at 1 s/step (short) and 2 s/step (long), half of progress each.
    times = {str(cfg.short_seq_len): 1.0, str(cfg.seq_len): 2.0}
    assert fit_total_steps(TrainConfig(out=tmp_path, warmup_steps=0, short_fraction=0.5), 0, 0.0, 12.0, times) == 8


def test_three_steps_reduce_loss(base: Path, tmp_path: Path) -> None:
    cfg, data = fresh(base, tmp_path)
    model = build_model(cfg, data.tokenizer, torch.device("cpu"))
    opt = make_optimizer(model, cfg)
    probe = batch_at(data.train, cfg.seed, 0, 8, cfg.short_seq_len)
    with torch.no_grad():
        before = float(loss_on(model, probe))
    progress = 0.0
    for step in range(3):
        train_step(model, opt, cfg, step, progress, data.train, torch.device("cpu"))
        progress = advance_progress(cfg, step, progress, 3)
    with torch.no_grad():
        after = float(loss_on(model, probe))
    assert after < before - 0.1


def test_resume_equals_uninterrupted_and_export_loads(base: Path, tmp_path: Path) -> None:
    # Uninterrupted: 4 steps through the real entry point.
    cfg_a, _ = fresh(base, tmp_path / "a")
    summary = run(cfg_a)
    assert summary["step"] == 4 and summary["tokens_seen"] == 4 * 256 and summary["heldout_ppl"] > 1
    # Interrupted: 2 steps, checkpoint, then `run(..., resume=True)` finishes the same 4-step schedule.
    cfg_b, data_b = fresh(base, tmp_path / "b")
    model = build_model(cfg_b, data_b.tokenizer, torch.device("cpu"))
    opt = make_optimizer(model, cfg_b)
    state = new_state(cfg_b, data_b, 4, {})
    for step in range(2):
        train_step(model, opt, cfg_b, step, state["progress"], data_b.train, torch.device("cpu"))
        state["progress"] = advance_progress(cfg_b, step, state["progress"], 4)
        state["step"] += 1
        state["tokens_seen"] += 256
    save_checkpoint(model, opt, state, cfg_b.out / "checkpoint")
    # As if killed between save_checkpoint's two renames: only checkpoint.old is left, and resume recovers it.
    (cfg_b.out / "checkpoint").rename(cfg_b.out / "checkpoint.old")
    run(cfg_b, resume=True)
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(cfg_a.out / "checkpoint" / name)), load_file(str(cfg_b.out / "checkpoint" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    # The exported folders are byte-identical, load through the production loader, and keep their fingerprint.
    exp_a, exp_b = cfg_a.out / "model", cfg_b.out / "model"
    for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "cascade.json"):
        assert (exp_a / f).read_bytes() == (exp_b / f).read_bytes(), f
    loaded = load_model(exp_a)
    assert loaded.fingerprint == load_model(exp_a).fingerprint == load_model(exp_b).fingerprint
    assert loaded.config.max_position_embeddings == 64 and loaded.config.tie_word_embeddings
    assert json.loads((exp_a / "cascade.json").read_text()) == CASCADE_DEFAULTS
    assert {t.dtype for t in load_file(str(exp_a / "model.safetensors")).values()} == {torch.float16}
    # fp16 export scores like the fp32 checkpoint it came from.
    trained = build_model(cfg_a, data_b.tokenizer, torch.device("cpu"))
    trained.load_state_dict(load_file(str(cfg_a.out / "checkpoint" / "model.safetensors")), strict=False)
    rows = batch_at(data_b.eval, 0, 0, 2, 64)
    with torch.no_grad():
        assert abs(float(loss_on(trained, rows)) - float(loss_on(loaded.model, rows))) < 1e-2


def test_cli_refuses_to_resume_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["train", "--out", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: There is no checkpoint") and "\n" not in err


def test_bundled_model_covers_cascade_positions() -> None:
    config = json.loads((BUNDLED / "config.json").read_text())
    cascade = json.loads((BUNDLED / "cascade.json").read_text())
    reach = cascade["sink_tokens"] + cascade["retrieval_blocks"] * cascade["block_size"] + cascade["window"]
    assert config["max_position_embeddings"] >= 1024 >= reach
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_theta"] == 10000.0
    assert sum(f.stat().st_size for f in BUNDLED.iterdir()) < 40 * 1024 * 1024
    loaded = load_model(BUNDLED)
    assert loaded.fingerprint == load_model(BUNDLED).fingerprint
