"""The MLX backend against the torch backend on the CPU (`mlx-cpu` in CI; the same graph runs on Metal on a Mac):
every family's logits and greedy tokens, the default model from its GGUF, sessions moving between the two, the
cascade past its window, a Stop between layers, a batch of rows, speculative verifies. Skipped where mlx cannot be
imported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("mlx.core")

import mlx.core as mx

from engine.backends import REGISTRY, open_backend
from engine.backends.base import Backend
from engine.backends.mlx import probe_mlx
from engine.backends.mlx.backend import MLXBackend
from engine.backends.mlx.weights import MLX_BITS, repack
from engine.backends.torch_backend import TorchBackend
from engine.errors import BackendUnavailable, ModelLoadError
from engine.generation.loop import GenerationSettings, prefill, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.generation.speculative import Controller, Speculation, Speculator
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory
from engine.memory.cascade import CascadeConfig, CascadeMemory
from engine.model.kv_types import KVType
from engine.model.quant import BlockType, StoredTensor, dequantize, quantize
from engine.model.slots import SlotBatch
from engine.session.file import RestoredSession, restore
from engine.session.save import save_session
from tests.helpers.default_model import default_model_dir
from tests.helpers.drafts import Reference
from tests.helpers.gguf_files import random_blocks
from tests.helpers.stopping import StopAt
from tests.helpers.tiny import make_tiny_model
from tests.helpers.tiny_families import FAMILIES, make_tiny_family

GREEDY = SamplingSettings(greedy=True)
# A cascade whose window the tests' replies slide past, paging blocks back in (as tests/engine/backends/test_cuda.py).
SMALL = CascadeConfig(sink_tokens=4, window=24, block_size=8, retrieval_blocks=2)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers (the shared `tiny` has 2): a cascade past its window needs room for sinks, window and groups."""
    return make_tiny_model(tmp_path_factory.mktemp("mlx") / "tiny", layers=4, max_positions=512)


def tokens(b: Backend, mem: Memory, tok: Tokenizer, prompt: list[int], n: int) -> list[int]:
    settings = GenerationSettings(max_tokens=n, sampling=GREEDY, ignore_eos=True)
    return [e.token for e in stream_generate(b, mem, tok, prompt, settings) if e.token is not None]


def memory(kind: str, b: Backend) -> Memory:
    if kind == "full":
        b.allocate(1, 256)
        return FullAttentionMemory(b)
    return CascadeMemory(b, SMALL)


def test_the_probe_says_mlx_runs_and_where() -> None:
    probe = probe_mlx()
    assert probe.available and "MLX" in probe.reason
    assert ("Apple GPU" in probe.reason) == mx.metal.is_available()
    assert "mlx" in REGISTRY


def test_without_mlx_the_probe_says_how_to_add_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "mlx.core", None)  # `import mlx.core` now raises ImportError
    probe = probe_mlx()
    assert not probe.available and probe.reason == "MLX is not installed (pip install -e '.[mlx]' adds it)."


@pytest.mark.parametrize("qtype", sorted(MLX_BITS, key=lambda t: t.name))
def test_gguf_blocks_repack_into_mlx_groups_exactly(qtype: BlockType) -> None:
    import gguf

    w = np.random.default_rng(0).normal(0, 0.1, (6, 512)).astype(np.float32)
    if qtype.quantizable:
        raw = quantize(w, qtype)
    elif qtype is BlockType.Q5_1:  # no quantizer here: random bits under small, finite d and m
        blocks = np.random.default_rng(1).integers(0, 256, (6, 16, qtype.block_bytes), dtype=np.uint8)
        blocks[:, :, 0:4] = np.array([0.004, -0.05], np.float16).view(np.uint8)
        raw = blocks.reshape(6, -1)
    else:  # no quantizer here: random valid blocks, their scales' top bits included
        raw = random_blocks(w, gguf.GGMLQuantizationType[qtype.name])
    q = repack(StoredTensor(qtype.name, (6, 512), raw), mx.float32)
    got = np.array(mx.dequantize(q.packed, q.scales, q.biases, group_size=32, bits=q.bits))
    np.testing.assert_array_equal(got, dequantize(raw, qtype, (6, 512)))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", *FAMILIES])
def test_logits_and_32_greedy_tokens_equal_the_torch_backends(tmp_path: Path, four_layers: Path, family: str) -> None:
    if family == "llama":
        d = four_layers
    elif family in ("mistral", "qwen2"):
        d = make_tiny_model(tmp_path / family, family, layers=2, max_positions=512)
    else:
        d = make_tiny_family(tmp_path / family, family)
    tok = Tokenizer.from_dir(d)
    prompt = tok.encode(PROMPT)
    ours, ref = MLXBackend(d, quantize="none"), TorchBackend(d)
    ours.allocate(1, 256)
    ref.allocate(1, 256)
    got = prefill(ours, FullAttentionMemory(ours), prompt, 16)
    want = prefill(ref, FullAttentionMemory(ref), prompt, 16)
    assert got is not None and want is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.query_summary(), ref.query_summary(), rtol=1e-4, atol=1e-4)
    per_token = ours.token_summaries()  # the last chunk's tokens (at most 16), each as it alone would give
    assert per_token is not None and per_token.shape[0] == (len(prompt) - 1) % 16 + 1
    torch.testing.assert_close(per_token, ref.token_summaries(), rtol=1e-4, atol=1e-4)
    o, r = MLXBackend(d, quantize="none"), TorchBackend(d)
    assert tokens(o, memory("full", o), tok, prompt, 32) == tokens(r, memory("full", r), tok, prompt, 32)


def test_the_default_models_gguf_gives_our_greedy_tokens() -> None:
    path = default_model_dir()
    tok = Tokenizer.load(path)
    ours = MLXBackend(path)  # its Q4_1 and Q8_0 blocks as MLX affine groups, exactly
    assert ours.quantize == "q4_1" and "4-bit affine" in ours.kernels_note
    ref = TorchBackend(path, quantize="auto")  # what users run: the same blocks on our native kernels
    for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"):
        prompt = tok.encode(text)
        got = tokens(ours, memory("full", ours), tok, prompt, 32)
        assert got == tokens(ref, memory("full", ref), tok, prompt, 32), text


def test_an_hf_folder_as_q8_0_runs_the_blocks_the_cpu_backend_runs(four_layers: Path) -> None:
    tok = Tokenizer.from_dir(four_layers)
    prompt = tok.encode(PROMPT)
    ours, ref = MLXBackend(four_layers, quantize="q8_0"), TorchBackend(four_layers, quantize="q8_0", kernels="torch")
    assert ours.quantize == "q8_0" and ours.numerics != MLXBackend(four_layers, quantize="none").numerics
    ours.allocate(1, 256)
    ref.allocate(1, 256)
    got = prefill(ours, FullAttentionMemory(ours), prompt, 16)
    want = prefill(ref, FullAttentionMemory(ref), prompt, 16)
    assert got is not None and want is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_cascade_past_its_window_gives_the_torch_backends_tokens(four_layers: Path) -> None:
    tok = Tokenizer.from_dir(four_layers)
    prompt = tok.encode(PROMPT)
    o, r = MLXBackend(four_layers, quantize="none"), TorchBackend(four_layers)
    mo, mr = CascadeMemory(o, SMALL), CascadeMemory(r, SMALL)
    got = tokens(o, mo, tok, prompt, 40)
    assert len(mo.tokens) > SMALL.sink_tokens + SMALL.window  # past the window: blocks evicted and paged back
    assert got == tokens(r, mr, tok, prompt, 40)


@pytest.mark.parametrize(("saver", "opener"), [("mlx", "torch"), ("torch", "mlx")])
def test_a_session_saved_on_one_backend_continues_on_the_other(
    four_layers: Path, tmp_path: Path, saver: str, opener: str
) -> None:
    """The canonical fp16 KV crosses unchanged: the memory is reused (not recomputed) and the reply continues as it
    would have on the saving backend. The numerics differ, so their prefix caches stay apart."""

    def make(kind: str) -> Backend:
        b: Backend = MLXBackend(four_layers, quantize="none") if kind == "mlx" else TorchBackend(four_layers)
        b.allocate(1, 256)
        return b

    tok = Tokenizer.from_dir(four_layers)
    prompt = tok.encode(PROMPT)
    whole = make(saver)
    reference = tokens(whole, FullAttentionMemory(whole), tok, prompt, 24)
    first = make(saver)
    mem = FullAttentionMemory(first)
    head = tokens(first, mem, tok, prompt, 12)
    path = tmp_path / "chat.spark"
    save_session(
        path,
        fingerprint=first.fingerprint,
        tokenizer_hash=None,
        messages=[],
        system_prompt="",
        settings={},
        memory_state=mem.state(),
        pending_token=head[-1],
        sampler_state=None,
    )
    second = make(opener)
    assert second.numerics != first.numerics and second.fingerprint == first.fingerprint
    restored = restore(path, second, FullAttentionMemory)
    assert isinstance(restored, RestoredSession)
    k_saved, _ = first.read_kv(0, torch.arange(len(mem.tokens)))
    k_restored, _ = second.read_kv(0, torch.arange(len(mem.tokens)))
    assert torch.equal(k_saved, k_restored)  # the saved memory itself, not a recomputation
    logits = prefill(second, restored.memory, [head[-1]], 8)
    assert logits is not None
    rest = [int(logits.argmax())]
    for _ in range(10):
        out = prefill(second, restored.memory, [rest[-1]], 8)
        assert out is not None
        rest.append(int(out.argmax()))
    assert head + rest == reference[:23]


@pytest.mark.parametrize("kind", ["full", "cascade"])
def test_a_stop_between_layers_takes_the_chunk_back(four_layers: Path, kind: str) -> None:
    ids = list(range(5, 77))
    b = MLXBackend(four_layers, quantize="none")
    mem = memory(kind, b)
    # one poll before each chunk, then before layers 1..3: stop before layer 2 of the sixth chunk
    assert prefill(b, mem, ids, 8, should_stop=StopAt(5 * 4 + 1 + 2)) is None
    assert mem.tokens == ids[:40]
    rest = prefill(b, mem, ids[40:], 8)
    w = MLXBackend(four_layers, quantize="none")
    whole = memory(kind, w)
    want = prefill(w, whole, ids, 8)
    assert rest is not None and want is not None
    torch.testing.assert_close(rest, want, rtol=0.0, atol=0.0)
    assert mem.tokens == whole.tokens


def test_three_rows_in_one_forward_equal_each_row_alone_and_the_torch_backend(four_layers: Path) -> None:
    rows = [[3, 17, 40, 41, 9, 88], [5, 5, 6, 200, 7, 12], [250, 1, 2, 3, 4, 99]]
    n = len(rows[0])
    pos = torch.arange(n).repeat(3, 1)  # (3, T)
    slots = torch.arange(n).repeat(3, 1)  # (3, S')
    mask = slots[:, None, None, :] <= pos[:, None, :, None]  # (3, 1, T, S') causal
    batch = SlotBatch(positions=pos, write_slots=pos.clone(), slot_positions=slots, mask=mask)
    ours, ref = MLXBackend(four_layers, quantize="none"), TorchBackend(four_layers)
    ours.allocate(4, 64)  # a fourth row idle: the forward runs the leading three
    ref.allocate(4, 64)
    got = ours.forward(torch.tensor(rows), batch)
    torch.testing.assert_close(got, ref.forward(torch.tensor(rows), batch), rtol=1e-4, atol=1e-4)
    assert ours.query_summary().shape[0] == 4
    alone = MLXBackend(four_layers, quantize="none")
    alone.allocate(1, 64)
    one = SlotBatch(positions=pos[:1], write_slots=pos[:1], slot_positions=slots[:1], mask=mask[:1])
    for r, ids in enumerate(rows):
        alone.allocate(1, 64)
        torch.testing.assert_close(got[r : r + 1], alone.forward(torch.tensor([ids]), one), rtol=1e-5, atol=1e-5)
        k_batch, _ = ours.read_kv(r, torch.arange(n))
        k_alone, _ = alone.read_kv(0, torch.arange(n))
        assert torch.equal(k_batch, k_alone)


@pytest.mark.parametrize("wrong", [None, 1])
def test_speculative_verifies_equal_plain_decoding(four_layers: Path, wrong: int | None) -> None:
    tok = Tokenizer.from_dir(four_layers)
    prompt = tok.encode("def main():\n    return 42\n")
    settings = GenerationSettings(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    plain = MLXBackend(four_layers, quantize="none")
    plain_mem = memory("cascade", plain)
    reference = [e.token for e in stream_generate(plain, plain_mem, tok, prompt, settings) if e.token is not None]
    spec = MLXBackend(four_layers, quantize="none")
    spec_mem = memory("cascade", spec)
    speculator = Speculator(Reference(reference, len(prompt), wrong), Controller(max_k=4, adaptive=False))
    spec_settings = GenerationSettings(**{**vars(settings), "speculative": Speculation.LOOKUP})
    got = [
        e.token
        for e in stream_generate(spec, spec_mem, tok, prompt, spec_settings, speculator=speculator)
        if e.token is not None
    ]
    assert got == reference
    assert spec_mem.tokens == plain_mem.tokens


def test_what_the_backend_cannot_run_is_one_sentence(four_layers: Path) -> None:
    b = MLXBackend(four_layers, quantize="none")  # head dim 16: no whole q8_0 block per head row
    with pytest.raises(BackendUnavailable, match="multiple of 32"):
        b.set_kv_type(KVType.Q8_0)
    with pytest.raises(BackendUnavailable, match="not 'int8'"):
        MLXBackend(four_layers, quantize="int8")
    choice = open_backend(four_layers, "mlx", "none")
    assert choice.backend.name == "mlx" and choice.explain().startswith("mlx")


def mlx_folder(src: Path, out: Path, group: int, bits: int) -> tuple[Path, Path]:
    """An MLX-quantized folder of `src` written as mlx-lm writes one (mlx's own quantize; uint32 words, scales,
    biases), and an HF folder of the very weights it stands for (dequantized, fp32), the reference's."""
    import json
    import shutil

    from safetensors.numpy import save_file

    quantized, plain = out / "mlx", out / "plain"
    for d in (quantized, plain):
        d.mkdir(parents=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / f, d / f)
    config = json.loads((src / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps(config))
    (quantized / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": group, "bits": bits}}))
    mlx_state: dict[str, mx.array] = {}
    dense: dict[str, np.ndarray] = {}
    for name, w in mx.load(str(src / "model.safetensors")).items():
        if w.ndim == 2:
            q, s, b = mx.quantize(w, group_size=group, bits=bits)
            stem = name.removesuffix(".weight")
            mlx_state.update({name: q, stem + ".scales": s, stem + ".biases": b})
            dense[name] = np.array(mx.dequantize(q, s, b, group_size=group, bits=bits))
        else:
            mlx_state[name] = w
            dense[name] = np.array(w)
    mx.save_safetensors(str(quantized / "model.safetensors"), mlx_state, metadata={"format": "mlx"})
    save_file(dense, str(plain / "model.safetensors"), metadata={"format": "pt"})
    return quantized, plain


@pytest.mark.parametrize(
    ("family", "group", "bits"), [("llama", 64, 4), ("qwen3", 32, 8), *((f, 32, 4) for f in ("gemma3", "phi3"))]
)
def test_an_mlx_quantized_folder_runs_as_stored(
    four_layers: Path, tmp_path: Path, family: str, group: int, bits: int
) -> None:
    """mlx-lm's layouts (Phi-3's fused projections, Gemma's raw norms) give the logits of the weights they hold."""
    src = four_layers if family == "llama" else make_tiny_family(tmp_path / family, family)
    quantized, plain = mlx_folder(src, tmp_path / "out", group=group, bits=bits)
    tok = Tokenizer.from_dir(src)
    prompt = tok.encode(PROMPT)
    ours, ref = MLXBackend(quantized), TorchBackend(plain)
    assert ours.quantize == f"mlx{bits}g{group}" and f"{bits}-bit affine groups of {group}" in ours.kernels_note
    assert ours.weight_bytes < MLXBackend(plain, quantize="none").weight_bytes / 2
    ours.allocate(1, 256)
    ref.allocate(1, 256)
    got = prefill(ours, FullAttentionMemory(ours), prompt, 16)
    want = prefill(ref, FullAttentionMemory(ref), prompt, 16)
    assert got is not None and want is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(BackendUnavailable, match="run as stored"):
        MLXBackend(quantized, quantize="q8_0")
    assert tokens(ours, memory("full", ours), tok, prompt, 16) == tokens(ref, memory("full", ref), tok, prompt, 16)


def test_a_damaged_mlx_folder_is_refused_in_one_sentence(four_layers: Path, tmp_path: Path) -> None:
    quantized, _ = mlx_folder(four_layers, tmp_path, group=64, bits=4)
    f = quantized / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])  # truncated: the last tensor's span passes the end
    with pytest.raises(ModelLoadError, match="inconsistent sizes"):
        MLXBackend(quantized)


def test_a_compact_session_is_recomputed_on_other_numerics_and_identical_on_the_same(
    four_layers: Path, tmp_path: Path
) -> None:
    """Today's numerics rule: a compact file's memory is fed again on open, and its digest says whether the result
    is the saved memory itself (the same numerics) or a near copy (MLX's file opened on torch)."""
    from engine.session.engine import Engine, memory_factory_for

    settings = GenerationSettings(max_tokens=8, sampling=GREEDY, ignore_eos=True)

    def engine(backend: str) -> Engine:
        factory = memory_factory_for(four_layers, cache_dir=tmp_path / backend, prefix_cache=False)
        return Engine.load(four_layers, backend, memory_factory=factory)

    mlx = engine("mlx").new_session()
    list(mlx.chat("The quick brown fox", settings))
    compact, full = tmp_path / "compact.spark", tmp_path / "full.spark"
    mlx.save(compact, compact=True, digest=True)
    mlx.save(full)
    same = engine("mlx").new_session().load(compact)
    assert same.applied and not same.transcript_only and "(recomputed, identical)" in same.message
    other = engine("cpu").new_session()
    moved = other.load(compact)
    assert moved.applied and not moved.transcript_only and "differs slightly" in moved.message
    kept = engine("cpu").new_session()
    report = kept.load(full)
    assert report.applied and "recomputed" not in report.message  # the saved KV itself, reused
    assert [e.token for e in kept.chat("jumps over", settings) if e.token is not None]


def test_beams_equal_the_torch_backends(four_layers: Path) -> None:
    from engine.generation.beam import BeamSettings

    tok = Tokenizer.from_dir(four_layers)
    prompt = tok.encode("The quick brown fox")
    settings = GenerationSettings(
        max_tokens=12, sampling=GREEDY, ignore_eos=True, beam=BeamSettings(beams=4, returned=4)
    )
    results = []
    for b in (MLXBackend(four_layers, quantize="none"), TorchBackend(four_layers)):
        b.allocate(1, 256)
        events = list(stream_generate(b, FullAttentionMemory(b), tok, prompt, settings))
        results.append([list(h.tokens) for h in events[-1].beams])
    assert results[0] == results[1]


def test_mlx_quantizes_q8_0_kv_as_the_torch_backend_does() -> None:
    from engine.backends.mlx.slots import dequantize_q8_0, quantize_q8_0
    from engine.model.kv_types import dequantize_q8_0 as torch_dequantize
    from engine.model.kv_types import quantize_q8_0 as torch_quantize

    x = torch.randn(3, 5, 64) * torch.logspace(-3, 1, 64)  # blocks of very different ranges
    for values in (x, torch_dequantize(*torch_quantize(x))):  # fresh values, and a table's own reading
        codes, scales = quantize_q8_0(mx.array(values.numpy()))
        want_codes, want_scales = torch_quantize(values)
        assert torch.equal(torch.from_numpy(np.array(codes)), want_codes)
        assert torch.equal(torch.from_numpy(np.array(scales)), want_scales)
        got = torch.from_numpy(np.array(dequantize_q8_0(codes, scales)))
        assert torch.equal(got, torch_dequantize(want_codes, want_scales))


def test_a_q8_0_table_reads_as_the_torch_backends(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "m", heads=2, kv_heads=1)  # head dim 32: one q8_0 block per head row
    tok = Tokenizer.from_dir(d)
    prompt = tok.encode(PROMPT)
    ours, ref = MLXBackend(d, quantize="none"), TorchBackend(d, kv_type=KVType.Q8_0)
    ours.set_kv_type(KVType.Q8_0)
    assert ours.numerics.endswith("-kvq8_0") and ours.slot_bytes_per_token() == ref.kv_bytes_per_token() * 34 // 64
    got = prefill(ours, memory("full", ours), prompt, 16)
    want = prefill(ref, memory("full", ref), prompt, 16)
    assert got is not None and want is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    n = torch.arange(len(prompt))
    k, v = ours.read_kv(0, n)
    twin = ours.fork()
    twin.allocate(1, 256)
    twin.write_kv(0, n, k, v)  # a q8_0 reading written back holds the same blocks
    k2, v2 = twin.read_kv(0, n)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    o, r = MLXBackend(d, quantize="none"), TorchBackend(d, kv_type=KVType.Q8_0)
    o.set_kv_type(KVType.Q8_0)
    assert tokens(o, memory("cascade", o), tok, prompt, 32) == tokens(r, memory("cascade", r), tok, prompt, 32)


def test_the_cascade_of_a_small_cascade_json_slides_and_pages_as_on_torch(four_layers: Path, tmp_path: Path) -> None:
    """The engine's own set-up (a model folder's cascade.json, the persistent prefix cache) on MLX: a conversation
    past its window evicts tokens and pages blocks back in, and answers with the torch backend's tokens."""
    import json
    import shutil

    from engine.session.engine import Engine, memory_factory_for

    model = tmp_path / "small"
    shutil.copytree(four_layers, model)
    (model / "cascade.json").write_text(json.dumps({"window": 32, "block_size": 8, "retrieval_blocks": 2}))
    settings = GenerationSettings(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    replies, stats = [], []
    for backend in ("mlx", "cpu"):
        factory = memory_factory_for(model, cache_dir=tmp_path / backend)
        session = Engine.load(model, backend, memory_factory=factory).new_session()
        got = [e.token for e in session.chat(PROMPT * 2, settings) if e.token is not None]
        got += [e.token for e in session.chat("and the dog?", settings) if e.token is not None]
        replies.append(got)
        stats.append(session.stats())
    assert replies[0] == replies[1]
    working = stats[0].working if stats[0] is not None else None
    assert working is not None and working.evictions > 0 and working.hits + working.misses > 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fp16_compute_as_on_metal_stays_close_to_fp32(tmp_path: Path, four_layers: Path, family: str) -> None:
    """The Apple GPU's compute dtype, run here on the CPU: finite, the same top token, close logits."""
    d = four_layers if family == "llama" else make_tiny_family(tmp_path / family, family)
    prompt = Tokenizer.from_dir(d).encode(PROMPT)
    half, ref = MLXBackend(d, quantize="none", dtype=mx.float16), TorchBackend(d)
    assert "float16" in half.numerics
    got = prefill(half, memory("full", half), prompt, 16)
    want = prefill(ref, memory("full", ref), prompt, 16)
    assert got is not None and want is not None and bool(torch.isfinite(got).all())
    assert int(got.argmax()) == int(want.argmax())
    torch.testing.assert_close(got, want, rtol=0.0, atol=5e-2)


def test_a_three_row_batch_through_the_batcher_gives_each_prompts_lone_tokens(four_layers: Path) -> None:
    from engine.generation.batch import generate_batch

    tok = Tokenizer.from_dir(four_layers)
    prompts = ["The quick brown fox", "def main():\n    return 42\n", PROMPT]  # of different lengths: padded rows
    settings = GenerationSettings(max_tokens=16, sampling=GREEDY, ignore_eos=True)
    batched = generate_batch(MLXBackend(four_layers, quantize="none"), tok, prompts, settings)
    for text, done in zip(prompts, batched, strict=True):
        alone = MLXBackend(four_layers, quantize="none")
        assert list(done.tokens) == tokens(alone, memory("full", alone), tok, tok.encode(text), 16)
        ref = TorchBackend(four_layers)
        assert list(done.tokens) == tokens(ref, memory("full", ref), tok, tok.encode(text), 16)
