"""Loading model folders: real format, memory-mapped, and one clear sentence for every way a folder is wrong."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.backends.torch_backend import TorchBackend
from engine.errors import ModelLoadError
from engine.loading.weights import load_model, read_safetensors_header
from engine.memory.base import FullAttentionMemory
from tests.helpers.fixtures import TinyModel
from tests.helpers.gguf_files import with_tensor_as, write_gguf
from tests.helpers.tiny import make_tiny_model


def copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def one_sentence(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and msg.endswith(".") and len(msg) < 300, msg
    return msg


def test_fp32_weights_are_views_of_the_file_not_copies(tiny: TinyModel) -> None:
    loaded = load_model(tiny.path)
    table = {t.name: t for t in read_safetensors_header(tiny.path / "model.safetensors")}
    state = loaded.model.state_dict()
    a, b = "model.embed_tokens.weight", "model.norm.weight"
    # Both tensors live in one mapping of the file: their addresses differ exactly by their file offsets.
    assert state[b].data_ptr() - state[a].data_ptr() == table[b].start - table[a].start


def test_fingerprint_is_stable_and_content_sensitive(tiny: TinyModel, tmp_path: Path) -> None:
    assert load_model(tiny.path).fingerprint == load_model(tiny.path).fingerprint
    other = make_tiny_model(tmp_path / "other", seed=1)  # same shapes, other weights
    assert load_model(other).fingerprint != load_model(tiny.path).fingerprint


def test_sharded_checkpoint_loads(tiny: TinyModel, tmp_path: Path) -> None:
    d = copy_model(tiny.path, tmp_path / "sharded")
    state = load_model(tiny.path).model.state_dict()
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(halves):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: state[n].contiguous() for n in part}, str(d / fname))
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b = load_model(d).model, load_model(tiny.path).model
    assert all(torch.equal(a.state_dict()[n], b.state_dict()[n]) for n in names)


@pytest.mark.parametrize(
    "breakage, expected",
    [
        ("missing_folder", "does not exist"),
        ("file_not_folder", "neither a GGUF file nor a model folder"),
        ("no_config", "has no config.json"),
        ("bad_config_json", "is not valid JSON"),
        ("unknown_arch", "is not supported"),
        ("truncated", "truncated"),
        ("garbage_header", "corrupt header"),
        ("pickle_only", "pickle"),
        ("missing_tensor", "lack"),
        ("wrong_shape", "has shape"),
        ("int_weights", "floating point"),
        ("missing_shard", "missing shard"),
    ],
)
def test_bad_model_folders_give_one_clear_sentence(
    tiny: TinyModel, tmp_path: Path, breakage: str, expected: str
) -> None:
    target = tmp_path / "model"
    if breakage == "missing_folder":
        pass
    elif breakage == "file_not_folder":
        target.write_text("hello")
    else:
        copy_model(tiny.path, target)
        st = target / "model.safetensors"
        state = load_model(tiny.path).model.state_dict()
        if breakage == "no_config":
            (target / "config.json").unlink()
        elif breakage == "bad_config_json":
            (target / "config.json").write_text("{not json")
        elif breakage == "unknown_arch":
            cfg = json.loads((target / "config.json").read_text())
            cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
            (target / "config.json").write_text(json.dumps(cfg))
        elif breakage == "truncated":
            st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
        elif breakage == "garbage_header":
            st.write_bytes(struct.pack("<Q", 2**40) + b"x" * 100)
        elif breakage == "pickle_only":
            st.unlink()
            (target / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
        elif breakage == "missing_tensor":
            save_file({k: v.contiguous() for k, v in state.items() if "layers.1.mlp" not in k}, str(st))
        elif breakage == "wrong_shape":
            state = {k: v.contiguous() for k, v in state.items()}
            state["model.norm.weight"] = torch.ones(7)
            save_file(state, str(st))
        elif breakage == "int_weights":
            state = {k: v.contiguous() for k, v in state.items()}
            state["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
            save_file(state, str(st))
        elif breakage == "missing_shard":
            (target / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
            )
    with pytest.raises(ModelLoadError) as err:
        load_model(target)
    assert expected in one_sentence(err.value)


def test_pickle_files_are_never_opened(tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = copy_model(tiny.path, tmp_path / "both")
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04malicious")
    import pickle

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("pickle was used")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    load_model(d)  # safetensors wins; the .bin is ignored


def test_header_reader_rejects_offsets_past_the_end(tiny: TinyModel, tmp_path: Path) -> None:
    st = tmp_path / "x.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    st.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(ModelLoadError, match="truncated"):
        read_safetensors_header(st)


@pytest.fixture(scope="module")
def tiny256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Rows of 256 weights: a whole number of blocks for every type, K-quants included.
    return make_tiny_model(
        tmp_path_factory.mktemp("g256"), "llama", hidden=256, intermediate=512, heads=4, kv_heads=2, layers=2
    )


def cpu_logits(backend: TorchBackend) -> torch.Tensor:
    backend.allocate(1, 64)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    return backend.forward(ids, FullAttentionMemory(backend).plan(ids[0].tolist()).as_batch())[0]  # (T, V)


def test_gguf_block_matrices_run_as_stored_without_an_fp32_copy(tiny256: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny256, tmp_path / "m.gguf", "q4_1")
    lean = load_model(path, leave_stored=True)
    q = lean.model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert q.is_meta and "model.layers.0.self_attn.q_proj.weight" in lean.stored  # never dequantized
    assert not lean.model.get_parameter("model.norm.weight").is_meta
    direct = TorchBackend(path, "cpu", quantize="auto")  # leaves the blocks undecoded
    assert direct.quantize == "q4_1" and not any(p.is_meta for p in direct.model.parameters())
    # The same blocks handed over after a full fp32 load (the path before): the very same logits.
    after_fp32 = TorchBackend(path, "cpu", quantize="auto", stored=load_model(path).stored)
    assert torch.equal(cpu_logits(direct), cpu_logits(after_fp32))
    assert direct.weight_bytes == after_fp32.weight_bytes


@pytest.mark.parametrize("kind", ["q2_k", "mixed"])
def test_gguf_blocks_of_every_kernel_format_run_as_stored_even_mixed(tiny256: Path, tmp_path: Path, kind: str) -> None:
    """Q2_K has its kernel; a fused q/k/v of two formats (Q4_1 beside Q8_0) keeps a run of rows per format. Nothing
    is read in fp32, and the logits are those of the same blocks dequantized, within int16 activation rounding."""
    import gguf

    if kind == "q2_k":
        path = write_gguf(tiny256, tmp_path / "k.gguf", "q2_k")
    else:
        q41 = write_gguf(tiny256, tmp_path / "a.gguf", "q4_1")
        path = with_tensor_as(q41, tmp_path / "mixed.gguf", "blk.0.attn_k.weight", gguf.GGMLQuantizationType.Q8_0)
    auto = TorchBackend(path, "cpu", quantize="auto")
    assert auto.quantize != "none" and auto.kernels_note.startswith("native")
    assert not any(p.is_meta for p in auto.model.parameters())
    native, dequantized = cpu_logits(auto), cpu_logits(TorchBackend(path, "cpu", quantize="auto", kernels="torch"))
    assert float(((native - dequantized).norm(dim=-1) / dequantized.norm(dim=-1)).max()) < 1e-3


def test_a_nan_block_scale_is_refused_in_one_sentence(tiny256: Path, tmp_path: Path) -> None:
    import gguf

    path = write_gguf(tiny256, tmp_path / "nan.gguf", "q8_0")
    at = next(t.data_offset for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    raw = bytearray(path.read_bytes())
    raw[at : at + 2] = np.array([np.nan], np.float16).tobytes()  # the first block's scale
    path.write_bytes(bytes(raw))
    for leave_stored in (True, False):  # left as stored or dequantized: the same refusal
        with pytest.raises(ModelLoadError) as err:
            load_model(path, leave_stored=leave_stored)
        assert "model.layers.1.mlp.down_proj.weight holds NaN or infinite values" in one_sentence(err.value)
