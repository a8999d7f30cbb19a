"""q8_0 keys and values (llama.cpp's --cache-type-k/v q8_0): llama.cpp's bytes, half the table, read as fp16,
close to the fp16 table's logits, and exact through paging and session files (quantizing a reading changes
nothing)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.backends import BackendChoice
from engine.backends.torch_backend import TorchBackend
from engine.errors import BackendUnavailable, SessionFileError
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.model.kv_types import KVType, dequantize_q8_0, quantize_q8_0
from engine.model.slots import KVCache
from engine.session.engine import Engine, memory_factory_for
from engine.session.file import load_session
from engine.session.save import save_session
from tests.helpers.tiny import make_tiny_model

GREEDY = GenerationSettings(max_tokens=10, sampling=SamplingSettings(greedy=True), ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head dim 32: one q8_0 block per head row
    return make_tiny_model(tmp_path_factory.mktemp("kvq") / "m", heads=2, kv_heads=1)


@pytest.mark.parametrize("scale", [3.0, 0.01, 1e-5])
def test_q8_0_writes_llamacpps_bytes_and_its_reading_quantizes_to_itself(scale: float) -> None:
    x = torch.randn(3, 2, 40, 64, generator=torch.Generator().manual_seed(0)) * scale  # (..., D)
    x[0, 0, 0, :32] = 0  # an all-zero block: scale 0
    codes, scales = quantize_q8_0(x)
    ours = torch.cat(
        [scales.reshape(-1, 1).view(torch.uint8).reshape(-1, 2), codes.reshape(-1, 32).view(torch.uint8)], 1
    )  # (blocks, 34): d then 32 codes, as ggml lays a block_q8_0 out
    theirs = gguf.quants.quantize(x.reshape(-1, 64).numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)
    assert np.array_equal(ours.numpy(), theirs)
    reading = dequantize_q8_0(codes, scales)  # fp16
    assert reading.dtype == torch.float16
    again = quantize_q8_0(reading)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scales)


def test_unknown_kv_type_and_unfit_head_dim_are_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="f16, q8_0"):
        KVType.named("q4_0")
    odd = make_tiny_model(tmp_path / "odd")  # head dim 16
    with pytest.raises(BackendUnavailable, match="multiple of 32"):
        TorchBackend(odd, kv_type=KVType.Q8_0)


def test_q8_0_table_holds_about_half_and_stays_close_to_fp16(model: Path) -> None:
    ids = list(range(3, 40))
    f16, q8 = TorchBackend(model), TorchBackend(model, kv_type=KVType.Q8_0)
    per_f16 = KVCache.bytes_per_slot(f16.config, torch.float16, False, torch.float32)
    per_q8 = KVCache.bytes_per_slot(q8.config, torch.float16, False, torch.float32, KVType.Q8_0)
    assert per_q8 * 32 == per_f16 * 17  # 34 bytes per 32 values, not 64
    assert q8.numerics != f16.numerics  # L3 entries of one are never reused by the other
    outs = []
    for b in (f16, q8):
        engine = Engine(
            BackendChoice(b, ()), Tokenizer.load(model), model, memory_factory_for(model, prefix_cache=False)
        )
        s = engine.new_session()
        events = list(s.complete_ids(ids, GREEDY))
        outs.append([e.token for e in events])
        assert s.backend.kv_type is b.kv_type
    assert q8.cache.k.dtype == torch.int8 and q8.cache.k_scale.dtype == torch.float16
    assert q8.cache.allocated_bytes() < f16.cache.allocated_bytes()
    assert outs[0][:4] == outs[1][:4]  # a random tiny model: the first greedy tokens agree


def test_paging_a_q8_0_table_out_and_back_is_exact(model: Path) -> None:
    b = TorchBackend(model, kv_type=KVType.Q8_0)
    engine = Engine(BackendChoice(b, ()), Tokenizer.load(model), model, memory_factory_for(model, prefix_cache=False))
    s = engine.new_session()
    list(s.complete_ids(list(range(3, 30)), GREEDY))
    slots = torch.arange(20)
    k, v = s.backend.read_kv(0, slots)  # (L, Hkv, n, D) fp16 readings
    twin = TorchBackend(model, kv_type=KVType.Q8_0)
    twin.write_kv(0, slots, k, v)
    table = s.backend.inner.cache if hasattr(s.backend, "inner") else b.cache  # type: ignore[attr-defined]
    for name in ("k", "v", "k_scale", "v_scale"):
        assert torch.equal(twin.cache.get_buffer(name)[:, :, :, :20], table.get_buffer(name)[:, :, :, :20]), name


def test_a_q8_0_session_restores_exactly_and_only_on_q8_0(model: Path, tmp_path: Path) -> None:
    def engine(kv: KVType) -> Engine:
        factory = memory_factory_for(model, cache_dir=tmp_path / "l3", window=32, block_size=8, retrieval_blocks=2)
        return Engine(BackendChoice(TorchBackend(model, kv_type=kv), ()), Tokenizer.load(model), model, factory)

    q8 = engine(KVType.Q8_0)
    whole = q8.new_session()
    first = [e.token for e in whole.chat("hello there, a longer first turn to fill the window", GREEDY)]
    path = tmp_path / "q8.spark"
    whole.save(path)
    assert load_session(path).kv_type == "q8_0"
    then = [e.token for e in whole.chat("and then?", GREEDY)]
    restored = q8.new_session()
    report = restored.load(path)
    assert report.applied and restored.memory.tokens == whole.memory.tokens[: len(restored.memory.tokens)]
    assert [e.token for e in restored.chat("and then?", GREEDY)] == then
    assert first
    other = engine(KVType.F16).new_session()
    refused = other.load(path)
    assert not refused.applied and "q8_0 keys and values" in refused.message


def test_a_kv_type_this_version_does_not_know_is_refused_in_one_sentence(tmp_path: Path) -> None:
    path = tmp_path / "odd.spark"
    save_session(
        path,
        fingerprint="f" * 16,
        tokenizer_hash=None,
        messages=[],
        system_prompt=None,
        settings={},
        memory_state=({"kind": "transcript"}, {}),
        pending_token=None,
        sampler_state=None,
        kv_type="q3_x",
    )
    with pytest.raises(SessionFileError, match="keys and values of a type this version does not know") as err:
        load_session(path)
    assert "\n" not in str(err.value)


def test_open_backend_holds_the_kv_type_asked_for(model: Path) -> None:
    from engine.backends import open_backend

    choice = open_backend(model, "cpu", kv_type=KVType.Q8_0)
    assert choice.backend.kv_type is KVType.Q8_0
    assert choice.backend.cache.k.dtype == torch.int8  # type: ignore[attr-defined]


def test_generate_takes_kv_type(model: Path, tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt", "hello", "--max-tokens"]
    cmd += ["3", "--greedy", "--json", "--no-prefix-cache", "--backend", "cpu", "--kv-type"]
    env = {**os.environ, "HOME": str(tmp_path)}
    out = subprocess.run([*cmd, "q8_0"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["tokens"]) == 3
    bad = subprocess.run([*cmd, "q4_0"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "invalid choice" in bad.stderr and "Traceback" not in bad.stderr
