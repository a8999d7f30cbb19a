"""Broken or hostile model folders: every one is a single-sentence SparkError, never a traceback, a division by
zero or a table sized by the file (config.json, cascade.json, safetensors headers, NaN weights)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import SparkError
from engine.loading.tokenizer import Tokenizer
from engine.loading.weights import load_model
from engine.memory.cascade import CascadeConfig
from engine.model.config import ModelConfig
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hostile-models") / "base")


def _config(edit: dict) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        c = json.loads((d / "config.json").read_text())
        c.update(edit)
        (d / "config.json").write_text(json.dumps(c))

    return apply


def _raw_config(text: str) -> Callable[[Path], None]:
    return lambda d: (d / "config.json").write_text(text)


def _header(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        p = d / "model.safetensors"
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        edit(header[next(k for k in header if k != "__metadata__")])
        text = json.dumps(header).encode()  # float("inf") is written as Infinity, as a hostile writer would
        p.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])

    return apply


def _nan_weight(d: Path) -> None:
    tensors = load_file(d / "model.safetensors")
    name = min(tensors)
    tensors[name][0] = float("nan")
    save_file(tensors, d / "model.safetensors")


CASES: dict[str, Callable[[Path], None]] = {
    "0 layers": _config({"num_hidden_layers": 0}),
    "0 heads": _config({"num_attention_heads": 0}),
    "negative hidden size": _config({"hidden_size": -64}),
    "layers as a list": _config({"num_hidden_layers": [2]}),
    "layers as a string": _config({"num_hidden_layers": "2"}),
    "layers as true": _config({"num_hidden_layers": True}),
    "heads not dividing": _config({"num_key_value_heads": 3}),
    "huge max_position_embeddings": _config({"max_position_embeddings": 10**12}),
    "NaN rms_norm_eps": _raw_config('{"architectures": ["LlamaForCausalLM"], "rms_norm_eps": NaN}'),
    "Infinity vocab": _raw_config('{"architectures": ["LlamaForCausalLM"], "vocab_size": Infinity, "hidden_size": 64}'),
    "deep JSON": _raw_config("[" * 100_000 + "]" * 100_000),
    "deep object": _raw_config('{"a":' * 50_000 + "1" + "}" * 50_000),
    "Infinity in a shape": _header(lambda e: e.__setitem__("shape", [float("inf"), 1])),
    "negative shape": _header(lambda e: e.__setitem__("shape", [-1, 0])),
    "string shape": _header(lambda e: e.__setitem__("shape", ["2", "3"])),
    "float offsets": _header(lambda e: e.__setitem__("data_offsets", [0.0, 4.5])),
    "dtype as a list": _header(lambda e: e.__setitem__("dtype", ["F32"])),
    "NaN weights": _nan_weight,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_broken_model_folder_is_one_sentence(base: Path, tmp_path: Path, name: str) -> None:
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    CASES[name](folder)
    with pytest.raises(SparkError) as info:
        config = ModelConfig.from_file(folder / "config.json")
        Tokenizer.from_dir(folder)
        load_model(folder)
        CascadeConfig.for_model(folder, config)
    message = str(info.value)
    assert "\n" not in message and message.endswith("."), message


@pytest.mark.parametrize(
    "value", ["Infinity", "1e999", "[4]", '"4"', "-4", "4.5", "true", "[" * 100_000 + "]" * 100_000]
)
def test_a_broken_cascade_json_is_one_sentence(base: Path, tmp_path: Path, value: str) -> None:
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    (folder / "cascade.json").write_text(value if value.startswith("[[") else f'{{"window": {value}}}')
    with pytest.raises(SparkError) as info:
        CascadeConfig.for_model(folder, ModelConfig.from_file(folder / "config.json"))
    assert "\n" not in str(info.value) and str(info.value).endswith(".")


def test_the_unbroken_folder_loads(base: Path) -> None:
    loaded = load_model(base)
    assert all(torch.isfinite(p).all() for p in loaded.model.state_dict().values())
