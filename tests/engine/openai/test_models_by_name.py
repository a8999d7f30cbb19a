"""Every model by name: two tiny models of different tokenizers and templates served from one server, loaded when a
request names them, at most `max_models` resident (least recently used unloaded, never one with a request in
flight), unloaded after their keep-alive; through the `openai` and `ollama` clients; and `serve` itself."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import psutil
import pytest

from engine.backends.torch_backend import TorchBackend
from engine.loading.tokenizer import Tokenizer
from engine.openai.errors import ApiError
from engine.openai.metrics import Metrics
from engine.openai.pool import ModelPool, Servable, parse_keep_alive
from engine.openai.server import LocalServer
from engine.openai.service import ModelService, ServeConfig
from engine.session.engine import memory_factory_for
from tests.helpers.default_model import default_model_dir
from tests.helpers.http_clients import closed_after_test
from tests.helpers.server import CASCADE, KEY
from tests.helpers.tiny import make_tiny_model
from tests.helpers.tiny_families import make_tiny_qwen3

ROOT = Path(__file__).resolve().parents[3]
ASK = [{"role": "user", "content": "The quick brown fox?"}]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("two")
    return {"llama": make_tiny_model(root / "llama"), "qwen": make_tiny_qwen3(root / "qwen")}


def loader(cache: Path, loads: list[str], gate: threading.Event | None = None):  # type: ignore[no-untyped-def]
    def load(s: Servable, config: ServeConfig, metrics: Metrics) -> ModelService:
        assert s.path is not None
        loads.append(s.name)
        if gate is not None:
            gate.wait(30)  # a slow load, held until the test lets it go
        factory = memory_factory_for(s.path, cache_dir=cache, **CASCADE)
        return ModelService(TorchBackend(s.path), Tokenizer.from_dir(s.path), factory, config, None, metrics)

    return load


def pool_of(models: dict[str, Path], cache: Path, loads: list[str], **kw: object) -> ModelPool:
    config = ServeConfig(model_id="llama", api_key=KEY, max_batch=2, max_prompt_tokens=2000)
    servable = [Servable(n, p) for n, p in models.items()]
    return ModelPool(servable, config, loader(cache, loads, kw.pop("gate", None)), **kw)  # type: ignore[arg-type]


@pytest.fixture
def one_at_a_time(models: dict[str, Path], tmp_path: Path) -> Iterator[tuple[LocalServer, list[str]]]:
    loads: list[str] = []
    with LocalServer(pool_of(models, tmp_path, loads, max_models=1), port=0) as server:
        yield server, loads


def test_two_models_answer_alternately_by_name_one_resident(one_at_a_time: tuple[LocalServer, list[str]]) -> None:
    server, loads = one_at_a_time
    client = closed_after_test(openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60))
    listed = client.models.list().data
    assert {m.id: m.model_extra["loaded"] for m in listed} == {"llama": False, "qwen": False}  # type: ignore[index]
    pool = server.service
    assert isinstance(pool, ModelPool)
    for name in ("llama", "qwen", "llama", "qwen"):
        r = client.chat.completions.create(model=name, messages=ASK, max_tokens=3, temperature=0)  # type: ignore[arg-type]
        assert r.model == name and r.usage is not None
        # Each counts its prompt with its own tokenizer and template.
        tok = pool.residents[name].service.tokenizer
        assert r.usage.prompt_tokens == len(tok.encode_chat(ASK))
        assert list(pool.residents) == [name]  # --max-models 1: only the one asked for is resident
    assert loads == ["llama", "qwen", "llama", "qwen"]
    assert {m.id: m.model_extra["loaded"] for m in client.models.list().data} == {"llama": False, "qwen": True}  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2)  # type: ignore[arg-type]
    assert "'llama', 'qwen'" in str(info.value)
    metrics = httpx.get(server.url.removesuffix("/v1") + "/metrics", headers=AUTH).text
    assert (
        'spark_model_loads_total{model="qwen"} 2' in metrics and 'spark_model_unloads_total{model="llama"} 2' in metrics
    )
    assert 'spark_model_load_seconds_total{model="llama"}' in metrics


def test_ollama_lists_shows_and_unloads_by_keep_alive(one_at_a_time: tuple[LocalServer, list[str]]) -> None:
    server, _ = one_at_a_time
    host = server.url.removesuffix("/v1")
    with ollama.Client(host=host, headers=AUTH) as c:
        assert sorted(m.model for m in c.list().models) == ["llama", "qwen"]
        assert c.ps().models == []
        shown = c.show("qwen")
        assert "enable_thinking" in (shown.template or "") and "thinking" in (shown.capabilities or [])
        assert c.ps().models == []  # /api/show reads the template without loading the weights
        r = c.generate(model="qwen", prompt="Hi", options={"num_predict": 2, "temperature": 0})
        assert r.done and r.model == "qwen"
        assert [m.model for m in c.ps().models] == ["qwen"]
        raw = c.generate(model="qwen", prompt="The quick", raw=True, options={"num_predict": 2})  # no template
        pool = server.service
        assert isinstance(pool, ModelPool)
        assert raw.done and raw.prompt_eval_count == len(pool.residents["qwen"].service.tokenizer.encode("The quick"))
        c.chat(model="llama", messages=ASK, options={"num_predict": 2}, keep_alive=0)  # unload once idle
        deadline = time.monotonic() + 30
        while c.ps().models and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.ps().models == []
        r2 = c.chat(model="llama", messages=ASK, options={"num_predict": 2})  # the next request loads it again
        assert r2.done and [m.model for m in c.ps().models] == ["llama"]
        loaded = c.generate(model="qwen", prompt="")  # an empty prompt only loads the model
        assert loaded.done_reason == "load" and [m.model for m in c.ps().models] == ["qwen"]
        gone = c.generate(model="qwen", prompt="", keep_alive=0)
        assert gone.done_reason == "unload" and c.ps().models == []
    bad = httpx.post(host + "/api/chat", json={"model": "llama", "messages": ASK, "keep_alive": "soon"}, headers=AUTH)
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_a_model_loading_does_not_hold_up_another_resident_one(models: dict[str, Path], tmp_path: Path) -> None:
    loads: list[str] = []
    gate = threading.Event()
    pool = pool_of(models, tmp_path, loads, max_models=2, gate=gate)

    async def scenario() -> None:
        gate.set()
        first = await pool.acquire("llama")
        first.release()
        gate.clear()
        loading = asyncio.create_task(pool.acquire("qwen"))  # held in its loader until the gate opens
        await asyncio.sleep(0.1)
        assert not loading.done() and "qwen" in pool.loading
        lease = await asyncio.wait_for(pool.acquire("llama"), 5)  # the resident model is served meanwhile
        lease.release()
        gate.set()
        (await loading).release()
        assert sorted(pool.residents) == ["llama", "qwen"]

    asyncio.run(scenario())
    pool.close()


def test_a_model_with_a_request_in_flight_is_never_unloaded(models: dict[str, Path], tmp_path: Path) -> None:
    pool = pool_of(models, tmp_path, [], max_models=1, keep_alive_s=0.0)

    async def scenario() -> None:
        busy = await pool.acquire("llama")
        await pool.sweep()
        assert "llama" in pool.residents  # keep-alive 0, but in flight
        other = asyncio.create_task(pool.acquire("qwen"))  # no room: waits for the lease to end
        await asyncio.sleep(0.2)
        assert not other.done() and list(pool.residents) == ["llama"]
        busy.release()
        (await asyncio.wait_for(other, 30)).release()
        assert list(pool.residents) == ["qwen"]
        with pytest.raises(ApiError) as info:
            await pool.acquire("nothing")
        assert info.value.status == 404

    asyncio.run(scenario())
    pool.close()


def test_keep_alive_values() -> None:
    assert [parse_keep_alive(v) for v in (None, 0, 30, "30s", "5m", "1h", "250ms", -1, "-1m")] == [
        False, 0.0, 30.0, 30.0, 300.0, 3600.0, 0.25, None, None
    ]  # fmt: skip
    for bad in ("soon", True, [], "m", float("nan")):
        with pytest.raises(ValueError):
            parse_keep_alive(bad)


def test_serve_serves_added_models_by_name(models: dict[str, Path], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLOT_SPARK_MODELS_DIR": str(tmp_path / "lib"),
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "MLOT_SPARK_API_KEY": KEY}  # fmt: skip
    cmd = [sys.executable, "-m", "engine", "serve", "--model", str(models["llama"]), "--add-model", str(models["qwen"]),
           "--max-models", "1", "--keep-alive", "1", "--port", "0", "--backend", "cpu", "--no-prefix-cache"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("serving "):
                url = line.split(" at ")[1].split(" ")[0]
                break
        assert url is not None, "the server did not start"
        assert "and 1 more by name" in line
        client = closed_after_test(openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120))
        assert sorted(m.id for m in client.models.list().data) == ["llama", "qwen"]
        for name in ("qwen", "llama"):
            r = client.chat.completions.create(model=name, messages=ASK, max_tokens=2)  # type: ignore[arg-type]
            assert r.model == name
        ps = httpx.get(url.removesuffix("/v1") + "/api/ps", headers=AUTH).json()["models"]
        assert [m["model"] for m in ps] == ["llama"]
        deadline = time.monotonic() + 30
        while (
            httpx.get(url.removesuffix("/v1") + "/api/ps", headers=AUTH).json()["models"]
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert httpx.get(url.removesuffix("/v1") + "/api/ps", headers=AUTH).json()["models"] == []  # --keep-alive 1
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # reads what is left and closes the pipe


def serving(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """`serve` started, and its URL (read from its "serving …" line)."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("serving "):
            return proc, line.split(" at ")[1].split(" ")[0]
    proc.communicate(timeout=30)
    raise AssertionError("the server did not start")


def rss_growth_on_switch(models: tuple[Path, Path], max_models: int, tmp_path: Path) -> int:
    """Bytes the serving process's RSS grew by when a request named the second model, after one to the first."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLOT_SPARK_MODELS_DIR": str(tmp_path / "lib"),
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "MLOT_SPARK_API_KEY": KEY}  # fmt: skip
    cmd = [sys.executable, "-m", "engine", "serve", "--model", str(models[0]), "--add-model", str(models[1]),
           "--max-models", str(max_models), "--port", "0", "--backend", "cpu", "--no-prefix-cache",
           "--max-batch", "1"]  # fmt: skip
    proc, url = serving(cmd, env)
    try:
        process = psutil.Process(proc.pid)
        client = closed_after_test(openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=300))
        rss = []
        for path in models:
            r = client.chat.completions.create(model=path.stem, messages=ASK, max_tokens=2)  # type: ignore[arg-type]
            assert r.model == path.stem
            rss.append(process.memory_info().rss)
        return int(rss[1] - rss[0])
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.mark.slow  # four loads of a ~100 MB model in two servers: 97 s on the 2-core VM
def test_max_models_1_keeps_one_model_resident_as_rss_shows(tmp_path: Path) -> None:
    # The default model's GGUF (~100 MB) and a copy of it under another name: big enough for RSS to show.
    gguf = default_model_dir()
    models = (tmp_path / "a" / "smol-a.gguf", tmp_path / "b" / "smol-b.gguf")
    for path in models:
        path.parent.mkdir()
        shutil.copyfile(gguf, path)
    size = gguf.stat().st_size
    both = rss_growth_on_switch(models, 2, tmp_path / "two")
    one = rss_growth_on_switch(models, 1, tmp_path / "one")
    print(f"RSS growth on switching to a second ~{size >> 20} MiB model: max 2 {both >> 20} MiB, max 1 {one >> 20} MiB")
    assert both > size // 2  # two resident: the second's weights on top of the first's (what RSS can see)
    assert one < size // 2  # one resident: the first's weights went before the second's came
